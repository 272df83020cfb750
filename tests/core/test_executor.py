"""Executors: a candidate's training gives the same result wherever it runs."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from core.executor import InProcessExecutor, PoolExecutor, TrainJob, build_runtime, make_executor, run_job
from core.records import Candidate, RewardProgram


def _jobs(make_config, seeds=(0, 1)) -> list[TrainJob]:
    cfg = make_config(["trainer.frames=1024", "trainer.eval_episodes=2", "trainer.eval_every=0", "save_policy=false"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return [TrainJob(container, Candidate(id=f"c{s}", iteration=0), s) for s in seeds]


@pytest.mark.slow
def test_pool_and_in_process_give_identical_results(make_config):
    jobs = _jobs(make_config)
    runtime = build_runtime(jobs[0].config)
    serial = InProcessExecutor(runtime).run(jobs)
    pool = PoolExecutor(2)
    try:
        seen: list[int] = []
        parallel = pool.run(jobs, on_done=lambda i, r: seen.append(i))
    finally:
        pool.close()
    assert sorted(seen) == [0, 1]
    for a, b in zip(serial, parallel):
        assert a.ok and b.ok, (a.error, b.error)
        assert a.frames == b.frames >= 1024
        assert a.fitness.value == b.fitness.value
        assert [e.ret for e in a.episodes] == [e.ret for e in b.episodes]


def test_a_crashing_candidate_becomes_a_failed_result(make_config):
    (job,) = _jobs(make_config, seeds=(0,))
    job.candidate.reward = RewardProgram(source="def compute_reward(state, action, next_state):\n    return 1 / 0\n", entry="compute_reward")
    result = run_job(job, build_runtime(job.config))
    assert not result.ok
    assert "ZeroDivisionError" in result.error or "division" in result.error
    assert result.error_kind


def test_local_executor_runs_one_job_in_process(make_config):
    runtime = build_runtime(_jobs(make_config)[0].config)
    assert isinstance(make_executor(OmegaConf.create({"kind": "local", "workers": "auto"}), runtime, 1), InProcessExecutor)
    assert isinstance(make_executor(OmegaConf.create({"kind": "local", "workers": 2}), runtime, 4), PoolExecutor)
    assert isinstance(make_executor(OmegaConf.create({"kind": "local", "workers": 1}), runtime, 4), InProcessExecutor)
