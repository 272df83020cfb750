"""The background LLM worker: jobs run in order off the caller's thread, failures cost one job."""

import threading
import time

from core.llm.background import BackgroundCalls, warm_up


def _wait_idle(calls: BackgroundCalls, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not calls.idle() and time.monotonic() < end:
        time.sleep(0.01)
    assert calls.idle()


def test_jobs_run_in_a_thread_of_their_own_and_results_are_drained_in_order() -> None:
    threads = []

    def work(x: int) -> int:
        threads.append(threading.current_thread().name)
        return x * x

    calls = BackgroundCalls(work, name="test-worker", queue_size=8)
    calls.start()
    for x in (1, 2, 3):
        assert calls.submit(x)
    _wait_idle(calls)
    assert calls.drain() == [(1, 1), (2, 4), (3, 9)]
    assert calls.drain() == []
    assert set(threads) == {"test-worker"} and calls.done == 3
    calls.stop()


def test_a_full_queue_refuses_without_waiting_and_a_waiting_job_is_not_queued_twice() -> None:
    gate = threading.Event()
    calls = BackgroundCalls(lambda x: gate.wait(5) and x, name="w", queue_size=1)
    assert calls.submit("a")
    assert not calls.submit("a")  # already waiting
    t0 = time.monotonic()
    assert not calls.submit("b")  # queue of one is full (the worker has not started)
    assert time.monotonic() - t0 < 0.5 and calls.refused == 1
    calls.start()
    gate.set()
    _wait_idle(calls)
    assert calls.drain() == [("a", "a")]
    calls.stop()


def test_a_failing_job_is_counted_and_the_worker_goes_on() -> None:
    def work(x: int) -> int | None:
        if x == 2:
            raise ValueError("bad state")
        return None if x == 3 else x

    calls = BackgroundCalls(work, name="w", results_size=None)
    calls.start()
    for x in (1, 2, 3, 4):
        calls.submit(x)
    _wait_idle(calls)
    assert calls.drain() == [(1, 1), (4, 4)]
    assert calls.failures == 1 and calls.errors == ["ValueError: bad state"]
    calls.stop()


def test_warm_up_leaves_a_remote_client_alone() -> None:
    class Remote:
        settings = type("S", (), {"is_embedded": False})()
        model = "openai/gpt-4o"

    warm_up(Remote())  # nothing to load, nothing raised


def test_ask_in_batches_sends_the_first_item_alone_then_full_batches_and_stops_after_its_seconds() -> None:
    from core.llm.background import ask_in_batches

    chunks: list[list[int]] = []

    def ask(chunk: list[int]) -> int:
        chunks.append(chunk)
        return len(chunk) - 1  # one of each chunk unanswered

    assert ask_in_batches(list(range(8)), ask, batch=3, seconds=0, label="t", show=False) == (8, 4)
    assert chunks == [[0], [1, 2, 3], [4, 5, 6], [7]]

    def slow(chunk: list[int]) -> int:
        time.sleep(0.2)
        return len(chunk)

    asked, done = ask_in_batches(list(range(8)), slow, batch=3, seconds=0.1, label="t", show=False)
    assert (asked, done) == (1, 1)  # no chunk starts once the seconds are spent
    assert ask_in_batches([], ask, batch=3, seconds=0, label="t", show=False) == (0, 0)


def test_a_process_whose_worker_was_never_stopped_still_exits():
    """The worker is not a daemon (a call in progress finishes before exit); it must still
    end when the main thread does, or a program that forgot stop() never exits."""
    import subprocess
    import sys

    script = (
        "import time\nfrom core.llm.background import BackgroundCalls\n"
        "calls = BackgroundCalls(lambda job: time.sleep(0.3) or job, name='w')\n"
        "calls.start()\ncalls.submit(1)\ntime.sleep(0.1)\nprint('leaving', flush=True)\n"
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "leaving" in proc.stdout, proc.stderr
