"""ellm: captions, goal parsing, cached suggestions, the reward for achieving a suggested goal."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import fakes
from fakes import ScriptedLLM, make_run, make_train, plugin_object
from omegaconf import OmegaConf

from core import hookimpl
from core.config import typed
from core.context import StepBatch
from core.envs import make_task
from core.envs.crafter import VIEW_IDS
from core.errors import UserError
from core.plan import goal_names
from core.records import Candidate, TrainResult
from plugins import ellm


@pytest.fixture(scope="module")
def task():
    return make_task({"name": "minecraft", "max_episode_steps": 60, "pixels": False})


#: view cells next to the player (the view is [dx + 4, dy + 3] of a 9x7 window, flattened)
NEAR = [5 * 7 + 3, 3 * 7 + 3, 4 * 7 + 4, 4 * 7 + 2]


def _obs(task, *, see=(), have=(), done=(), food=9):
    obs = torch.zeros(task.obs_dim)
    at = {f.name: f for f in task.state_fields}
    obs[at["food"].start] = food
    for v in ("health", "drink", "energy"):
        obs[at[v].start] = 9
    view = at["local_view"]
    obs[view.start: view.stop] = VIEW_IDS["grass"]
    for cell, thing in zip(NEAR, see):
        obs[view.start + cell] = VIEW_IDS[thing]
    for item in have:
        obs[at[item].start] = 2
    for g in done:
        obs[at[f"achievement_{g}"].start] = 1
    return obs


def test_captions_are_coarse_and_repeat(task):
    a = _obs(task, see=["tree", "cow"], have=["wood"], food=2)
    b = _obs(task, see=["cow", "tree", "tree"], have=["wood"], food=1)  # other counts, same caption
    keys = ellm.caption_keys(task, torch.stack([a, b, _obs(task)]), 3)
    assert (keys[0] == keys[1]).all() and not (keys[0] == keys[2]).all()
    assert ellm.caption(keys[0]) == "You see: tree, cow. You have: wood. Low: food."
    assert ellm.caption(keys[2]) == "You see: only grass. You have: nothing."
    # the radius: a tree at the view's corner is named in the whole view, not in the 5x5 square
    far = _obs(task)
    far[next(f for f in task.state_fields if f.name == "local_view").start] = VIEW_IDS["tree"]  # cell [0, 0]: 4 left, 3 up
    assert ellm.caption(ellm.caption_keys(task, far[None], 3, radius=4)[0]).startswith("You see: tree.")
    assert ellm.caption(ellm.caption_keys(task, far[None], 3, radius=2)[0]).startswith("You see: only grass.")


def test_parse_goals_maps_names_and_reports_the_rest(task):
    goals = goal_names(task)
    reply = "1. Collect Wood\n- place_table\n- build a castle\nYou could also eat_cow, then collect wood again."
    found, unknown = ellm.parse_goals(reply, goals, 3)
    assert found == ["collect_wood", "place_table", "eat_cow"]
    assert unknown == ["build a castle"]


def make(task, llm, **overrides):
    train = make_train(task, llm, plugin=ellm.NAME, module=ellm, overrides=overrides)
    return ellm.Plugin(train.plugin_config(ellm.NAME)), train


def _batch(task, before, after):
    n = len(before)
    return StepBatch(obs=torch.stack(before), action=torch.zeros(n), next_obs=torch.stack(after), env_reward=torch.zeros(n),
                     reward=torch.zeros(n), done=torch.zeros(n, dtype=torch.bool), task=task)


def test_suggested_goals_pay_once_their_caption_is_answered(task):
    llm = ScriptedLLM(answer=lambda messages, tag: "collect_wood\nfly to the moon" if "tree" in messages[-1]["content"] else "collect_drink")
    plugin, train = make(task, llm, bonus=0.5)
    plugin.on_train_start(train)
    near_tree, has_wood = _obs(task, see=["tree"]), _obs(task, see=["tree"], have=["wood"], done=["collect_wood"])
    sapling = _obs(task, see=["tree"], done=["collect_sapling"])
    batch = _batch(task, [near_tree, near_tree], [has_wood, sapling])
    assert plugin.compute_reward(train, batch) is None  # nothing answered yet: no reward, no waiting
    plugin.on_rollout(train, None)  # the unanswered caption goes to the LLM
    (call,) = llm.calls
    assert "You see: tree." in call.last and "collect_wood" in call.messages[0]["content"] and call.tag == "ellm-goals"
    # the achieved goal was suggested for the starting state: paid; an achievement not suggested: not
    assert plugin.compute_reward(train, batch).tolist() == [0.5, 0.0]
    # answered once, cached: no second query for the same caption
    plugin.on_rollout(train, None)
    assert len(llm.calls) == 1
    # the name the game cannot check goes back to the LLM in the next prompts
    plugin.compute_reward(train, _batch(task, [_obs(task, see=["water"])], [_obs(task, see=["water"])]))
    plugin.on_rollout(train, None)
    assert "never suggest them: fly to the moon" in llm.calls[1].last
    result = TrainResult("c", True)
    plugin.on_train_end(train, result)
    assert result.metrics["ellm/goal_reward"] == 0.5 and result.metrics["ellm/hits"] == 1.0
    assert result.metrics["ellm/achieved_collect_wood"] == 1.0 and result.metrics["ellm/rejected"] == 1.0
    assert result.metrics["ellm/queries"] == 2.0 and "You see: tree. You have: nothing. -> collect_wood" in train.texts["ellm-suggestions.md"]


def test_queries_per_rollout_caps_the_llm_calls_most_frequent_first(task):
    llm = ScriptedLLM(answer=lambda messages, tag: "collect_wood")
    plugin, train = make(task, llm, queries_per_rollout=1)
    common, rare = _obs(task, see=["cow"]), _obs(task, see=["lava"])
    plugin.compute_reward(train, _batch(task, [common, common, rare], [common, common, rare]))
    plugin.on_rollout(train, None)
    (call,) = llm.calls
    assert "cow" in call.last


def test_an_llm_failure_skips_the_batch_and_training_goes_on(task):
    def broken(messages, tag):
        raise RuntimeError("backend down")

    plugin, train = make(task, ScriptedLLM(answer=broken))
    plugin.compute_reward(train, _batch(task, [_obs(task)], [_obs(task)]))
    plugin.on_rollout(train, None)
    assert "backend down" in train.texts["ellm-errors.txt"] and plugin.suggested == {}


def test_run_start_refuses_tasks_without_goals():
    run = make_run(make_task({"name": "cartpole"}), plugin=ellm.NAME, module=ellm)
    with pytest.raises(UserError, match="minecraft"):
        plugin_object(ellm).on_run_start(run)


def test_config_defaults_are_the_yaml_file():
    yaml = OmegaConf.load(Path(__file__).parents[2] / "conf/plugins/ellm.yaml")
    assert typed(ellm.Config, yaml, "plugins.ellm") == ellm.Config() == plugin_object(ellm).cfg


@pytest.mark.parametrize("key,value", [("goals_per_state", 0), ("queries_per_rollout", 0), ("max_tokens", 0), ("temperature", -1.0),
                                       ("view_radius", 0)])
def test_config_refuses_values_that_cannot_work(key, value):
    with pytest.raises(UserError, match=key):
        plugin_object(ellm, **{key: value})


def _goals_or_plausible(messages):
    """ELLM's prompts get goals a random agent reaches; every other prompt the shared fake's answer."""
    if "suggest the" in messages[0]["content"] and "Crafter" in messages[0]["content"]:
        return "collect_wood\ncollect_sapling\ncollect_drink"
    return fakes.answer(messages)


@pytest.mark.slow
def test_combines_with_a_reward_plugin_eureka_and_ellm(make_config, monkeypatch):
    """``+plugins=[eureka,ellm]``: the candidate trains on eureka's program plus ELLM's goal reward."""
    from core.loop import run_experiment

    llm = fakes.install_fake_litellm(monkeypatch, _goals_or_plausible)
    cfg = make_config(["+plugins=[eureka,ellm]", "env=minecraft", "env.max_episode_steps=200", "plugins.eureka.iterations=1",
                       "plugins.eureka.samples=1", "executor=inprocess", "trainer.frames=2048", "trainer.num_envs=4",
                       "trainer.rollout_steps=128", "trainer.epochs=1", "trainer.eval_every=0", "trainer.eval_episodes=2",
                       "save_policy=false", "progress=false", "tracking.log_plots=false", *fakes.FAKE_LLM_OVERRIDES])
    seen: list[tuple[Candidate, TrainResult]] = []

    class Spy:
        @hookimpl
        def on_train_end(self, train, result):
            seen.append((train.candidate, result))

    summary = run_experiment(cfg, extra_plugins=(Spy(),))
    assert summary.failed == 0
    (candidate, result), = seen
    assert candidate.reward is not None and fakes.MARK in candidate.reward.source  # eureka's program trained
    assert result.metrics["ellm/queries"] >= 1 and result.metrics["ellm/goal_reward"] > 0  # and ELLM paid for goals
    assert any("Crafter" in str(c) for c in llm.calls)


@pytest.mark.slow
def test_end_to_end_minecraft_suggested_goals_earn_reward(tmp_path):
    """The embedded model suggests the goals; training pays for the ones the agent achieves."""
    cmd = [sys.executable, "-m", "core", "+plugins=[ellm]", "env=minecraft", "env.max_episode_steps=60",
           "plugins.ellm.queries_per_rollout=4", "trainer.frames=4096", "trainer.num_envs=8", "trainer.rollout_steps=64",
           "trainer.epochs=2", "trainer.eval_episodes=2",
           "trainer.eval_every=0", "progress=false", f"cache_dir={tmp_path / 'cache'}", "executor=inprocess"]
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (child,) = [r for r in runs if "it0-c0" in r.info.run_name]
    metrics = fakes.final_metrics(child.data.metrics)  # the counts at the end, not at the last rollout
    assert metrics["ellm/queries"] >= 1 and metrics["ellm/captions"] >= 1
    assert metrics["ellm/goal_reward"] > 0, metrics  # suggested goals earned reward in training
