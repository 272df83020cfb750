"""Where candidate trainings run: in this process, or in a local pool of worker processes.

An executor takes :class:`TrainJob` records (picklable: the resolved config, the
candidate, the seed, the run's key) and returns one :class:`TrainResult` per job, in
order. A worker builds the task and the plugin manager from the config once per run
(:func:`worker_runtime`), so any backend that can call :func:`run_job` in another
process (a process pool, Ray) runs the same code, and jobs of several runs that reach
one worker in turn each meet their own run's plugin objects.
"""

from __future__ import annotations

import concurrent.futures as futures
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from core.config import Settings
from core.records import Candidate, TrainResult

Done = Callable[[int, TrainResult], None]


@dataclass
class TrainJob:
    """One training of one candidate under one seed."""

    config: dict[str, Any]  # the resolved run config (plain containers)
    candidate: Candidate
    seed: int
    run_key: str = ""  # the run this job belongs to: a worker keeps one runtime per run


@dataclass
class Runtime:
    """What a process needs to train for one run: built once per run and process."""

    task: Any
    hook: Any
    settings: Settings
    fingerprint: dict[str, str] = field(default_factory=dict)  # code hashes: framework and each plugin
    run_key: str = ""

    @property
    def config(self) -> Any:
        return self.settings.config


#: a worker process's runtimes (pool and Ray workers), one per run, the most recently used last:
#: jobs of several runs may reach one worker interleaved, and each keeps its own plugin objects
_RUNTIMES: OrderedDict[str, Runtime] = OrderedDict()
_RUNTIMES_KEPT = 4


def worker_runtime(job: TrainJob) -> Runtime:
    """The runtime of ``job``'s run in this process, built on its run's first job.

    A job without a ``run_key`` gets a fresh runtime of its own.
    """
    if not job.run_key:
        return build_runtime(job.config)
    runtime = _RUNTIMES.get(job.run_key)
    if runtime is None:
        runtime = _RUNTIMES[job.run_key] = build_runtime(job.config, run_key=job.run_key)
        while len(_RUNTIMES) > _RUNTIMES_KEPT:
            _RUNTIMES.popitem(last=False)
    _RUNTIMES.move_to_end(job.run_key)
    return runtime


def build_runtime(config: DictConfig | dict[str, Any], extra_plugins: tuple[object, ...] = (), run_key: str = "") -> Runtime:
    """Validate a run config and build its task and plugin manager (fresh plugin objects).

    :raises core.errors.UserError: for an unknown plugin, a bad config value or a hook
        that does not match its spec, before any work.
    """
    from core.config import framework_hash, source_hash, validate
    from core.envs import make_task
    from core.registry import load_plugins, make_plugin_manager

    if not isinstance(config, DictConfig):
        config = OmegaConf.create(config)
    modules = load_plugins((config.get("plugins") or {}).keys())
    settings = validate(config, modules)
    pm = make_plugin_manager(settings, modules, extra=extra_plugins)
    extra_tasks: dict[str, Any] = {}
    for contributed in pm.hook.register_tasks():
        extra_tasks.update(contributed or {})
    task = make_task(OmegaConf.to_container(config["env"], resolve=True), extra=extra_tasks)
    fingerprint = {"framework": framework_hash(), **{f"plugin:{n}": source_hash(m) for n, m in modules.items()}}
    for obj in extra_plugins:
        module = sys.modules.get(getattr(obj, "__module__", "") or "") or obj
        fingerprint[f"extra:{getattr(obj, '__name__', type(obj).__name__)}"] = source_hash(module)
    return Runtime(task=task, hook=pm.hook, settings=settings, fingerprint=fingerprint, run_key=run_key)


def run_job(job: TrainJob, runtime: Runtime | None = None, progress: Any = None) -> TrainResult:
    """Train one candidate; any failure becomes a failed result with its traceback."""
    start = time.perf_counter()
    try:
        import torch

        from core.context import TrainContext
        from core.tracking import format_llm_call
        from core.train import get_trainer

        if runtime is None:
            runtime = worker_runtime(job)
        trainer_cfg = job.config["trainer"]
        torch.set_num_threads(int(trainer_cfg.get("threads", 1)))
        trainer, config_cls = get_trainer(trainer_cfg.get("name", "ppo"))
        cfg = config_cls.from_config({k: v for k, v in trainer_cfg.items() if k != "name"})
        llm_cfg = job.config.get("llm")

        def log_call(record: Any) -> None:  # LLM calls made during training join the candidate's artifacts
            ctx.log_text("llm_calls.md", format_llm_call(record) + "\n\n---\n\n")

        ctx = TrainContext(
            settings=runtime.settings,
            task=runtime.task,
            candidate=job.candidate,
            seed=job.seed,
            total_frames=cfg.frames,
            llm_factory=(lambda: _make_llm(llm_cfg, log_call)) if llm_cfg else None,
            hook=runtime.hook,
        )
        result = trainer(runtime.task, job.candidate, cfg, seed=job.seed, hook=runtime.hook, ctx=ctx, progress=progress)
        # what plugins recorded through the context travels back with the result
        for key, points in ctx.metrics.items():
            result.series.setdefault(key, []).extend(points)
        result.texts.update(ctx.texts)
        return result
    except Exception as exc:  # a candidate must never take the loop down
        return TrainResult(
            candidate_id=job.candidate.id,
            ok=False,
            seconds=time.perf_counter() - start,
            error="".join(traceback.format_exception(exc)[-6:]),
            error_kind=type(exc).__name__,
        )


def _warm_worker() -> None:
    """Import the training stack once when a worker starts, not inside the first job."""
    # one thread per job: the pool already fills the cores (set before torch/numpy load)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ.setdefault(var, "1")
    import torch  # noqa: F401

    import core.train.ppo  # noqa: F401

    torch.set_num_threads(1)


def _make_llm(llm_cfg: dict[str, Any], on_call: Callable[[Any], None] | None = None) -> Any:
    from core.llm import make_client

    return make_client(llm_cfg, on_call=on_call)


class Executor:
    """Base class: run jobs, report each result as it finishes, return them in order."""

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        raise NotImplementedError

    def close(self) -> None:
        """Release workers."""


class InProcessExecutor(Executor):
    """Train one job after another in this process (shares the run's task and plugins)."""

    def __init__(self, runtime: Runtime | None = None, progress: Any = None) -> None:
        self.runtime = runtime
        self.progress = progress

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        results = []
        for i, job in enumerate(jobs):
            result = run_job(job, self.runtime, self.progress)
            results.append(result)
            if on_done:
                on_done(i, result)
        return results


class PoolExecutor(Executor):
    """Train jobs in parallel in a pool of worker processes (spawned, so no forked state)."""

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._pool: futures.ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the workers and wait until each has imported the training stack."""
        if self._pool is None:
            self._pool = futures.ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_warm_worker)
            futures.wait([self._pool.submit(_warm_worker) for _ in range(self.workers)])

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        self.start()
        assert self._pool is not None
        pending = {self._pool.submit(run_job, job): i for i, job in enumerate(jobs)}
        results: list[TrainResult | None] = [None] * len(jobs)
        for fut in futures.as_completed(pending):
            i = pending[fut]
            try:
                results[i] = fut.result()
            except Exception as exc:  # a worker died (e.g. killed for memory)
                results[i] = TrainResult(jobs[i].candidate.id, ok=False, error=f"worker failed: {exc!r}", error_kind="crash")
            if on_done:
                on_done(i, results[i])  # type: ignore[arg-type]
        return [r for r in results if r is not None]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None


def make_executor(cfg: Any, runtime: Runtime, jobs_hint: int, progress: Any = None) -> Executor:
    """The executor the ``executor`` config names, for about ``jobs_hint`` jobs at a time."""
    kind = cfg.get("kind", "local")
    if kind == "local":
        workers = cfg.get("workers", "auto")
        workers = (os.cpu_count() or 1) if workers == "auto" else int(workers)
        if workers <= 1 or jobs_hint <= 1:
            return InProcessExecutor(runtime, progress)
        return PoolExecutor(min(workers, jobs_hint))
    if kind == "ray":
        from core.ray_executor import RayExecutor  # optional extra

        return RayExecutor(cfg)
    from core.errors import UserError

    raise UserError(f"Unknown executor kind '{kind}'. Use executor=local, executor=inprocess or executor=ray.")
