"""Candidate trainings as Ray tasks: on this machine (local Ray) or on a Ray cluster.

Each :class:`core.executor.TrainJob` becomes one Ray task that calls
:func:`core.executor.run_job`, the same function the local pool runs, so a job gives the
same :class:`TrainResult` wherever it runs. The LLM, the proposals and MLflow stay in the
driver (the ``python -m core`` process); workers only train and return records.

    python -m core executor=ray                                  # local Ray, one CPU per job
    python -m core executor=ray executor.address=ray://head:10001   # a cluster

Ray is started once per process and kept for the next iteration's jobs (the loop makes
an executor per iteration); it shuts down when the process exits.
"""

from __future__ import annotations

import os
from typing import Any

from core.executor import Done, Executor, TrainJob, run_job
from core.records import TrainResult

#: environment of every Ray worker: one BLAS/OpenMP thread per job (small MLPs, shared cores)
WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True"}


def _train(job: TrainJob) -> TrainResult:
    """The body of a Ray task: one job, single-threaded torch."""
    import torch

    torch.set_num_threads(1)
    return run_job(job)


def _warm() -> int:
    """A no-op task that imports the training stack, so the first real job does not."""
    import torch

    import core.train.ppo  # noqa: F401

    torch.set_num_threads(1)
    return os.getpid()


_warmed = False


def ensure_ray(cfg: Any) -> Any:
    """Connect to (or start) Ray as the executor config says; returns the ``ray`` module."""
    try:
        import ray
    except ImportError as exc:  # optional extra
        from core.errors import UserError

        raise UserError("executor=ray needs Ray: pip install 'ray[default]>=2.9,<3'") from exc
    if not ray.is_initialized():
        address = cfg.get("address")
        kwargs: dict[str, Any] = {
            "include_dashboard": bool(cfg.get("dashboard", False)),
            "log_to_driver": bool(cfg.get("log_to_driver", False)),
            "runtime_env": {"env_vars": {**WORKER_ENV, **dict(cfg.get("env_vars") or {})}},
        }
        if address:
            kwargs["address"] = address
        else:  # a local instance sized for this machine
            cpus = cfg.get("num_cpus")
            kwargs["num_cpus"] = int(cpus) if cpus else (os.cpu_count() or 1)
        ray.init(**kwargs)
    return ray


class RayExecutor(Executor):
    """Run jobs as Ray tasks (``cpus_per_job`` CPUs each); results come back in order."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.ray = ensure_ray(cfg)
        options: dict[str, Any] = {"num_cpus": float(cfg.get("cpus_per_job", 1)), "max_retries": int(cfg.get("max_retries", 0))}
        self._remote = self.ray.remote(_train).options(**options)
        self._pending: list[Any] = []
        self._warm_workers(options["num_cpus"])

    def _warm_workers(self, cpus_per_job: float) -> None:
        """Start one worker per job slot once per process (as the local pool does)."""
        global _warmed
        if _warmed or not self.cfg.get("warm", True):
            return
        slots = int(self.ray.cluster_resources().get("CPU", 1) // max(cpus_per_job, 1e-9))
        warm = self.ray.remote(_warm).options(num_cpus=cpus_per_job)
        self.ray.get([warm.remote() for _ in range(max(1, min(slots, 32)))])
        _warmed = True

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        ray = self.ray
        refs = [self._remote.remote(job) for job in jobs]
        self._pending = list(refs)
        index = {ref: i for i, ref in enumerate(refs)}
        results: list[TrainResult | None] = [None] * len(jobs)
        waiting = list(refs)
        while waiting:
            ready, waiting = ray.wait(waiting, num_returns=1)
            for ref in ready:
                i = index[ref]
                try:
                    results[i] = ray.get(ref)
                except Exception as exc:  # the worker died (killed for memory, node lost)
                    results[i] = TrainResult(jobs[i].candidate.id, ok=False, error=f"Ray task failed: {exc!r}", error_kind="crash")
                if on_done:
                    on_done(i, results[i])  # type: ignore[arg-type]
        self._pending = []
        return [r for r in results if r is not None]

    def close(self) -> None:
        """Cancel what is still running; Ray itself stays up for the next iteration."""
        for ref in self._pending:
            self.ray.cancel(ref, force=True)
        self._pending = []
