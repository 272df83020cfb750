"""Executors: a candidate's training gives the same result wherever it runs; workers are
sized to the free cores (readings injected, so these tests need no real load)."""

from __future__ import annotations

import os

import pytest
from omegaconf import OmegaConf

import core.executor
import core.jobs
from core.errors import UserError
from core.executor import (
    CpuReading,
    InProcessExecutor,
    PoolExecutor,
    TrainJob,
    build_runtime,
    cpu_times,
    make_executor,
    one_thread_env,
    plan_workers,
    read_cpu,
    run_job,
    workers_setting,
)
from core.records import Candidate, RewardProgram, TrainResult


def _jobs(make_config, seeds=(0, 1)) -> list[TrainJob]:
    cfg = make_config(["trainer.frames=1024", "trainer.eval_episodes=2", "trainer.eval_every=0", "save_policy=false"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return [TrainJob(container, Candidate(id=f"c{s}", iteration=0), s) for s in seeds]


def fixed(cores: int, free: float):
    """A reader that always reports ``free`` idle cores out of ``cores``."""
    return lambda: CpuReading(cores, free, source="test")


# -- sizing -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "cores,free,jobs,expected",
    [
        (2, 2.0, 4, 2),  # idle: every core
        (2, 1.9, 4, 2),
        (2, 1.0, 4, 2),  # one core busy: the driver's core plus the free one
        (2, 0.6, 4, 2),  # a core at least half idle counts
        (2, 0.4, 4, 1),  # both cores busy: train in this process
        (2, 0.0, 4, 1),
        (16, 4.0, 8, 5),  # 12 of 16 busy: one plus the four free
        (16, 16.0, 3, 3),  # never more than the jobs
        (16, 16.0, 40, 16),  # never more than the cores
        (1, 1.0, 4, 1),  # one core: in this process
        (4, 4.0, 0, 1),  # no jobs: still a sane plan
    ],
)
def test_auto_sizes_to_the_free_cores(cores, free, jobs, expected):
    assert plan_workers("auto", jobs, CpuReading(cores, free)) == expected


def test_a_number_of_workers_is_taken_as_given():
    busy = CpuReading(2, 0.0)
    assert plan_workers(3, 8, busy) == 3  # whatever the load
    assert plan_workers(3, 2, busy) == 2 and plan_workers(1, 8) == 1


@pytest.mark.parametrize("bad", [0, -2, "many", "2", True, 1.5, None])
def test_workers_setting_refuses_bad_values(bad):
    with pytest.raises(UserError, match="executor.workers"):
        workers_setting(bad)


PROC_STAT = """cpu  400 0 100 1500 0 0 0 0 0 0
cpu0 100 0 50 850 0 0 0 0 0 0
cpu1 300 0 50 600 50 0 0 0 0 0
intr 12345
ctxt 999
"""


def test_cpu_times_reads_the_cores_this_process_may_use():
    assert cpu_times(PROC_STAT) == (850 + 600 + 50, 1000 + 1000)
    assert cpu_times(PROC_STAT, {1}) == (650, 1000)  # idle counts iowait


def test_read_cpu_reports_a_share_of_the_usable_cores():
    reading = read_cpu(window_s=0.05)
    assert 1 <= reading.cores <= (os.cpu_count() or 1)
    assert 0.0 <= reading.free <= reading.cores
    assert reading.source in ("proc", "psutil", "loadavg", "none")


def test_workers_start_with_one_blas_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    with one_thread_env():
        assert os.environ["OMP_NUM_THREADS"] == os.environ["MKL_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "8" and "MKL_NUM_THREADS" not in os.environ


def test_make_executor_follows_the_config():
    auto, two, one = ({"kind": "local", "workers": w} for w in ("auto", 2, 1))
    assert isinstance(make_executor(OmegaConf.create(auto), None, 1), InProcessExecutor)  # one job
    assert isinstance(make_executor(OmegaConf.create(one), None, 4), InProcessExecutor)
    pool = make_executor(OmegaConf.create(two), None, 4)
    assert isinstance(pool, PoolExecutor) and pool.plan(4) == 2
    sized = make_executor(OmegaConf.create(auto), None, 4, read=fixed(2, 1.0))
    if (core.executor.usable_cores()) > 1:
        assert isinstance(sized, PoolExecutor) and sized.plan(4) == 2
        assert sized.plan(1) == 1
    with pytest.raises(UserError, match=r"executor.*workers must be 'auto'"):
        make_executor(OmegaConf.create({"kind": "local", "workers": "lots"}), None, 4)


def test_a_busy_machine_trains_in_this_process(monkeypatch):
    # both cores busy: the batch runs in the driver, no worker process is started
    ran: list[str] = []

    def fake_run_job(job, runtime=None, progress=None):
        ran.append(job.candidate.id)
        return TrainResult(job.candidate.id, ok=True)

    monkeypatch.setattr(core.jobs, "run_job", fake_run_job)
    jobs = [TrainJob({}, Candidate(id=f"c{i}", iteration=0), seed=i) for i in range(3)]
    pool = PoolExecutor("auto", read=fixed(2, 0.2))
    seen: list[int] = []
    results = pool.run(jobs, on_done=lambda i, r: seen.append(i))
    assert pool.last_plan == 1 and pool._pool is None and pool.size == 0
    assert ran == ["c0", "c1", "c2"] == [r.candidate_id for r in results] and seen == [0, 1, 2]


# -- training -----------------------------------------------------------------------


@pytest.mark.slow
def test_pool_and_in_process_give_identical_results(make_config):
    jobs = _jobs(make_config, seeds=(0, 1, 2))
    runtime = build_runtime(jobs[0].config)
    serial = InProcessExecutor(runtime).run(jobs)
    pool = PoolExecutor("auto", read=fixed(2, 1.0))  # two at once, three jobs: one waits for a worker
    try:
        seen: list[int] = []
        parallel = pool.run(jobs, on_done=lambda i, r: seen.append(i))
        assert pool.last_plan == 2 and pool.size == 2
    finally:
        pool.close()
    assert sorted(seen) == [0, 1, 2]
    for a, b in zip(serial, parallel):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.frames == b.frames >= 1024
        assert a.fitness.value == b.fitness.value
        assert [e.ret for e in a.episodes] == [e.ret for e in b.episodes]


def test_a_worker_takes_the_runs_settings_as_they_are(make_config, monkeypatch):
    # validated once where the run starts: a job leaves the process with the typed settings,
    # and a worker builds its runtime from them without validating the config again
    import pickle

    import core.config

    (job,) = _jobs(make_config, seeds=(0,))
    runtime = build_runtime(job.config, run_key="run-1")
    job.run_key = "run-1"
    shipped = pickle.loads(pickle.dumps(PoolExecutor(2, runtime).ship(job)))
    assert isinstance(shipped.settings, core.config.Settings)

    def validate_again(*args, **kwargs):
        raise AssertionError("the worker validated the config again")

    monkeypatch.setattr(core.config, "validate", validate_again)
    worker = build_runtime(shipped.settings, run_key="run-1")
    assert worker.settings.trainer == runtime.settings.trainer and worker.settings.llm == runtime.settings.llm
    assert worker.task.name == runtime.task.name
    assert PoolExecutor(2, runtime).ship(TrainJob(job.config, job.candidate, 0, "another-run")).settings == job.config


def test_a_crashing_candidate_becomes_a_failed_result(make_config):
    (job,) = _jobs(make_config, seeds=(0,))
    job.candidate.reward = RewardProgram(
        source="def compute_reward(state, action, next_state):\n    return 1 / 0\n", entry="compute_reward"
    )
    result = run_job(job, build_runtime(job.config))
    assert not result.ok
    assert "ZeroDivisionError" in result.error or "division" in result.error
    assert result.error_kind
