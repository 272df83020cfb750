"""A candidate training as a job: the record, the run's runtime, and how one job runs.

A :class:`TrainJob` holds the run's validated :class:`core.config.Settings`, the
candidate, the seed and the run's key; :func:`run_job` trains it in this process and
returns a :class:`TrainResult` (a failure included). A worker builds its run's task and
plugin objects once per run (:func:`worker_runtime`). :class:`Executor` is what every
backend implements (:class:`InProcessExecutor` here; the process pool in
:mod:`core.executor`, Ray in :mod:`core.ray_executor`); :func:`core.executor.make_executor`
picks one from the run's config.
"""

from __future__ import annotations

import dataclasses
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig, OmegaConf

from core.config import Settings
from core.records import Candidate, TrainResult

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

Done = Callable[[int, TrainResult], None]


@dataclass
class TrainJob:
    """One training of one candidate under one seed."""

    settings: (
        Settings | dict[str, Any]
    )  # the run's validated settings; a plain resolved config is validated where it runs
    candidate: Candidate
    seed: int
    run_key: str = ""  # the run this job belongs to: a worker keeps one runtime per run

    @property
    def config(self) -> dict[str, Any]:
        """The run's resolved config as plain containers."""
        if isinstance(self.settings, Settings):
            return OmegaConf.to_container(self.settings.config, resolve=True)  # type: ignore[return-value]
        return self.settings


@dataclass
class Runtime:
    """What a process needs to train for one run: built once per run and process."""

    task: Any
    pluginmanager: pluggy.PluginManager  # the run's plugin objects: contexts call each plugin through it
    settings: Settings
    fingerprint: dict[str, str] = field(default_factory=dict)  # code hashes: framework and each plugin
    run_key: str = ""

    @property
    def config(self) -> Any:
        return self.settings.config

    @property
    def hook(self) -> Any:
        """The plugin manager's hooks (``pm.hook``) for a training: a call reaches every plugin,
        on a fork of torch's random stream (:mod:`core.train.rng`: plugins do not move the trainer's)."""
        from core.train.rng import SeparateStream

        return SeparateStream(self.pluginmanager.hook)


#: a worker process's runtimes (pool and Ray workers), one per run, the most recently used last:
#: jobs of several runs may reach one worker interleaved, and each keeps its own plugin objects
_RUNTIMES: OrderedDict[str, Runtime] = OrderedDict()
_RUNTIMES_KEPT = 4


def worker_runtime(job: TrainJob) -> Runtime:
    """The runtime of ``job``'s run in this process, built on its run's first job.

    A job without a ``run_key`` gets a fresh runtime of its own.
    """
    if not job.run_key:
        return build_runtime(job.settings)
    runtime = _RUNTIMES.get(job.run_key)
    if runtime is None:
        runtime = _RUNTIMES[job.run_key] = build_runtime(job.settings, run_key=job.run_key)
        while len(_RUNTIMES) > _RUNTIMES_KEPT:
            _RUNTIMES.popitem(last=False)
    _RUNTIMES.move_to_end(job.run_key)
    return runtime


def build_runtime(
    config: Settings | DictConfig | dict[str, Any], extra_plugins: tuple[object, ...] = (), run_key: str = ""
) -> Runtime:
    """Build a run's task and plugin manager (fresh plugin objects).

    ``config``: the run's validated :class:`Settings` (a worker's case: used as they
    are), or a config, validated here first.

    :raises core.errors.UserError: for an unknown plugin, a bad config value or a hook
        that does not match its spec, before any work.
    """
    from core.config import env_config, framework_hash, source_hash, validate
    from core.envs import make_task
    from core.registry import load_plugins, make_plugin_manager

    if isinstance(config, Settings):
        settings, checked = config, True
        modules = load_plugins(settings.plugins.keys())
    else:
        if not isinstance(config, DictConfig):
            config = OmegaConf.create(config)
        modules = load_plugins((config.get("plugins") or {}).keys())
        settings, checked = validate(config, modules), False
    pm = make_plugin_manager(settings, modules, extra=extra_plugins)
    extra_tasks: dict[str, Any] = {}
    for contributed in pm.hook.register_tasks():
        extra_tasks.update(contributed or {})
    if not checked and settings.env is not None and settings.env.name in extra_tasks:  # a plugin's task: typed now
        settings.env = env_config(settings.env.node(), extra_tasks)
    task = make_task(settings.env.node() if settings.env is not None else {}, extra=extra_tasks)
    fingerprint = {"framework": framework_hash(), **{f"plugin:{n}": source_hash(m) for n, m in modules.items()}}
    for obj in extra_plugins:
        module = sys.modules.get(getattr(obj, "__module__", "") or "") or obj
        fingerprint[f"extra:{getattr(obj, '__name__', type(obj).__name__)}"] = source_hash(module)
    return Runtime(task=task, pluginmanager=pm, settings=settings, fingerprint=fingerprint, run_key=run_key)


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
        settings = runtime.settings
        cfg, llm_cfg = settings.trainer, settings.llm
        if cfg is None:
            raise ValueError("the run's config has no trainer node")
        torch.set_num_threads(int(getattr(cfg, "threads", 1)))
        trainer, _ = get_trainer(settings.trainer_name)

        def log_call(record: Any) -> None:  # LLM calls made during training join the candidate's artifacts
            ctx.log_text("llm_calls.md", format_llm_call(record) + "\n\n---\n\n")

        ctx = TrainContext(
            settings=runtime.settings,
            task=runtime.task,
            candidate=job.candidate,
            seed=job.seed,
            total_frames=cfg.frames,
            llm_factory=(lambda: _make_llm(llm_cfg, log_call)) if llm_cfg else None,
            pluginmanager=runtime.pluginmanager,
        )
        result = trainer(runtime.task, job.candidate, cfg, seed=job.seed, hook=runtime.hook, ctx=ctx, progress=progress)
        # what plugins recorded through the context travels back with the result
        for key, points in ctx.metrics.items():
            result.series.setdefault(key, []).extend(points)
        for key, value in ctx.llm_metrics().items():  # a judge's or labeller's calls count in the run's LLM totals
            result.series[key] = [(result.frames, value)]
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


def _make_llm(llm_cfg: Any, on_call: Callable[[Any], None] | None = None) -> Any:
    from core.llm import make_client

    return make_client(llm_cfg, on_call=on_call)


# -------------------------------------------------------------------------------------
# Executors
# -------------------------------------------------------------------------------------


class Executor:
    """Base class: run jobs, report each result as it finishes, return them in order."""

    #: seconds of the last :meth:`stream` during which jobs trained while the next was awaited
    overlap_s: float = 0.0
    #: the run's runtime (its settings go with the jobs that leave this process)
    runtime: Runtime | None = None

    def ship(self, job: TrainJob) -> TrainJob:
        """``job`` as it leaves this process: a job of this executor's run carries the run's
        validated settings, so the worker does not validate its config again."""
        runtime = self.runtime
        if (
            runtime is not None
            and job.run_key
            and job.run_key == runtime.run_key
            and not isinstance(job.settings, Settings)
        ):
            return dataclasses.replace(job, settings=runtime.settings)
        return job

    def run(self, jobs: list[TrainJob], on_done: Done | None = None) -> list[TrainResult]:
        raise NotImplementedError

    def stream(self, jobs: Iterable[TrainJob], on_done: Done | None = None, expected: int = 0) -> list[TrainResult]:
        """:meth:`run` for jobs that arrive over time: ``jobs`` may block between jobs
        (the loop's proposals, sampled by the LLM as training runs). ``expected``: about
        how many will come, for sizing. This base version takes them all, then runs
        them; the in-process and pool executors start on the first ones instead.
        """
        return self.run(list(jobs), on_done)

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

    def stream(self, jobs: Iterable[TrainJob], on_done: Done | None = None, expected: int = 0) -> list[TrainResult]:
        """Each job as it arrives: training starts earlier, but the next jobs' sampling
        waits while one trains (this process does both in turn)."""
        return self.run(jobs, on_done)  # type: ignore[arg-type]  # run only iterates
