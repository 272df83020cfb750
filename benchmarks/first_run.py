"""A new user's first session, scripted: the README's commands, the quick preset of the
headline command, Ctrl-C and the MLflow UI, each timed.

    python benchmarks/first_run.py --out docs/scaling/first_run.json     # about 30-60 min on 2 cores
    python benchmarks/first_run.py --seeds 0 --skip readme ctrl_c ui     # the quick preset alone

Everything runs as a user would run it, as subprocesses in a fresh folder (its
``mlflow.db``, its own LLM reply cache: nothing is answered from an earlier session's):

- ``readme``: ``python -m core --help``, ``python -m core.registry``, ``python -m core``
  (the baseline) and ``python -m core.llm "..."``; each one's exit status and seconds.
  (The README's ``python -m pytest`` is the test suite, not run here.)
- ``quick``: ``python -m core +plugins=[eureka,envgen] env=minecraft +preset=quick seed=<s>``
  per seed: wall time, the seconds spent waiting on the LLM (the parent run's
  ``llm/wait_s``) and their share, Eureka's programs sampled, usable and trained (its
  ``llm4rl.contribution.eureka`` tag), the winner and its fitness. Target: each run
  <= 8 min, an LLM-written reward trained on at least 2 of 3 seeds.
- ``ctrl_c``: SIGINT to the headline-style command while the embedded model generates
  (after its "loaded" line and a few seconds), and to a long baseline training; seconds
  from the signal to the process's end, its exit status, whether it printed the resume
  line. Target: <= 2 s each.
- ``ui``: ``python -m core.ui`` on the session's store: seconds until it prints the
  experiment's URL and until that page's HTML is served. Target: <= 10 s. It needs a run in
  the store (the ``readme`` step makes one); without one the UI has no experiment to show,
  and its last lines are recorded instead.

Prints one JSON object (and writes it to ``--out``) with the machine's load average
before and after each step: on a shared machine the times follow the load.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

HEADLINE = ["+plugins=[eureka,envgen]", "env=minecraft", "+preset=quick"]
TARGETS = {"quick_wall_s": 480.0, "quick_seeds_with_llm_reward": 2, "ctrl_c_s": 2.0, "first_page_s": 10.0}
STEPS = ("readme", "quick", "ctrl_c", "ui")


def load() -> float:
    return round(os.getloadavg()[0], 2)


class Session:
    """A fresh folder and the environment every command of the session runs with."""

    def __init__(self, folder: Path, source: Path | None, python: str) -> None:
        self.folder = folder
        self.python = python
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        if source is not None:  # the code under test (a frozen copy of a tree), before the installed one
            self.env["PYTHONPATH"] = os.pathsep.join([str(source), self.env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.uri = f"sqlite:///{folder / 'mlflow.db'}"

    def core(self, *args: str) -> list[str]:
        """``python -m core`` with the session's store and reply cache."""
        return [
            self.python,
            "-m",
            "core",
            *args,
            f"tracking.uri={self.uri}",
            f"tracking.artifact_location={self.folder / 'mlartifacts'}",
            f"cache_dir={self.folder / 'cache'}",
        ]

    def run(self, cmd: list[str], timeout_s: float) -> dict[str, Any]:
        """Run ``cmd``; past ``timeout_s`` it gets Ctrl-C (SIGINT: its MLflow runs end KILLED, as a
        user's would), then SIGKILL 60 s later. ``rc`` is None for a command that timed out."""
        began, before = time.perf_counter(), load()
        proc = subprocess.Popen(
            cmd, cwd=self.folder, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, _ = proc.communicate()
            rc, out = None, f"timed out after {timeout_s} s (stopped with Ctrl-C)\n{out}"
        shown = " ".join(c for c in cmd if not c.startswith(("tracking.", "cache_dir=")))
        return {
            "command": shown.replace(self.python, "python"),
            "rc": rc,
            "seconds": round(time.perf_counter() - began, 1),
            "load_before": before,
            "load_after": load(),
            "tail": out.strip().splitlines()[-3:],
        }


def readme(session: Session) -> list[dict[str, Any]]:
    py = session.python
    return [
        session.run([py, "-m", "core", "--help"], 120),
        session.run([py, "-m", "core.registry"], 120),
        session.run(session.core("progress=false"), 1800),
        session.run([py, "-m", "core.llm", "Write a Python function that returns 1"], 900),
    ]


def _parents(uri: str) -> list[Any]:
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name("llm4rl")
    if experiment is None:
        return []
    return [
        r
        for r in client.search_runs(
            [experiment.experiment_id], "tags.`llm4rl.kind` = 'parent'", order_by=["attributes.start_time DESC"]
        )
    ]


def _llm_records(uri: str, run_id: str) -> list[str]:
    """The LLM calls a run recorded so far (its ``llm/`` artifacts), by name."""
    import mlflow

    try:
        return sorted(a.path.split("/", 1)[1] for a in mlflow.MlflowClient(uri).list_artifacts(run_id, "llm"))
    except Exception:  # a figure, never worth failing the benchmark for
        return []


CONTRIBUTION = re.compile(r"(\d+) LLM program\(s\), (\d+) usable, (none|\d+) trained")


def quick(
    session: Session,
    seeds: list[int],
    done: list[dict[str, Any]] | None = None,
    timeout_s: float = 3600,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The quick preset on ``seeds`` (those in ``done`` already measured are kept, not run again),
    each stopped after ``timeout_s``, with ``overrides`` after the preset (a key given on the
    command line wins over the preset's); ``llm_calls_done`` counts the LLM calls a run recorded
    (how far a run that timed out got)."""
    runs = [r for r in done or [] if r["seed"] in seeds]
    for seed in seeds:
        if any(r["seed"] == seed for r in runs):
            continue
        step = session.run(session.core(*HEADLINE, *overrides, f"seed={seed}", "progress=false"), timeout_s)
        parents = [
            p
            for p in _parents(session.uri)
            if p.data.tags.get("seed") == str(seed) and p.data.tags.get("plugins") == "envgen,eureka"
        ]
        record: dict[str, Any] = {"seed": seed, **step}
        if parents:
            p = parents[0]
            record["llm_calls_done"] = _llm_records(session.uri, p.info.run_id)
            wait = float(p.data.metrics.get("llm/wait_s", 0.0))
            m = CONTRIBUTION.search(p.data.tags.get("llm4rl.contribution.eureka", ""))
            sampled, usable, trained = (
                (int(m.group(1)), int(m.group(2)), 0 if m.group(3) == "none" else int(m.group(3))) if m else (0, 0, 0)
            )
            record.update(
                {
                    "llm_wait_s": round(wait, 1),
                    "llm_share": round(wait / step["seconds"], 3) if step["seconds"] else None,
                    "llm_calls": int(p.data.metrics.get("llm/calls", 0)),
                    "completion_tokens": int(p.data.metrics.get("llm/completion_tokens", 0)),
                    "rewards_sampled": sampled,
                    "rewards_usable": usable,
                    "rewards_trained": trained,
                    "llm_reward_trained": trained > 0,
                    "fitness": p.data.metrics.get("fitness"),
                    "result": p.data.tags.get("llm4rl.result", ""),
                    "status": p.info.status,
                    "contributions": {
                        k.split(".", 2)[2]: v for k, v in p.data.tags.items() if k.startswith("llm4rl.contribution.")
                    },
                }
            )
        runs.append(record)
    walls = [r["seconds"] for r in runs]
    with_reward = sum(bool(r.get("llm_reward_trained")) for r in runs)
    return {
        "command": "python -m core " + " ".join([*HEADLINE, *overrides]) + " seed=<s>",
        "runs": runs,
        "wall_s_max": max(walls) if walls else None,
        "seeds_with_llm_reward": with_reward,
        "met": {
            "wall_time": bool(walls) and max(walls) <= TARGETS["quick_wall_s"],
            "llm_reward": with_reward >= min(TARGETS["quick_seeds_with_llm_reward"], len(runs)),
        },
    }


def _interrupt(session: Session, cmd: list[str], ready: Any, wait_s: float, timeout_s: float = 600) -> dict[str, Any]:
    """Start ``cmd``; once ``ready()`` says so (it gets the output so far), wait ``wait_s``, send
    SIGINT and time the process's end."""
    out_path = session.folder / f"interrupt-{time.monotonic_ns()}.log"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=session.folder, env=session.env, stdout=out, stderr=subprocess.STDOUT, text=True
        )
        deadline = time.monotonic() + timeout_s
        while not ready(out_path.read_text()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                return {"error": "never got ready", "tail": out_path.read_text().splitlines()[-5:]}
            time.sleep(0.2)
        time.sleep(wait_s)
        running = proc.poll() is None
        sent, before = time.perf_counter(), load()
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        latency = time.perf_counter() - sent
    text = out_path.read_text()
    return {
        "latency_s": round(latency, 2),
        "running_when_sent": running,
        "rc": proc.returncode,
        "resume_line": "run the same command again to resume" in text,
        "traceback": "Traceback" in text,
        "load": before,
    }


def _mlflow_running(db: Path) -> bool:
    try:
        with sqlite3.connect(db) as con:
            return any(r[0] == "RUNNING" for r in con.execute("select status from runs"))
    except sqlite3.Error:
        return False


def ctrl_c(session: Session) -> dict[str, Any]:
    # the embedded model generating Eureka's rewards: a fresh cache, so nothing is replayed
    fresh = Session(session.folder / "ctrl_c", None, session.python)
    fresh.folder.mkdir(exist_ok=True)
    fresh.env = session.env
    during_llm = _interrupt(
        fresh,
        fresh.core("+plugins=[eureka]", "env=cartpole", "progress=false", "seed=1234"),
        lambda text: "embedded model" in text and "loaded" in text,
        wait_s=5.0,
    )
    db = session.folder / "ctrl_c_train.db"
    train = Session(session.folder, None, session.python)
    train.env, train.uri = session.env, f"sqlite:///{db}"
    during_training = _interrupt(
        train,
        train.core("env=cartpole", "trainer.frames=2000000", "progress=false"),
        lambda _: _mlflow_running(db),
        wait_s=8.0,
    )
    latencies = [r.get("latency_s") for r in (during_llm, during_training)]
    return {
        "embedded_call": during_llm,
        "training": during_training,
        "met": all(x is not None and x <= TARGETS["ctrl_c_s"] for x in latencies),
    }


def ui(session: Session) -> dict[str, Any]:
    cmd = [session.python, "-m", "core.ui", "--uri", session.uri, "--experiment", "llm4rl", "--port", "0"]
    began, before = time.perf_counter(), load()
    proc = subprocess.Popen(
        cmd, cwd=session.folder, env=session.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    url, printed, lines = "", None, []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line.rstrip())
        if "MLflow UI ready" in line:
            printed = time.perf_counter() - began
            url = line.split(": ", 1)[1].strip()
            break
    page = None
    if url:
        with urllib.request.urlopen(url.split("#", 1)[0], timeout=60) as r:
            html = r.read().decode(errors="replace")
        page = time.perf_counter() - began
    sent = time.perf_counter()
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    stop = time.perf_counter() - sent
    return {
        "url_printed_s": round(printed, 1) if printed else None,
        "first_page_s": round(page, 1) if page else None,
        "page_is_mlflow": bool(page) and "mlflow" in html.lower(),
        "stopped_s": round(stop, 1),
        "load_before": before,
        "met": page is not None and page <= TARGETS["first_page_s"],
        # why no URL came (e.g. a fresh folder with no run yet: the experiment does not exist)
        **({} if url else {"output_tail": lines[-5:]}),
    }


def commit(source: Path | None) -> str:
    for where in (source, Path(__file__).resolve().parents[1]):
        if where is None:
            continue
        marker = where / "COMMIT"
        if marker.exists():
            return marker.read_text().strip()
        try:
            return subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=where, capture_output=True, text=True, check=True
            ).stdout.strip()
        except (subprocess.CalledProcessError, OSError):
            continue
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--skip", nargs="*", default=[], choices=STEPS)
    parser.add_argument("--source", type=Path, help="a copy of the source tree to run (default: the installed one)")
    parser.add_argument("--folder", type=Path, help="the session's folder (default: a new temporary one, kept)")
    parser.add_argument("--out", type=Path, help="write the JSON here too")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before a quick-preset run is stopped")
    parser.add_argument(
        "--set",
        dest="overrides",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="overrides after the quick preset, e.g. plugins.eureka.samples=2 (recorded in the JSON)",
    )
    args = parser.parse_args()
    folder = args.folder or Path(tempfile.mkdtemp(prefix="first_run-"))
    folder.mkdir(parents=True, exist_ok=True)
    session = Session(folder, args.source, sys.executable)
    began = time.perf_counter()
    report: dict[str, Any] = {
        "benchmark": "first_run",
        "commit": commit(args.source),
        "folder": str(folder),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "load_before": load()},
        "targets": TARGETS,
    }
    if args.overrides:
        report["overrides"] = list(args.overrides)

    def save(done: str) -> str:  # after every step, so that a session cut short keeps what it measured
        report["machine"]["load_after"] = load()
        report["seconds"] = round(time.perf_counter() - began, 1)
        report["done"] = done
        text = json.dumps(report, indent=1)
        if args.out:
            args.out.write_text(text + "\n")
        return text

    # the quick ones first; the quick preset's seeds last, each saved as it ends
    if "readme" not in args.skip:
        report["readme"] = readme(session)
        save("readme")
    if "ctrl_c" not in args.skip:
        report["ctrl_c"] = ctrl_c(session)
        save("ctrl_c")
    if "ui" not in args.skip:
        report["ui"] = ui(session)
        save("ui")
    if "quick" not in args.skip:
        for k in range(1, len(args.seeds) + 1):
            done = report.get("quick", {}).get("runs", [])
            report["quick"] = quick(session, args.seeds[:k], done, args.timeout, tuple(args.overrides))
            save(f"quick seeds {args.seeds[:k]}")
    print(save("all"))


if __name__ == "__main__":
    main()
