"""Multirun jobs as Ray tasks through Hydra's Ray launcher (joblib works the same way; see docs/scaling.md)."""

from __future__ import annotations

import pickle

import pytest

from core import app
from core.testing.cli import run_cli

pytestmark = pytest.mark.xdist_group("ray")  # one local Ray at a time


def test_task_function_pickles_by_reference() -> None:
    # launchers ship the task function to workers; by value it would drag the console along
    assert pickle.loads(pickle.dumps(app.run_one)) is app.run_one


def _study(tmp_path, launcher: list[str], name: str) -> dict[str, float]:
    """A 2-seed CartPole baseline study; returns {seed: fitness} read back from MLflow."""
    out = run_cli(
        tmp_path,
        "-m",
        *launcher,
        "seed=0,1",
        "trainer.frames=4096",
        "progress=false",
        "resume=false",
        f"experiment={name}",
        timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    exp = client.get_experiment_by_name(name)
    parents = [r for r in client.search_runs([exp.experiment_id]) if "candidate" not in r.data.tags]
    assert len(parents) == 2, out.stdout[-2000:]
    assert {r.data.tags["plugins"] for r in parents} == {"none"}
    return {r.data.tags["seed"]: r.data.metrics["fitness"] for r in parents}


@pytest.mark.slow
def test_ray_launcher_matches_the_default(tmp_path) -> None:
    serial = _study(tmp_path, [], "serial")
    on_ray = _study(tmp_path, ["hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2"], "ray")
    assert set(serial) == {"0", "1"}
    assert on_ray == serial  # same seed, same training, wherever the job ran
