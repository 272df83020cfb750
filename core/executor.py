"""Where candidate trainings run: in this process, or in a local pool of worker processes.

The job, the runtime and the in-process executor are :mod:`core.jobs`; the CPU meter is
:mod:`core.cpu`; this module adds the process pool and :func:`make_executor`, which picks
the backend the config names (Ray: :mod:`core.ray_executor`). An executor takes
:class:`TrainJob` records (picklable: the run's validated
:class:`core.config.Settings`, the candidate, the seed, the run's key) and returns one
:class:`TrainResult` per job, in order. A worker builds the task and the plugin manager
from those settings once per run (:func:`worker_runtime`), without validating them
again, so any backend that can call :func:`run_job` in another process (a process pool,
Ray) runs the same code, and jobs of several runs that reach one worker in turn each
meet their own run's plugin objects. A job made from a plain config (tests, benchmarks)
is validated where it runs; an executor replaces a plain config of its own run's jobs
with the run's settings before they leave the process (:meth:`Executor.ship`).

Sizing (``executor.workers: auto``): before each batch the executor reads how much CPU
is free (:func:`read_cpu`: idle time of the cores this process may use over half a
second, from ``/proc/stat``; psutil or the load average elsewhere) and trains at most
:func:`plan_workers` jobs at once: one for the driver's own core (a serial training
would compete for it anyway) plus one per free core, never more than the cores or the
jobs. When that is one, the batch trains in this process: with no core to spare, the
executor is the serial baseline rather than more processes competing for the same
cores. Every worker runs one torch/OpenMP thread.
"""

from __future__ import annotations

import concurrent.futures as futures
import contextlib
import itertools
import math
import multiprocessing as mp
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

from core.config import ExecutorConfig, executor_config
from core.cpu import (
    CpuReading,
    Reader,
    cpu_times,
    plan_workers,
    read_cpu,
    usable_cores,
    workers_setting,
)
from core.jobs import (
    Done,
    Executor,
    InProcessExecutor,
    Runtime,
    TrainJob,
    build_runtime,
    run_job,
    worker_runtime,
)
from core.progress import ProgressRelay
from core.records import TrainResult

__all__ = [  # the executor API, wherever each piece lives
    "CpuReading",
    "Done",
    "Executor",
    "InProcessExecutor",
    "PoolExecutor",
    "Reader",
    "Runtime",
    "THREAD_VARS",
    "TrainJob",
    "build_runtime",
    "cpu_times",
    "make_executor",
    "one_thread_env",
    "plan_workers",
    "read_cpu",
    "run_job",
    "usable_cores",
    "worker_runtime",
    "workers_setting",
]

#: environment variables that set BLAS/OpenMP thread pools: one thread per worker
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@contextlib.contextmanager
def one_thread_env() -> Iterator[None]:
    """BLAS/OpenMP thread variables at 1 while worker processes start (they inherit them)."""
    saved = {var: os.environ.get(var) for var in THREAD_VARS}
    os.environ.update(dict.fromkeys(THREAD_VARS, "1"))
    try:
        yield
    finally:
        for var, value in saved.items():
            if value is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = value


#: in a pool worker: the queue its trainings' frame bars go to (:class:`core.progress.RemoteProgress`)
_progress_queue: Any = None


def _warm_worker(prime: TrainJob | None = None, progress_queue: Any = None) -> None:
    """Import the training stack once when a worker starts, not inside the first job, and
    build ``prime``'s run runtime (a failure to build shows in that run's jobs instead).
    ``progress_queue``: where the worker's trainings send their progress."""
    global _progress_queue
    if progress_queue is not None:
        progress_queue.cancel_join_thread()  # a worker never waits at exit for the driver to read
        _progress_queue = progress_queue
    # one thread per job: the pool already fills the cores (workers start with these at 1)
    os.environ.update(dict.fromkeys(THREAD_VARS, "1"))
    import torch

    import core.train.ppo  # noqa: F401

    torch.set_num_threads(1)
    if prime is not None and prime.run_key:
        with contextlib.suppress(Exception):
            worker_runtime(prime)


def _pool_job(job: TrainJob, show_progress: bool = False) -> TrainResult:
    """A job in a pool worker; with ``show_progress`` its frame bar goes to the driver."""
    from core.progress import RemoteProgress, routed_output

    remote = RemoteProgress(_progress_queue) if show_progress and _progress_queue is not None else None
    try:
        with routed_output(remote):  # print() in a hook: above the driver's bars, not on them
            return run_job(job, progress=remote)
    finally:
        if remote is not None:
            remote.close()


class PoolExecutor(Executor):
    """Train jobs in parallel in a pool of worker processes (spawned, so no forked state).

    :param workers: jobs at once, or ``"auto"``: sized before each batch to the free
        cores (:func:`plan_workers`); a batch sized to 1 trains in this process.
    :param runtime: the run's runtime, for batches trained in this process.
    :param read: how the free cores are read (tests and benchmarks pass a fixed reading).

    The pool starts on the first parallel batch (or :meth:`start`), grows when a later
    batch may use more workers, and otherwise stays as it is: a smaller batch just keeps
    fewer jobs in flight.
    """

    def __init__(
        self, workers: int | str, runtime: Runtime | None = None, progress: Any = None, read: Reader = read_cpu
    ) -> None:
        self.workers = workers_setting(workers)
        self.runtime = runtime
        self.progress = progress
        self.read = read
        self.size = 0  # processes in the running pool
        self.last_plan = 0  # jobs in flight chosen for the last batch (1: in this process)
        self._pool: futures.ProcessPoolExecutor | None = None
        self._queue: Any = None  # the workers' progress messages (core.progress.RemoteProgress)

    def plan(self, jobs: int) -> int:
        """Jobs to train at once for a batch of ``jobs``."""
        return plan_workers(self.workers, jobs, self.read() if self.workers == "auto" else None)

    def start(self, workers: int | None = None, prime: TrainJob | None = None) -> None:
        """Start ``workers`` processes (default: as planned now) and wait until each has
        imported the training stack and built the runtime of ``prime``'s run."""
        size = workers or plan_workers(self.workers, usable_cores(), self.read() if self.workers == "auto" else None)
        if size <= 1 or (self._pool is not None and self.size >= size):
            return
        self.close()
        context = mp.get_context("spawn")
        self._queue = context.Queue()
        with one_thread_env():
            self._pool = futures.ProcessPoolExecutor(
                size,
                mp_context=context,
                initializer=_warm_worker,
                initargs=(self.ship(prime) if prime else None, self._queue),
            )
            futures.wait([self._pool.submit(time.sleep, 0) for _ in range(size)])  # every worker started
        self.size = size

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        if not jobs:
            return []
        self.last_plan = at_once = self.plan(len(jobs))
        if at_once <= 1:
            return InProcessExecutor(self.runtime, self.progress).run(jobs, on_done)
        self.start(at_once, prime=jobs[0])
        assert self._pool is not None
        results: list[TrainResult | None] = [None] * len(jobs)
        queue = list(enumerate(jobs))
        pending: dict[futures.Future[TrainResult], int] = {}
        show = self.progress is not None
        relay = ProgressRelay(self.progress)
        if show:
            relay.pump(self._queue)  # the workers' frame bars, drawn here
        try:
            self._train_all(jobs, queue, pending, results, at_once, show, on_done)
        finally:
            relay.stop()
        return [r for r in results if r is not None]

    def stream(self, jobs: Iterable[TrainJob], on_done: Done | None = None, expected: int = 0) -> list[TrainResult]:
        """Jobs as they arrive: each is submitted once a worker is free, and the next is
        asked for while the workers train, so its wait (the LLM sampling it) overlaps
        their training. Sized to ``expected`` jobs, or to the usable cores when 0 (unknown).
        ``overlap_s`` is then the time jobs trained while the next was awaited."""
        source = iter(jobs)
        first = next(source, None)
        if first is None:
            return []
        self.last_plan = at_once = self.plan(expected or usable_cores())
        if at_once <= 1:
            return InProcessExecutor(self.runtime, self.progress).run(itertools.chain([first], source), on_done)  # type: ignore[arg-type]
        self.start(at_once, prime=first)
        assert self._pool is not None
        arrived, queue = [first], [(0, first)]
        results: list[TrainResult | None] = [None]
        pending: dict[futures.Future[TrainResult], int] = {}
        trainings: list[list[float]] = []  # [submitted, done] of each job (done: inf while it runs)
        waits: list[tuple[float, float]] = []  # while the next job was awaited
        show = self.progress is not None
        relay = ProgressRelay(self.progress)
        if show:
            relay.pump(self._queue)
        try:
            exhausted = False
            while not exhausted or queue or pending:
                while queue and len(pending) < at_once:
                    i, job = queue.pop(0)
                    span = [time.perf_counter(), math.inf]
                    trainings.append(span)
                    future = self._pool.submit(_pool_job, self.ship(job), show)
                    future.add_done_callback(lambda _, span=span: span.__setitem__(1, time.perf_counter()))  # type: ignore[misc]
                    pending[future] = i
                if not exhausted:
                    began = time.perf_counter()
                    new = next(source, None)  # may wait (on the LLM) while the workers train
                    waits.append((began, time.perf_counter()))
                    if new is None:
                        exhausted = True
                    else:
                        queue.append((len(arrived), new))
                        arrived.append(new)
                        results.append(None)
                    finished = {f for f in pending if f.done()}
                else:
                    finished, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
                for fut in finished:
                    self._collect(fut, pending.pop(fut), arrived, results, on_done)
        finally:
            relay.stop()
            from core.llm.client import covered

            self.overlap_s = sum(covered(a, b, trainings) for a, b in waits)
        return [r for r in results if r is not None]

    @staticmethod
    def _collect(
        fut: futures.Future[TrainResult],
        i: int,
        jobs: list[TrainJob],
        results: list[TrainResult | None],
        on_done: Done | None,
    ) -> None:
        try:
            results[i] = fut.result()
        except Exception as exc:  # a worker died (e.g. killed for memory)
            results[i] = TrainResult(
                jobs[i].candidate.id, ok=False, error=f"worker failed: {exc!r}", error_kind="crash"
            )
        if on_done:
            on_done(i, results[i])  # type: ignore[arg-type]

    def _train_all(
        self,
        jobs: list[TrainJob],
        queue: list[tuple[int, TrainJob]],
        pending: dict[Any, int],
        results: list[TrainResult | None],
        at_once: int,
        show: bool,
        on_done: Done | None,
    ) -> None:
        assert self._pool is not None
        while queue or pending:
            while queue and len(pending) < at_once:
                i, job = queue.pop(0)
                pending[self._pool.submit(_pool_job, self.ship(job), show)] = i
            finished, _ = futures.wait(pending, return_when=futures.FIRST_COMPLETED)
            for fut in finished:
                self._collect(fut, pending.pop(fut), jobs, results, on_done)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
            self.size = 0
        if self._queue is not None:
            self._queue.close()
            self._queue = None


def make_executor(
    cfg: ExecutorConfig | Any, runtime: Runtime | None, jobs_hint: int, progress: Any = None, read: Reader = read_cpu
) -> Executor:
    """The executor ``cfg`` names (the run's typed ``executor`` record; a config node is
    typed first), for about ``jobs_hint`` jobs at a time.

    ``workers: auto`` (local pool, local Ray) sizes each batch to the free cores (see the
    module docstring); a single job, a one-core machine or ``workers: 1`` trains in this
    process.
    """
    cfg = executor_config(cfg)
    if cfg.kind == "ray":
        from core.ray_executor import RayExecutor  # optional extra

        return RayExecutor(cfg, runtime, progress, read)
    workers = cfg.workers
    most = usable_cores() if workers == "auto" else int(workers)
    if most <= 1 or jobs_hint <= 1:
        return InProcessExecutor(runtime, progress)
    return PoolExecutor(workers if workers == "auto" else min(int(workers), jobs_hint), runtime, progress, read)
