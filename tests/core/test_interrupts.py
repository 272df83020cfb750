"""Ctrl-C (and SIGTERM) stop a run within seconds: during an embedded-model call, during
training; the MLflow runs are ended KILLED and one line says how to resume."""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from core import interrupts

#: seconds from the signal to the process's end that the tests accept. The target, 2 s, is
#: measured on an idle machine by benchmarks/first_run.py; a test runs beside others (at a
#: load of 4 the model makes 2-4 tokens/s, and it stops at its next token), hence the margin.
LATENCY_S = 8.0

GENERATE = textwrap.dedent("""
    import sys, time
    from core import interrupts
    from core.llm import embedded, make_client
    interrupts.install()
    client = make_client({"cache": True, "cache_path": sys.argv[1], "max_tokens": 3000, "temperature": 0.0,
                          "show_progress": False})
    embedded.get_server(client.model.split("/", 1)[1])
    print("ready", flush=True)
    ask = [{"role": "user", "content": "Count from 1 to 3000, one number per line."}]
    try:
        if sys.argv[2] == "many":
            client.chat_many([{"messages": ask, "seed": s} for s in range(2)])
        else:
            client.chat(ask)
        print("finished", flush=True)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        interrupts.leave(130)
""")


def _stop_after(proc: subprocess.Popen, sig: int, ready: str, wait_s: float) -> tuple[float, str]:
    """Wait for the line ``ready`` (or an MLflow run, see below), then ``wait_s``; send ``sig``;
    return the seconds until the process ended and everything it printed."""
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if line.strip() == ready:
            break
    time.sleep(wait_s)
    assert proc.poll() is None, "".join(lines)
    sent = time.perf_counter()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    return time.perf_counter() - sent, "".join(lines) + out


def test_install_makes_sigterm_a_keyboard_interrupt_and_stops_generation(monkeypatch):
    from core.llm import embedded

    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        interrupts.install()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
        assert embedded._cancelled.is_set()  # a generation in another thread would stop at its next token
    finally:
        embedded._cancelled.clear()
        for s, handler in previous.items():
            signal.signal(s, handler)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["one", "many"])
def test_ctrl_c_during_an_embedded_call_ends_the_process_within_seconds(tmp_path, how):
    """One call on the main thread, or two at once from chat_many's thread pool (which waits
    for its threads on the way out: they must stop generating)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", GENERATE, str(tmp_path / "c.sqlite"), how],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    latency, out = _stop_after(proc, signal.SIGINT, "ready", wait_s=3.0)
    assert "finished" not in out, out  # it was still generating when interrupted
    assert proc.returncode == 130 and "interrupted" in out, out
    assert latency <= LATENCY_S, f"{latency:.1f} s from Ctrl-C to exit\n{out}"
    assert "Exception ignored" not in out, out
    # nothing partial was cached: the request is asked again next time
    with sqlite3.connect(tmp_path / "c.sqlite") as db:
        tables = [r[0] for r in db.execute("select name from sqlite_master where type='table'")]
        assert all(db.execute(f"select count(*) from {t}").fetchone()[0] == 0 for t in tables)


def _mlflow_statuses(db: Path) -> list[str]:
    if not db.exists():
        return []
    try:
        with sqlite3.connect(db) as con:
            return [r[0] for r in con.execute("select status from runs")]
    except sqlite3.Error:
        return []


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_signal_during_training_ends_the_run_killed_with_a_resume_hint(tmp_path, sig):
    db = tmp_path / "mlflow.db"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "core",
            "env=cartpole",
            "trainer.frames=2000000",
            "progress=false",
            f"tracking.uri=sqlite:///{db}",
            f"tracking.artifact_location={tmp_path / 'art'}",
            f"cache_dir={tmp_path / 'cache'}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
    )
    deadline = time.monotonic() + 180
    while "RUNNING" not in _mlflow_statuses(db):  # the parent run is open
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.5)
    time.sleep(8.0)  # into the training (2M CartPole frames last minutes): its candidate run is written at its end
    sent = time.perf_counter()
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    latency = time.perf_counter() - sent
    assert proc.returncode == 130, out
    assert interrupts.RESUME_HINT in out, out  # one line
    assert "Traceback" not in out, out
    assert latency <= LATENCY_S, f"{latency:.1f} s from the signal to exit\n{out}"
    statuses = _mlflow_statuses(db)
    assert statuses and "RUNNING" not in statuses and "KILLED" in statuses, statuses


SLOW_SHUTDOWN = textwrap.dedent("""
    import atexit, multiprocessing, sys, time
    from core import interrupts

    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(120,))
        child.start()
        print(child.pid, flush=True)
        atexit.register(time.sleep, 10)  # as slow as the final garbage collection of torch and MLflow was
        interrupts.leave(130)
""")


def test_leaving_after_an_interrupt_skips_pythons_slow_shutdown_and_ends_worker_processes(tmp_path):
    """Ctrl-C during training took 10-17 s at a load of 7-9, 8 of them in the interpreter's final
    garbage collection after the run had ended: leave() exits at once, and ends the workers."""
    script = tmp_path / "leave.py"
    script.write_text(SLOW_SHUTDOWN)
    began = time.perf_counter()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 130, proc.stderr
    assert time.perf_counter() - began < 8.0  # the atexit sleep (10 s) never ran; start-up and the child's spawn did
    child = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the worker process was left running")
