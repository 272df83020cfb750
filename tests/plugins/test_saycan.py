"""saycan: skill names, scores from first-token log-probabilities, the cache, the background
scorer, and the action role in a real PPO training (the LLM's choice changes the actions)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pluggy
import pytest
import torch

from core.context import ActionPrior
from core.envs.classic import CartPole, Pendulum
from core.errors import UserError
from core.hookspecs import PROJECT
from core.records import Candidate
from core.registry import make_plugin_manager
from core.train import ppo
from core.train.ppo import PPOConfig
from fakes import ScriptedLLM, make_run, make_train, plugin_object
from plugins import saycan

hookimpl = pluggy.HookimplMarker(PROJECT)


def prefer(letter: str, p: float = 0.9) -> ScriptedLLM:
    """An LLM whose first reply token is ``letter`` with probability ``p`` (the rest on the other letter)."""
    other = "A" if letter == "B" else "B"
    return ScriptedLLM(replies=[letter], logprobs=lambda messages: {letter: math.log(p), other: math.log(1 - p)})


def test_skill_names_come_from_the_action_description():
    assert saycan.skill_names(CartPole()) == ["pushes the cart to the left", "pushes it to the right (force 10 N)"]
    from core.envs.crafter import Crafter

    names = saycan.skill_names(Crafter())
    assert len(names) == 17 and names[0] == "noop" and names[5] == "do" and names[-1] == "make iron sword"


def test_a_continuous_task_is_refused_up_front():
    with pytest.raises(UserError, match="named discrete actions"):
        plugin_object(saycan).on_run_start(make_run(Pendulum(), plugin="saycan", module=saycan))


def test_scores_from_logprobs_merge_tokens_and_floor_missing_letters():
    reply = type("R", (), {"text": "A", "logprobs": {"A": math.log(0.5), " A": math.log(0.1), "C": math.log(0.2),
                                                    "Z": math.log(0.1)}})()
    scores = saycan.skill_scores(reply, 3, floor=-10.0, fallback_prob=0.8)
    probs = [math.exp(s) for s in scores]
    assert sum(probs) == pytest.approx(1.0)
    assert probs[0] == pytest.approx(0.6 / 0.8, rel=1e-3) and probs[2] == pytest.approx(0.2 / 0.8, rel=1e-3)
    assert probs[1] < 1e-4  # B was not among the alternatives: the floor


def test_scores_without_logprobs_fall_back_to_the_replied_letter():
    reply = type("R", (), {"text": "B.", "logprobs": None})()
    probs = [math.exp(s) for s in saycan.skill_scores(reply, 3, floor=-10.0, fallback_prob=0.8)]
    assert probs == pytest.approx([0.1, 0.8, 0.1])
    assert saycan.skill_scores(type("R", (), {"text": "no idea", "logprobs": None})(), 3, -10.0, 0.8) is None


def test_prompt_lists_the_skills_by_letter_before_the_state():
    messages = saycan.build_prompt("Balance the pole.", ["left", "right"], "angle: 0.1")
    text = messages[-1]["content"]
    assert "A. left\nB. right" in text and text.index("B. right") < text.index("angle: 0.1")


def scorer(llm: ScriptedLLM, **overrides):
    task = CartPole()
    train = make_train(task, llm, plugin="saycan", module=saycan, overrides=overrides)
    plugin = plugin_object(saycan, **overrides)
    plugin.on_train_start(train)
    return plugin, train


def test_blocking_scorer_covers_every_row_and_caches_per_state_text():
    llm = prefer("B")
    plugin, train = scorer(llm, blocking=True, forget=[r"cart_velocity: [-0-9.]+"])
    obs = torch.tensor([[0.1, 0.5, 0.0, 0.0], [0.1, -0.7, 0.0, 0.0]])  # differ only in the forgotten field
    prior = plugin.action_prior(train, obs)
    assert isinstance(prior, ActionPrior) and prior.mask.all()
    assert prior.log_probs.exp()[:, 1].tolist() == pytest.approx([0.9, 0.9])
    assert len(llm.calls) == 1, "the second row's state text was the first's: a cache hit"
    assert llm.calls[0].top_logprobs == 20 and llm.calls[0].max_tokens == 1
    plugin.action_prior(train, obs)
    assert len(llm.calls) == 1
    assert "cart_velocity: 0.5" not in llm.calls[0].last
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    assert result.metrics["saycan/queries"] == 1 and result.metrics["saycan/covered"] == 1.0
    assert "pushes it to the right" in train.texts["saycan/scores.md"]


def test_background_scorer_never_waits_and_covers_rows_once_scored():
    llm = prefer("A")
    llm.delay_s = 0.5
    plugin, train = scorer(llm)
    obs = torch.zeros(2, 4)
    start = time.perf_counter()
    assert plugin.action_prior(train, obs) is None  # nothing scored yet: no prior, no wait
    assert time.perf_counter() - start < 0.2
    deadline = time.time() + 10
    prior = None
    while prior is None and time.time() < deadline:
        time.sleep(0.05)
        prior = plugin.action_prior(train, obs)
    assert prior is not None and prior.log_probs.exp()[0, 0] == pytest.approx(0.9)
    plugin.on_train_end(train, type("Result", (), {"metrics": {}})())
    assert len(llm.calls) == 1


def test_max_queries_caps_the_llm_calls():
    llm = prefer("A")
    plugin, train = scorer(llm, blocking=True, max_queries=2)
    plugin.action_prior(train, torch.rand(5, 4))
    assert len(llm.calls) == 2


class Actions:
    """Records the actions collected in training."""

    def __init__(self) -> None:
        self.taken: list[torch.Tensor] = []

    @hookimpl
    def on_rollout(self, batch):
        self.taken.append(batch.get("action").reshape(-1).float())


def push_share(letter: str) -> tuple[float, dict[str, float]]:
    """Share of CartPole pushes to the right in a short PPO training under an LLM preferring ``letter``."""
    task = CartPole()
    overrides = {"blocking": True, "weight": 3.0, "max_queries": 100_000}
    llm = prefer(letter, 0.95)
    actions = Actions()
    train_ctx = make_train(task, llm, plugin="saycan", module=saycan, overrides=overrides)
    pm = make_plugin_manager(train_ctx.settings, {"saycan": saycan}, extra=(actions,))
    train_ctx.hook = pm.hook
    cfg = PPOConfig(frames=256, num_envs=4, rollout_steps=32, epochs=2, minibatch=64, hidden=[16], eval_every=0,
                    eval_episodes=1)
    result = ppo.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=train_ctx)
    assert result.ok, result.error
    return float(torch.cat(actions.taken).mean()), result.metrics


def test_the_llms_choice_changes_the_actions_taken():
    right, metrics = push_share("B")
    left, _ = push_share("A")
    assert right > 0.8 and left < 0.2, (right, left)
    assert metrics["action_prior/rows"] == 1.0 and metrics["saycan/queries"] > 0


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model(tmp_path: Path):
    """``python -m core +plugins=[saycan] env=minecraft`` at a few frames: the embedded model scored states
    with its log-probabilities and the prior covered training steps."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [
        sys.executable, "-m", "core", "+plugins=[saycan]", "env=minecraft", "env.max_episode_steps=200",
        "trainer.frames=128", "trainer.num_envs=2", "trainer.rollout_steps=32", "trainer.epochs=1",
        "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess", "progress=false", "save_policy=false",
        "plugins.saycan.blocking=true", "plugins.saycan.max_queries=3",
        f"cache_dir={tmp_path / 'cache'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifact_location={tmp_path / 'art'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = child.data.metrics
    assert metrics["saycan/queries"] == 3 and metrics["saycan/failures"] == 0, metrics
    assert metrics["action_prior/rows"] > 0, metrics
    scores = Path(client.download_artifacts(child.info.run_id, "texts/saycan/scores.md", str(tmp_path)))
    assert "Vitals:" in scores.read_text() and "->" in scores.read_text()
