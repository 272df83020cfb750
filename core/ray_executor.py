"""Candidate trainings as Ray tasks: on this machine (local Ray) or on a Ray cluster.

Each :class:`core.jobs.TrainJob` becomes one Ray task that calls
:func:`core.jobs.run_job`, the same function the local pool runs, so a job gives the
same :class:`TrainResult` wherever it runs. The LLM, the proposals and MLflow stay in the
driver (the ``python -m core`` process); workers only train and return records.

    python -m core executor=ray                                  # local Ray, one CPU per job
    python -m core executor=ray executor.address=ray://head:10001   # a cluster

Ray is started once per process, on the first batch that uses it, and kept for the next
iteration's jobs; it shuts down when the process exits. On a local Ray
``executor.workers`` (``auto``: sized to the free cores before each batch, as the local
pool is) bounds the jobs in flight, and a batch sized to one trains in this process; on
a cluster Ray schedules every job by ``cpus_per_job``.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from core.config import RayExecutorConfig, executor_config
from core.cpu import Reader, plan_workers, read_cpu, usable_cores
from core.jobs import (
    Done,
    Executor,
    InProcessExecutor,
    Runtime,
    TrainJob,
    run_job,
    worker_runtime,
)
from core.progress import ProgressRelay
from core.records import TrainResult

#: environment of every Ray worker: one BLAS/OpenMP thread per job (small MLPs, shared cores)
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _train(job: TrainJob, progress_queue: Any = None) -> TrainResult:
    """The body of a Ray task: one job, single-threaded torch; with a ``progress_queue``
    (a ``ray.util.queue.Queue``) its frame bar goes to the driver."""
    import torch

    from core.progress import RemoteProgress, routed_output

    torch.set_num_threads(1)
    remote = RemoteProgress(progress_queue) if progress_queue is not None else None
    try:
        with routed_output(remote):  # print() in a hook: above the driver's bars, not on them
            return run_job(job, progress=remote)
    finally:
        if remote is not None:
            remote.close()


def _drain(queue: Any, relay: ProgressRelay) -> None:
    """Apply what the Ray tasks put on ``queue`` so far."""
    try:
        waiting = queue.qsize()
        messages = queue.get_nowait_batch(waiting) if waiting else []
    except Exception:  # the queue actor is gone: no more progress, the jobs go on
        return
    for message in messages:
        relay.apply(message)


def _warm(prime: TrainJob | None = None) -> int:
    """A task that imports the training stack (and builds ``prime``'s run runtime), so the
    first real job does not."""
    import torch

    import core.train.ppo  # noqa: F401

    torch.set_num_threads(1)
    if prime is not None and prime.run_key:
        with contextlib.suppress(Exception):
            worker_runtime(prime)
    return os.getpid()


_warmed = False


def ensure_ray(cfg: RayExecutorConfig | Any) -> Any:
    """Connect to (or start) Ray as the executor config says (the typed record, or a node
    typed first); returns the ``ray`` module."""
    cfg = executor_config(cfg)
    if not isinstance(cfg, RayExecutorConfig):
        from core.errors import UserError

        raise UserError(f"Ray needs executor=ray, got executor kind '{cfg.kind}'.")
    try:
        import ray
    except ImportError as exc:  # optional extra
        from core.errors import UserError

        raise UserError("executor=ray needs Ray: pip install 'ray[default]>=2.9,<3'") from exc
    if not ray.is_initialized():
        kwargs: dict[str, Any] = {
            "include_dashboard": cfg.dashboard,
            "log_to_driver": cfg.log_to_driver,
            "runtime_env": {"env_vars": {**WORKER_ENV, **cfg.env_vars}},
        }
        if cfg.address:
            kwargs["address"] = cfg.address
        else:  # a local instance sized for this machine
            kwargs["num_cpus"] = cfg.num_cpus or usable_cores()
            # Ray starts workers at nice 15: beside any other work they then get a few
            # percent of a core (a pool of 2 fell to 0.3x serial with one core busy)
            if cfg.worker_niceness is not None:
                kwargs["_system_config"] = {"worker_niceness": cfg.worker_niceness}
        ray.init(**kwargs)
    return ray


class RayExecutor(Executor):
    """Run jobs as Ray tasks (``cpus_per_job`` CPUs each); results come back in order.

    :param cfg: the run's typed ``executor`` record (a config node is typed first).
    :param runtime: the run's runtime, for batches a local Ray leaves to this process.
    :param read: how the free cores are read (tests and benchmarks pass a fixed reading).
    """

    def __init__(
        self,
        cfg: RayExecutorConfig | Any,
        runtime: Runtime | None = None,
        progress: Any = None,
        read: Reader = read_cpu,
    ) -> None:
        cfg = executor_config(cfg)
        if not isinstance(cfg, RayExecutorConfig):
            from core.errors import UserError

            raise UserError(f"RayExecutor needs executor=ray, got executor kind '{cfg.kind}'.")
        self.cfg = cfg
        self.runtime = runtime
        self.progress = progress
        self.read = read
        self.local = not cfg.address
        self.workers = cfg.workers
        self.cpus_per_job = cfg.cpus_per_job
        self.last_plan = 0  # jobs in flight chosen for the last batch (0: no bound, on a cluster)
        self.ray: Any = None
        self._remote: Any = None
        self._pending: list[Any] = []
        self._queue: Any = None  # a ray.util.queue.Queue for the tasks' frame bars, made when shown

    def start(self, prime: TrainJob | None = None) -> None:
        """Connect to (or start) Ray and warm its workers (once per process), building
        ``prime``'s run runtime in each."""
        if self.ray is not None:
            return
        self.ray = ensure_ray(self.cfg)
        self._remote = self.ray.remote(_train).options(num_cpus=self.cpus_per_job, max_retries=self.cfg.max_retries)
        self._warm_workers(self.cpus_per_job, prime)

    def plan(self, jobs: int) -> int:
        """Jobs in flight for a batch of ``jobs`` on a local Ray (at most its CPU slots); 0 on a cluster."""
        if not self.local:
            return 0
        cpus = self.cfg.num_cpus or usable_cores()
        slots = max(1, int(cpus // max(self.cpus_per_job, 1e-9)))
        return min(slots, plan_workers(self.workers, jobs, self.read() if self.workers == "auto" else None))

    def _warm_workers(self, cpus_per_job: float, prime: TrainJob | None) -> None:
        """Start one worker per job slot once per process (as the local pool does)."""
        global _warmed
        if _warmed or not self.cfg.warm:
            return
        slots = int(self.ray.cluster_resources().get("CPU", 1) // max(cpus_per_job, 1e-9))
        warm = self.ray.remote(_warm).options(num_cpus=cpus_per_job)
        prime = self.ship(prime) if prime is not None else None
        self.ray.get([warm.remote(prime) for _ in range(max(1, min(slots, 32)))])
        _warmed = True

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        if not jobs:
            return []
        self.last_plan = at_once = self.plan(len(jobs))
        if self.local and at_once <= 1:
            return InProcessExecutor(self.runtime, self.progress).run(jobs, on_done)
        self.start(prime=jobs[0])
        limit = at_once or len(jobs)
        queue = list(enumerate(jobs))
        index: dict[Any, int] = {}
        results: list[TrainResult | None] = [None] * len(jobs)
        relay = ProgressRelay(self.progress)
        if self.progress is not None and self._queue is None:
            from ray.util.queue import Queue

            self._queue = Queue(actor_options={"num_cpus": 0})
        progress_queue = self._queue if self.progress is not None else None
        try:
            self._run_all(jobs, queue, index, results, limit, progress_queue, relay, on_done)
        finally:
            if progress_queue is not None:
                _drain(progress_queue, relay)
            relay.stop()
        self._pending = []
        return [r for r in results if r is not None]

    def _run_all(
        self,
        jobs: list[TrainJob],
        queue: list[tuple[int, TrainJob]],
        index: dict[Any, int],
        results: list[TrainResult | None],
        limit: int,
        progress_queue: Any,
        relay: ProgressRelay,
        on_done: Done | None,
    ) -> None:
        ray = self.ray
        while queue or index:
            while queue and len(index) < limit:
                i, job = queue.pop(0)
                index[self._remote.remote(self.ship(job), progress_queue)] = i
            self._pending = list(index)
            ready: list[Any] = []
            while not ready:  # draw the tasks' frame bars while waiting
                ready, _ = ray.wait(self._pending, num_returns=1, timeout=0.5 if progress_queue is not None else None)
                if progress_queue is not None:
                    _drain(progress_queue, relay)
            for ref in ready:
                i = index.pop(ref)
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # the worker died (killed for memory, node lost)
                    results[i] = TrainResult(
                        jobs[i].candidate.id, ok=False, error=f"Ray task failed: {exc!r}", error_kind="crash"
                    )
                if on_done:
                    on_done(i, results[i])  # type: ignore[arg-type]

    def close(self) -> None:
        """Cancel what is still running; Ray itself stays up for the next iteration."""
        for ref in self._pending:
            self.ray.cancel(ref, force=True)
        self._pending = []
        if self._queue is not None:
            with contextlib.suppress(Exception):
                self._queue.shutdown()
            self._queue = None
