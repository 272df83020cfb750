"""A run leaves the temp folder as it found it: saved policies go to MLflow, then away.

Each test points the temp folder at one of its own (``tempfile.tempdir`` for this
process, ``TMPDIR`` for worker processes) and looks for ``policy-*.pt`` files there.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import mlflow
import pytest

from core.loop import Loop, run_experiment
from core.records import Candidate


@pytest.fixture
def temp_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))  # spawned workers
    return folder


def _policies(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.rglob("policy-*.pt"))


def _saved_in(loop: Loop, folder: Path) -> None:
    """Every training saved its policy in ``folder`` (so the tests look in the right place)."""
    results = [r for it in loop.run.history for r in it.results]
    assert results and all(Path(r.policy_path).parent == folder for r in results), [r.policy_path for r in results]


def test_a_tracked_run_uploads_its_policies_and_leaves_none(tiny_run, temp_folder):
    cfg = tiny_run("save_policy=true", "final_seeds=1")
    summary = run_experiment(cfg)
    assert summary.failed == 0 and len(summary.final_fitness) == 2  # the candidate, retrained on a second seed
    assert _policies(temp_folder) == []
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'")
    assert len(children) == 2
    for child in children:
        (saved,) = client.list_artifacts(child.info.run_id, "policy")
        assert Path(saved.path).name.startswith("policy-") and saved.file_size > 0


def test_a_run_without_a_tracker_leaves_no_policy(tiny_run, temp_folder):
    loop = Loop(tiny_run("save_policy=true"))
    summary = loop.execute()
    assert summary.candidates == 1 and summary.failed == 0
    _saved_in(loop, temp_folder)
    assert _policies(temp_folder) == []


@pytest.mark.parametrize("trainer", ["ppo", "sac"])
def test_a_bare_trainer_call_saves_no_policy(temp_folder, trainer):
    """Trainers called outside a run (tests, benchmarks, notebooks) make their own context when hooks need one."""
    from core.config import Settings
    from core.context import TrainContext
    from core.envs import make_task
    from core.registry import make_plugin_manager
    from core.train import get_trainer

    train, config_cls = get_trainer(trainer)
    task = make_task({"name": "cartpole" if trainer == "ppo" else "pendulum"})
    small = {
        "ppo": dict(frames=256, num_envs=4, rollout_steps=32, epochs=1, minibatch=64),
        "sac": dict(frames=200, init_random_frames=100, batch_size=32),
    }[trainer]
    cfg = config_cls(**small, hidden=[8], eval_every=0, eval_episodes=1)
    hook = make_plugin_manager().hook
    candidate = Candidate("bare", 0)
    results = [
        train(task, candidate, cfg, seed=0, hook=hook),
        train(
            task,
            candidate,
            cfg,
            seed=0,
            hook=hook,
            ctx=TrainContext(settings=Settings.of(), task=task, candidate=candidate, seed=0, total_frames=cfg.frames),
        ),
    ]
    assert all(r.ok and r.policy_path == "" for r in results), [r.error for r in results]
    assert _policies(temp_folder) == []


@pytest.mark.slow
def test_policies_saved_by_pool_workers_are_removed(tiny_run, temp_folder):
    loop = Loop(tiny_run("save_policy=true", "executor=local", "executor.workers=2"))
    loop.propose = lambda iteration, sources=None: [
        Candidate(f"it{iteration}-c{i}", iteration) for i in range(2)
    ]  # two jobs: the pool
    summary = loop.execute()
    assert summary.candidates == 2 and summary.failed == 0, summary.first_error
    _saved_in(loop, temp_folder)
    assert _policies(temp_folder) == []
