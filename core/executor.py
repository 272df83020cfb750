"""Where candidate trainings run: in this process, or in a local pool of worker processes.

An executor takes :class:`TrainJob` records (picklable: the run's validated
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
import dataclasses
import itertools
import math
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import OrderedDict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from omegaconf import DictConfig, OmegaConf

from core.config import ExecutorConfig, Settings, executor_config
from core.progress import ProgressRelay
from core.records import Candidate, TrainResult

if TYPE_CHECKING:  # pragma: no cover
    import pluggy

Done = Callable[[int, TrainResult], None]


@dataclass
class TrainJob:
    """One training of one candidate under one seed."""

    settings: Settings | dict[str, Any]  # the run's validated settings; a plain resolved config is validated where it runs
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
        """The plugin manager's hooks (``pm.hook``): a call reaches every plugin."""
        return self.pluginmanager.hook


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


def build_runtime(config: Settings | DictConfig | dict[str, Any], extra_plugins: tuple[object, ...] = (),
                  run_key: str = "") -> Runtime:
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


def _make_llm(llm_cfg: Any, on_call: Callable[[Any], None] | None = None) -> Any:
    from core.llm import make_client

    return make_client(llm_cfg, on_call=on_call)


# -------------------------------------------------------------------------------------
# Sizing to the free cores
# -------------------------------------------------------------------------------------

#: environment variables that set BLAS/OpenMP thread pools: one thread per worker
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class CpuReading:
    """How much of the machine this process may use, and how much of that is idle."""

    cores: int  # cores this process may run on (affinity, capped by a cgroup CPU quota)
    free: float  # of those, cores' worth idle over the reading's window (0 .. cores)
    load_avg: float | None = None  # 1-minute load average at the time, for the record
    source: str = "none"  # where ``free`` came from: proc, psutil, loadavg or none (assumed idle)


Reader = Callable[[], CpuReading]


def usable_cores() -> int:
    """Cores this process may run on: its CPU affinity, capped by a cgroup v2 CPU quota."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        cores = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cores, math.ceil(quota)) if quota else cores)


def _cgroup_quota() -> float | None:
    """Cores' worth of CPU time the cgroup may use (``cpu.max``), or None without a quota."""
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        return None


def cpu_times(text: str, cpus: set[int] | None = None) -> tuple[float, float]:
    """(idle, total) jiffies of the given CPUs (all when None) from ``/proc/stat`` text.

    Idle counts ``idle`` and ``iowait``; total counts user through steal (guest time is
    already inside user).
    """
    idle = total = 0.0
    for line in text.splitlines():
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu":
            continue
        if cpus is not None and int(name[3:]) not in cpus:
            continue
        values = [float(v) for v in fields[:8]]
        idle += values[3] + values[4]
        total += sum(values)
    return idle, total


def read_cpu(window_s: float = 0.5) -> CpuReading:
    """Measure the idle cores this process may use over ``window_s`` seconds.

    Threads of this process count as busy too (an LLM generating beside training is
    work the training would compete with). A cgroup quota caps the result by what the
    cgroup has left of it.
    """
    cores = usable_cores()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    stat, cgroup_stat = Path("/proc/stat"), Path("/sys/fs/cgroup/cpu.stat")
    try:
        cpus = os.sched_getaffinity(0)
    except (AttributeError, OSError):
        cpus = None
    if stat.exists():
        quota = _cgroup_quota()
        idle0, total0 = cpu_times(stat.read_text(), cpus)
        used0 = _cgroup_usage_s(cgroup_stat) if quota else None
        start = time.perf_counter()
        time.sleep(window_s)
        idle1, total1 = cpu_times(stat.read_text(), cpus)
        elapsed = time.perf_counter() - start
        ncpus = len(cpus) if cpus is not None else (os.cpu_count() or 1)
        free = ncpus * (idle1 - idle0) / max(total1 - total0, 1e-9)
        if quota and used0 is not None:
            used1 = _cgroup_usage_s(cgroup_stat)
            if used1 is not None:
                free = min(free, quota - (used1 - used0) / elapsed)
        return CpuReading(cores, max(0.0, min(float(cores), free)), load, "proc")
    with contextlib.suppress(ImportError):
        import psutil  # type: ignore[import-untyped]

        idle = sum(100.0 - p for p in psutil.cpu_percent(interval=window_s, percpu=True)) / 100.0
        return CpuReading(cores, max(0.0, min(float(cores), idle)), load, "psutil")
    if load is not None:
        return CpuReading(cores, max(0.0, cores - load), load, "loadavg")
    return CpuReading(cores, float(cores), None, "none")


def _cgroup_usage_s(path: Path) -> float | None:
    try:
        for line in path.read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return int(value) / 1e6
    except (OSError, ValueError):
        pass
    return None


def workers_setting(value: Any) -> int | str:
    """``executor.workers`` checked: ``"auto"`` or a positive int.

    :raises core.errors.UserError: for anything else.
    """
    if isinstance(value, str) and value == "auto":
        return value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    from core.errors import UserError

    raise UserError(f"executor.workers must be 'auto' or a positive number of workers, got {value!r}.")


def plan_workers(workers: int | str, jobs: int, reading: CpuReading | None = None) -> int:
    """Jobs to train at once: ``workers`` if a number, else sized to ``reading``.

    ``auto``: one for the driver's own core plus one per free core (a core at least half
    idle counts), at most the usable cores; never more than ``jobs``, never less than 1.
    1 means: train in this process.
    """
    workers = workers_setting(workers)
    if workers == "auto":
        reading = reading or read_cpu()
        workers = min(reading.cores, 1 + int(math.floor(reading.free + 0.5)))
    return max(1, min(int(workers), jobs))


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
        if runtime is not None and job.run_key and job.run_key == runtime.run_key and not isinstance(job.settings, Settings):
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

    def __init__(self, workers: int | str, runtime: Runtime | None = None, progress: Any = None, read: Reader = read_cpu) -> None:
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
            self._pool = futures.ProcessPoolExecutor(size, mp_context=context, initializer=_warm_worker,
                                                     initargs=(self.ship(prime) if prime else None, self._queue))
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
                    future.add_done_callback(lambda _, span=span: span.__setitem__(1, time.perf_counter()))
                    pending[future] = i
                if not exhausted:
                    began = time.perf_counter()
                    job = next(source, None)  # may wait (on the LLM) while the workers train
                    waits.append((began, time.perf_counter()))
                    if job is None:
                        exhausted = True
                    else:
                        queue.append((len(arrived), job))
                        arrived.append(job)
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
    def _collect(fut: futures.Future[TrainResult], i: int, jobs: list[TrainJob], results: list[TrainResult | None],
                 on_done: Done | None) -> None:
        try:
            results[i] = fut.result()
        except Exception as exc:  # a worker died (e.g. killed for memory)
            results[i] = TrainResult(jobs[i].candidate.id, ok=False, error=f"worker failed: {exc!r}", error_kind="crash")
        if on_done:
            on_done(i, results[i])  # type: ignore[arg-type]

    def _train_all(self, jobs: list[TrainJob], queue: list[tuple[int, TrainJob]], pending: dict[Any, int],
                   results: list[TrainResult | None], at_once: int, show: bool, on_done: Done | None) -> None:
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


def make_executor(cfg: ExecutorConfig | Any, runtime: Runtime | None, jobs_hint: int, progress: Any = None,
                  read: Reader = read_cpu) -> Executor:
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
