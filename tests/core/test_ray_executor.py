"""executor=ray: jobs run as Ray tasks and give the same results as in-process training."""

from __future__ import annotations

import pytest
import ray
from omegaconf import OmegaConf

from core.executor import InProcessExecutor, TrainJob, make_executor
from core.records import Candidate

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray at a time

TINY = ["env=cartpole", "trainer.frames=1024", "trainer.num_envs=4", "trainer.rollout_steps=32", "trainer.epochs=2",
        "trainer.eval_every=512", "trainer.eval_episodes=2", "save_policy=false"]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module (its start-up costs seconds)."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _jobs(make_config, n: int) -> tuple[object, list[TrainJob]]:
    cfg = make_config([*TINY, "executor=ray"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return cfg, [TrainJob(container, Candidate(id=f"c{i}", iteration=0), seed=i) for i in range(n)]


def test_config_composes(make_config) -> None:
    cfg = make_config(["executor=ray", "executor.address=ray://head:10001"])
    assert cfg.executor.kind == "ray" and cfg.executor.address == "ray://head:10001"
    assert cfg.executor.cpus_per_job == 1


@pytest.mark.slow
def test_ray_matches_in_process(local_ray, make_config) -> None:
    cfg, jobs = _jobs(make_config, 2)
    executor = make_executor(cfg.executor, runtime=None, jobs_hint=len(jobs))  # type: ignore[arg-type]
    assert type(executor).__name__ == "RayExecutor"
    seen: list[int] = []
    ray_results = executor.run(jobs, lambda i, r: seen.append(i))
    executor.close()
    local_results = InProcessExecutor().run(jobs)
    assert sorted(seen) == [0, 1]
    assert [r.candidate_id for r in ray_results] == ["c0", "c1"]
    assert all(r.ok for r in ray_results), [r.error for r in ray_results]
    assert [r.fitness.value for r in ray_results] == [r.fitness.value for r in local_results]
    assert [[p.fitness for p in r.curve] for r in ray_results] == [[p.fitness for p in r.curve] for r in local_results]


@pytest.mark.slow
def test_failed_job_is_a_result(local_ray, make_config) -> None:
    cfg, jobs = _jobs(make_config, 1)
    jobs[0].config["trainer"]["name"] = "no-such-trainer"
    (result,) = make_executor(cfg.executor, runtime=None, jobs_hint=1).run(jobs)  # type: ignore[arg-type]
    assert not result.ok and result.error
