"""LLM calls beside the training loop: one worker thread, a bounded job queue, a result buffer.

Plugins that ask the LLM while a policy trains (a judge, a labeller, a skill scorer) must
never make the training loop wait on a generation. They hand jobs to a
:class:`BackgroundCalls`, which runs ``work(job)`` in one thread and keeps what it
returns until the plugin drains it::

    calls = BackgroundCalls(score_state, name="saycan-scorer", queue_size=64)
    warm_up(train.llm)              # before the loop: loading the model holds the GIL
    calls.start()
    calls.submit(text)              # never blocks; False when the queue is full
    for job, result in calls.drain(): ...
    calls.stop(wait_s=5.0)          # at the training's end

An exception in ``work`` costs that job only: it is counted (``failures``) and its text
kept in ``errors`` for the plugin's log.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

Job = TypeVar("Job")
Result = TypeVar("Result")


def warm_up(llm: Any) -> None:
    """Load an in-process model now, before a training loop starts.

    Loading holds the GIL for seconds; done lazily in a worker thread it would stall the
    loop. Remote backends need nothing, so this is a no-op for them.
    """
    settings = getattr(llm, "settings", None)
    if settings is not None and getattr(settings, "is_embedded", False):
        from core.llm import embedded

        embedded.get_server(llm.model.split("/", 1)[1])


class BackgroundCalls(Generic[Job, Result]):
    """One worker thread that runs ``work(job)`` for submitted jobs, in order.

    ``queue_size`` bounds the jobs waiting (a full queue refuses new ones rather than
    grow); ``results_size`` bounds the finished results kept for :meth:`drain` (the
    oldest are dropped; ``None`` keeps all). A job whose ``work`` returns ``None``
    leaves no result (work that writes into a cache of its own needs none). Hashable
    jobs are not queued twice while one is waiting (``dedupe``).
    """

    def __init__(
        self,
        work: Callable[[Job], Result | None],
        name: str,
        queue_size: int = 64,
        results_size: int | None = None,
        dedupe: bool = True,
    ) -> None:
        self.work, self.name, self.dedupe = work, name, dedupe
        self._jobs: queue.Queue[Job] = queue.Queue(maxsize=queue_size)
        self._results: deque[tuple[Job, Result]] = deque(maxlen=results_size)
        self._waiting: set[Hashable] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.done = self.failures = self.refused = 0
        self.errors: list[str] = []
        self.busy = False

    # -- the training loop's side --------------------------------------------------------
    def submit(self, job: Job) -> bool:
        """Queue a job without waiting; False if the queue is full or the job already waits."""
        key = job if self.dedupe and isinstance(job, Hashable) else None
        with self._lock:
            if key is not None and key in self._waiting:
                return False
            try:
                self._jobs.put_nowait(job)
            except queue.Full:
                self.refused += 1
                return False
            if key is not None:
                self._waiting.add(key)
        return True

    def drain(self) -> list[tuple[Job, Result]]:
        """The finished (job, result) pairs since the last drain, oldest first."""
        out = []
        while self._results:
            out.append(self._results.popleft())
        return out

    @property
    def waiting(self) -> int:
        """Jobs queued or in progress."""
        return self._jobs.qsize() + int(self.busy)

    def idle(self) -> bool:
        return self.waiting == 0

    # -- the worker ----------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            # not a daemon: at exit Python waits for the call in progress instead of freeing
            # an in-process model under it (a crash)
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=False)
            self._thread.start()

    def stop(self, wait_s: float = 2.0) -> None:
        """Stop taking jobs; wait up to ``wait_s`` for the one in progress."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(wait_s)

    def _run(self) -> None:
        import torch

        torch.set_num_threads(1)  # the training loop owns the cores' math threads
        main = threading.main_thread()
        # the main thread ends before Python joins this one at exit: stop then, after the
        # call in progress, also when nobody called stop() (else the process never exits)
        while not self._stop.is_set() and main.is_alive():
            try:
                job = self._jobs.get(timeout=0.1)
            except queue.Empty:
                continue
            self.busy = True
            try:
                result = self.work(job)
                if result is not None:
                    self._results.append((job, result))
                self.done += 1
            except Exception as exc:  # a failed call costs its job only
                self.failures += 1
                if len(self.errors) < 100:
                    self.errors.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            finally:
                self.busy = False
                if self.dedupe and isinstance(job, Hashable):
                    with self._lock:
                        self._waiting.discard(job)


def ask_in_batches(
    items: list[Job],
    ask: Callable[[list[Job]], int],
    *,
    batch: int,
    seconds: float,
    label: str,
    show: bool,
    info: Callable[[int], str] = lambda done: f"{done} answered",
) -> tuple[int, int]:
    """The blocking counterpart: ``ask(chunk)`` for ``items`` in chunks of ``batch``, with a bar.

    ``ask`` makes a chunk's calls (concurrently, e.g. ``llm.chat_many``) and returns how many
    were answered. The first item goes alone: it computes the prompt prefix the items share,
    which the server's prefix cache then reuses for the batch. No new chunk starts after
    ``seconds`` (0: no limit). Returns (items asked, items answered).
    """
    from core.progress import make_progress

    start, asked, done = time.perf_counter(), 0, 0
    if not items:
        return 0, 0
    with make_progress(show) as progress:
        bar = progress.add_task(label, total=len(items)) if progress is not None else None
        for chunk in [items[:1]] + [items[i : i + batch] for i in range(1, len(items), batch)]:
            if seconds and time.perf_counter() - start >= seconds:
                break
            done += ask(chunk)
            asked += len(chunk)
            if progress is not None and bar is not None:
                progress.update(bar, completed=asked, info=info(done))
    return asked, done
