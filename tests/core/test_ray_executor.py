"""executor=ray: jobs run as Ray tasks and give the same results as in-process training."""

from __future__ import annotations

import pytest
import ray
from omegaconf import OmegaConf

import core.executor
import core.jobs
from core.executor import CpuReading, InProcessExecutor, TrainJob, make_executor
from core.ray_executor import RayExecutor, ensure_ray
from core.records import Candidate, TrainResult
from core.resources import conf_dir

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray at a time

TINY = [
    "env=cartpole",
    "trainer.frames=1024",
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=2",
    "trainer.eval_every=512",
    "trainer.eval_episodes=2",
    "save_policy=false",
]


@pytest.fixture(scope="module")
def local_ray():
    """One local Ray instance for the module, started as the executor starts it (seconds)."""
    cfg = OmegaConf.merge(OmegaConf.load(conf_dir() / "executor" / "ray.yaml"), {"num_cpus": 2})
    yield ensure_ray(cfg)
    ray.shutdown()


@pytest.mark.slow
def test_local_ray_workers_run_at_normal_priority(local_ray) -> None:
    # at Ray's default nice 15 a worker gets a few percent of a core beside any other work
    import os

    assert ray.get(ray.remote(num_cpus=1)(lambda: os.nice(0)).remote()) == 0


def _jobs(make_config, n: int) -> tuple[object, list[TrainJob]]:
    cfg = make_config([*TINY, "executor=ray"])
    container = OmegaConf.to_container(cfg, resolve=True)
    container.pop("hydra", None)
    return cfg, [TrainJob(container, Candidate(id=f"c{i}", iteration=0), seed=i) for i in range(n)]


def test_config_composes(make_config) -> None:
    cfg = make_config(["executor=ray", "executor.address=ray://head:10001"])
    assert cfg.executor.kind == "ray" and cfg.executor.address == "ray://head:10001"
    assert cfg.executor.cpus_per_job == 1 and cfg.executor.workers == "auto"


def test_local_ray_sizes_to_the_free_cores_and_falls_back_in_process(monkeypatch, make_config) -> None:
    ran: list[str] = []

    def fake_run_job(job, runtime=None, progress=None):
        ran.append(job.candidate.id)
        return TrainResult(job.candidate.id, ok=True)

    monkeypatch.setattr(core.jobs, "run_job", fake_run_job)
    cfg, jobs = _jobs(make_config, 3)
    busy = make_executor(cfg.executor, runtime=None, jobs_hint=3, read=lambda: CpuReading(2, 0.3))
    assert isinstance(busy, RayExecutor) and busy.plan(3) == 1
    assert [r.candidate_id for r in busy.run(jobs)] == ran == ["c0", "c1", "c2"]
    assert busy.ray is None  # Ray was never started for a batch it would not speed up
    idle = make_executor(cfg.executor, runtime=None, jobs_hint=3, read=lambda: CpuReading(2, 2.0))
    assert idle.plan(3) == min(2, core.executor.usable_cores()) or core.executor.usable_cores() == 1
    capped = RayExecutor(OmegaConf.merge(cfg.executor, {"num_cpus": 1}), read=lambda: CpuReading(2, 2.0))
    assert capped.plan(3) == 1
    cluster = RayExecutor(
        OmegaConf.merge(cfg.executor, {"address": "ray://head:10001"}), read=lambda: CpuReading(2, 0.0)
    )
    assert cluster.plan(3) == 0  # a cluster schedules every job itself


@pytest.mark.slow
def test_ray_matches_in_process(local_ray, make_config) -> None:
    cfg, jobs = _jobs(make_config, 2)
    executor = make_executor(cfg.executor, runtime=None, jobs_hint=len(jobs), read=lambda: CpuReading(2, 2.0))
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
    cfg, jobs = _jobs(make_config, 2)
    for job in jobs:
        job.settings = {**job.config, "trainer": {**job.config["trainer"], "name": "no-such-trainer"}}
    executor = RayExecutor(OmegaConf.merge(cfg.executor, {"workers": 2}))
    results = executor.run(jobs)
    assert executor.ray is not None and executor.last_plan == 2  # it ran on Ray
    assert all(not r.ok and r.error for r in results)


@pytest.mark.slow
def test_ray_tasks_draw_their_frame_bars_in_the_driver(local_ray, make_config) -> None:
    class Recorder:  # the driver's Progress, as far as the relay uses it
        def __init__(self) -> None:
            self.shown: dict[str, int] = {}
            self.bars: dict[int, str] = {}

        def add_task(self, description, total=None, **fields):
            self.bars[len(self.shown)] = description
            self.shown[description] = 0
            return len(self.shown) - 1

        def update(self, task, completed=0, **fields):
            self.shown[self.bars[task]] = completed

        def remove_task(self, task):
            self.bars.pop(task)

    cfg, jobs = _jobs(make_config, 2)
    driver = Recorder()
    executor = RayExecutor(OmegaConf.merge(cfg.executor, {"workers": 2}), progress=driver)
    try:
        results = executor.run(jobs)
    finally:
        executor.close()
    assert all(r.ok for r in results), [r.error for r in results]
    assert sorted(d.split()[1] for d in driver.shown) == ["c0", "c1"]  # each task's bar, drawn here
    assert all(frames >= 1024 for frames in driver.shown.values())  # up to its last frame
    assert driver.bars == {}  # removed when the tasks ended
