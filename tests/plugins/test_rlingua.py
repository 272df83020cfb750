"""rlingua: the controller is written, probed in the sandbox (failures fed back to the LLM), acts
as SAC's behaviour policy with an annealed probability, and is imitated."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from core.context import ActionPrior
from core.envs.classic import MountainCarContinuous
from core.errors import UserError
from core.records import Candidate
from core.registry import make_plugin_manager
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, final_metrics, make_run, make_train, plugin_object
from core.train import sac
from core.train.sac import SACConfig
from plugins import rlingua

#: a controller for MountainCarContinuous: push in the direction of the velocity, hard
PUMP = """```python
import torch

def act(state):
    v = state["car_velocity"]
    return torch.where(v >= 0, torch.ones_like(v), -torch.ones_like(v)).reshape(-1, 1)
```"""
#: the same with a bug the probe finds (a field that does not exist)
BROKEN = PUMP.replace('state["car_velocity"]', 'state["speed"]')
#: the wrong width (two values per state for a one-dimensional action)
WIDE = PUMP.replace(".reshape(-1, 1)", ".reshape(-1, 1).repeat(1, 2)")


def fields_of(task) -> list[str]:
    return [f.name for f in task.state_fields]


def controller(llm: ScriptedLLM, seed: int = 0, **overrides):
    task = MountainCarContinuous()
    train = make_train(task, llm, plugin="rlingua", module=rlingua, overrides=overrides, total_frames=1000, seed=seed)
    plugin = plugin_object(rlingua, **overrides)
    plugin.on_train_start(train)
    return plugin, train


def test_task_fields_the_controllers_use():
    assert "car_velocity" in fields_of(MountainCarContinuous())


def test_action_dim_is_read_from_the_description():
    assert rlingua.action_dim(MountainCarContinuous()) == 1


def test_the_prompt_binds_every_field_of_the_task_and_no_made_up_one():
    task = MountainCarContinuous()
    prompt = rlingua.build_messages(task, ("math", "torch"), 1)[-1]["content"]
    for name in task.field_names():  # derived fields included
        assert re.search(rf"^    {name} = state\.{name} +# \[B\]$", prompt, re.MULTILINE), name
    read = set(re.findall(r"state\.(\w+)", prompt)) | set(re.findall(r"state\[\"(\w+)\"\]", prompt))
    assert read == set(task.field_names())  # every field the prompt reads is the task's
    assert "def act(state):" in prompt and "[B, 1]" in prompt and "Use only math, torch" in prompt
    earlier = rlingua.build_messages(task, ("math", "torch"), 1, interface="dict")[-1]["content"]
    assert "state: dict of field name -> torch.Tensor" in earlier and "state.car_velocity" not in earlier


def test_a_controller_reading_an_unknown_field_is_refused_with_the_fields_before_it_runs(monkeypatch):
    prepared = []
    real = rlingua.prepare_state  # the plugin's own name for it (from core.plugin)
    monkeypatch.setattr(
        rlingua, "prepare_state", lambda program, *a, **k: prepared.append(program.source) or real(program, *a, **k)
    )
    llm = ScriptedLLM(replies=[PUMP.replace('state["car_velocity"]', "state.cart_speed"), PUMP])
    plugin, train = controller(llm, attempts=2, temperature=0.3)
    assert len(prepared) == 1 and "cart_speed" not in prepared[0]  # the first reply never reached the sandbox
    retry = llm.calls[1].last
    assert "`cart_speed` is not a field of this task" in retry
    assert "The state has exactly these fields: " + ", ".join(MountainCarContinuous().field_names()) + "." in retry
    assert {(c.temperature, tuple(c.stop)) for c in llm.calls} == {(0.3, ("\n```\n",))}  # the method's temperature
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    assert result.metrics["rlingua/failed_attempts"] == 1 and result.metrics["rlingua/controller_ok"] == 1.0
    assert "cart_speed` is not a field" in train.texts["rlingua/controller.md"]


def test_a_unique_close_field_is_renamed_and_recorded():
    plugin, train = controller(
        ScriptedLLM(replies=[PUMP.replace('state["car_velocity"]', "state.car_velocty")]), attempts=1
    )
    assert plugin.action_prior(train, torch.tensor([[-0.5, 0.01]])).mean.tolist() == [[1.0]]
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    text = train.texts["rlingua/controller.md"]
    assert "state.car_velocity" in text and "## Name fixes before it ran" in text and "car_velocty" in text


def test_a_probed_controller_acts_with_the_annealed_probability():
    plugin, train = controller(ScriptedLLM(replies=[PUMP]), p0=0.8, anneal=0.5)
    obs = torch.tensor([[-0.5, 0.01], [-0.5, -0.02]])
    prior = plugin.action_prior(train, obs)
    assert isinstance(prior, ActionPrior)
    assert prior.mean.tolist() == [[1.0], [-1.0]] and prior.prob == pytest.approx(0.8)
    train.frames = 250  # a quarter of the budget: half-way through the annealing
    assert plugin.action_prior(train, obs).prob == pytest.approx(0.4)
    assert plugin.action_prior(train, obs).imitation == pytest.approx(0.5)
    train.frames = 500
    assert plugin.action_prior(train, obs) is None  # annealed away: no call at all
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    assert result.metrics["rlingua/controller_ok"] == 1.0 and result.metrics["rlingua/calls"] == 3
    assert 'state["car_velocity"]' in train.texts["rlingua/controller.md"]


def test_a_failing_controller_is_fed_back_to_the_llm_until_one_passes():
    llm = ScriptedLLM(replies=[BROKEN, WIDE, PUMP])
    plugin, train = controller(llm, seed=7, attempts=3)
    assert len(llm.calls) == 3
    second, third = llm.calls[1].last, llm.calls[2].last
    assert "failed the check" in second and "speed" in second and "car_velocity" in second  # the real fields are named
    assert "2 values per state" in third
    # each attempt, and each training seed, draws its own sample (the LLM cache keys on the seed)
    assert [c.seed for c in llm.calls] == [7000, 7001, 7002]
    assert plugin.action_prior(train, torch.zeros(1, 2)) is not None
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    assert result.metrics["rlingua/failed_attempts"] == 2 and result.metrics["rlingua/controller_ok"] == 1.0


def test_no_working_controller_leaves_plain_training_and_says_why():
    plugin, train = controller(ScriptedLLM(replies=["I cannot write code."]), attempts=2)
    assert plugin.action_prior(train, torch.zeros(1, 2)) is None
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    assert result.metrics["rlingua/controller_ok"] == 0.0
    assert "none passed the check" in train.texts["rlingua/controller.md"]


def test_an_on_policy_trainer_is_refused():
    run = make_run(
        MountainCarContinuous(), plugin="rlingua", module=rlingua, config={"trainer": {"name": "ppo", "frames": 1024}}
    )
    with pytest.raises(UserError, match="trainer=sac"):
        plugin_object(rlingua).on_run_start(run)


def test_the_controller_acts_in_sac_training():
    """The action role in a real SAC training: the controller's pumping actions fill the buffer early."""
    task = MountainCarContinuous()
    overrides = {"p0": 1.0, "anneal": 0.5, "std": 0.0}
    train = make_train(
        task, ScriptedLLM(replies=[PUMP]), plugin="rlingua", module=rlingua, overrides=overrides, total_frames=200
    )  # as the executor sets it: trainer.frames
    pm = make_plugin_manager(train.settings, {"rlingua": rlingua})
    train.pluginmanager = pm  # and its hooks: the core calls each plugin's prior through it
    cfg = SACConfig(frames=200, init_random_frames=50, batch_size=32, hidden=[16], eval_every=0, eval_episodes=1)
    result = sac.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=train)
    assert result.ok, result.error
    assert result.metrics["rlingua/controller_ok"] == 1.0
    assert result.metrics["action_prior/share"] == pytest.approx(0.25, abs=0.08)  # p from 1 to 0 over half the budget
    assert train.metrics["losses/imitation_loss"], "the actor was never pulled towards the controller"


@pytest.mark.slow
def test_end_to_end_on_kuka_with_the_embedded_model(tmp_path: Path):
    """``python -m core +plugins=[rlingua] env=kuka_grasp`` (SAC from the plugin's config) at a few frames:
    the embedded model's controller either passed its probe and acted in training, or each failed
    attempt was recorded and sent back (the acting path with a scripted model:
    test_the_controller_acts_in_sac_training)."""
    # Two attempts (1-2 calls): the second is the first's error sent back, all that the failure
    # branch checks; a third attempt (the default) cost one more long call with a longer conversation.
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = [
        "+plugins=[rlingua]", "env=kuka_grasp", "trainer.frames=300",
        "trainer.init_random_frames=100", "trainer.batch_size=32", "trainer.eval_episodes=1", "trainer.eval_every=0",
        "plugins.rlingua.max_tokens=768", "plugins.rlingua.attempts=2", "executor=inprocess", "progress=false",
        "save_policy=false",
    ]  # fmt: skip
    proc = run_cli(tmp_path, *args, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = final_metrics(child.data.metrics)
    text = Path(client.download_artifacts(child.info.run_id, "texts/rlingua/controller.md", str(tmp_path))).read_text()
    if metrics["rlingua/controller_ok"] == 1.0:  # the model's controller passed its probe: it acted in training
        assert metrics["action_prior/share"] > 0.1 and metrics["rlingua/calls"] > 0, metrics
        assert "def act(state)" in text
    else:  # the 1.5B model's controllers all failed (docs/plugins/rlingua.md): each error was recorded and sent back
        assert metrics["rlingua/failed_attempts"] >= 1, metrics
        assert "## Errors" in text
