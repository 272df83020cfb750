"""saycan: skill names, scores from first-token log-probabilities, the per-caption cache, the
scoring before training and at fixed points, the background scorer, failures, and the action
role in a real PPO training (the LLM's choice changes the actions; weight 0 changes none)."""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pluggy
import pytest
import torch

from core.context import ActionPrior
from core.envs.classic import CartPole, Pendulum
from core.errors import UserError
from core.hookspecs import PROJECT
from core.records import Candidate
from core.registry import make_plugin_manager
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, make_run, make_train, plugin_object
from core.train import ppo
from core.train.ppo import PPOConfig
from plugins import saycan

hookimpl = pluggy.HookimplMarker(PROJECT)

#: no scoring before training or at fixed points: the unit tests below add what they test
QUIET = {"prescore_episodes": 0, "rescore_at": []}


def prefer(letter: str, p: float = 0.9) -> ScriptedLLM:
    """An LLM whose first reply token is ``letter`` with probability ``p`` (the rest on the other letter)."""
    other = "A" if letter == "B" else "B"
    return ScriptedLLM(replies=[letter], logprobs=lambda messages: {letter: math.log(p), other: math.log(1 - p)})


def crafter():
    from core.envs.crafter import Crafter

    return Crafter()


def test_skill_names_come_from_the_action_description():
    assert saycan.skill_names(CartPole()) == ["pushes the cart to the left", "pushes it to the right (force 10 N)"]
    names = saycan.skill_names(crafter())
    assert len(names) == 17 and names[0] == "noop" and names[5] == "do" and names[-1] == "make iron sword"


def test_a_continuous_task_is_refused_up_front():
    with pytest.raises(UserError, match="named discrete actions"):
        plugin_object(saycan).on_run_start(make_run(Pendulum(), plugin="saycan", module=saycan))


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"rescore_at": [1.5]}, "fractions"),
        ({"batch": 0}, "batch"),
        ({"forget": ["("]}, "regular expression"),
        ({"prescore_calls": -1}, "prescore_calls"),
    ],
)
def test_bad_config_is_refused_with_the_key_named(bad, message):
    with pytest.raises(ValueError, match=message):
        saycan.Config(**bad).check()


def test_scores_from_logprobs_merge_tokens_and_floor_missing_letters():
    reply = type(
        "R",
        (),
        {"text": "A", "logprobs": {"A": math.log(0.5), " A": math.log(0.1), "C": math.log(0.2), "Z": math.log(0.1)}},
    )()
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


def scorer(llm, task=None, **overrides):
    task = task or CartPole()
    overrides = {**QUIET, **overrides}
    train = make_train(task, llm, plugin="saycan", module=saycan, overrides=overrides, config={"progress": False})
    plugin = plugin_object(saycan, **overrides)
    plugin.on_train_start(train)
    return plugin, train


def end(plugin, train) -> dict[str, float]:
    result = type("Result", (), {"metrics": {}})()
    plugin.on_train_end(train, result)
    return result.metrics


def test_blocking_scorer_caches_per_coarse_caption():
    llm = prefer("B")
    plugin, train = scorer(llm, blocking=True, forget=[r"cart_velocity: [-0-9.]+"])
    # the caption rounds to one decimal; the velocities differ, and the forgotten field goes
    obs = torch.tensor([[0.11, 0.5, 0.0, 0.0], [0.14, -0.7, 0.02, 0.0]])
    prior = plugin.action_prior(train, obs)
    assert isinstance(prior, ActionPrior) and prior.mask.all()
    assert prior.log_probs.exp()[:, 1].tolist() == pytest.approx([0.9, 0.9])
    assert len(llm.calls) == 1, "the second row's caption was the first's: one call serves both"
    assert llm.calls[0].top_logprobs == 20 and llm.calls[0].max_tokens == 1
    assert "cart_position: 0.1" in llm.calls[0].last and "cart_velocity" not in llm.calls[0].last
    plugin.action_prior(train, obs)
    assert len(llm.calls) == 1
    metrics = end(plugin, train)
    assert metrics["saycan/queries"] == 1 and metrics["saycan/covered"] == 1.0 and metrics["saycan/captions"] == 1
    assert metrics["llm/calls"] == 1 and metrics["llm/changed_share"] == 1.0
    assert "pushes it to the right" in train.texts["saycan/scores.md"]


def test_the_cache_is_the_runs_and_keyed_by_instruction():
    llm = prefer("B")
    plugin, train = scorer(llm, blocking=True)
    obs = torch.zeros(1, 4)
    plugin.action_prior(train, obs)
    end(plugin, train)
    second = make_train(
        CartPole(),
        llm,
        plugin="saycan",
        module=saycan,
        overrides={**QUIET, "blocking": True},
        config={"progress": False},
        seed=1,
    )
    plugin.on_train_start(second)
    assert plugin.action_prior(second, obs).mask.all()
    assert len(llm.calls) == 1, "another seed of the run reuses the first training's scores"
    other = plugin_object(saycan, **QUIET, blocking=True, instruction="Fall over.")
    other.cache = plugin.cache
    third = make_train(
        CartPole(),
        llm,
        plugin="saycan",
        module=saycan,
        overrides={**QUIET, "blocking": True, "instruction": "Fall over."},
        config={"progress": False},
    )
    other.on_train_start(third)
    other.action_prior(third, obs)
    assert len(llm.calls) == 2 and "Fall over." in llm.calls[1].last


def test_the_prior_masks_rows_whose_caption_is_not_scored():
    llm = prefer("A")
    plugin, train = scorer(llm, max_queries=0)  # no budget: only what the cache holds
    task = train.task
    known = np.array([0.0, 0.0, 0.0, 0.0], np.float32)
    plugin.cache[(task.goal, task.caption(known))] = np.log(np.array([0.9, 0.1]))
    prior = plugin.action_prior(train, torch.tensor(np.stack([known, known + 1.0])))
    assert prior.mask.tolist() == [True, False]
    assert prior.log_probs[1].tolist() == [0.0, 0.0] and prior.log_probs[0].exp()[0] == pytest.approx(0.9)
    metrics = end(plugin, train)
    assert metrics["saycan/covered"] == 0.5 and metrics["llm/changed_share"] == 0.5
    assert llm.calls == [] and metrics["saycan/captions"] == 2


def test_scoring_before_training_covers_most_steps_with_few_calls():
    """Crafter: the captions of random rollouts, most frequent first, cover most of a new
    random rollout's steps, with one call per distinct caption."""
    from core.envs.task import rollouts

    llm = ScriptedLLM.plausible()
    task = crafter()
    plugin, train = scorer(llm, task, prescore_episodes=4, prescore_steps=300, prescore_calls=12, max_queries=12)
    assert 0 < len(llm.calls) <= 12
    assert len({c.last for c in llm.calls}) == len(llm.calls), "one call per caption"
    steps = np.concatenate([t.obs for t in rollouts(task, None, 4, seed=7, max_steps=300)])
    for start in range(0, len(steps), 16):
        plugin.action_prior(train, torch.tensor(steps[start : start + 16]))
    metrics = end(plugin, train)
    assert metrics["saycan/prescore_covered"] >= 0.8, metrics
    assert metrics["saycan/covered"] >= 0.5, metrics
    assert metrics["llm/changed_share"] == metrics["saycan/covered"], "the fake's 'B' is not a uniform prior"
    assert metrics["llm/calls"] == len(llm.calls) and metrics["saycan/prescore_calls"] == len(llm.calls)


def test_most_frequent_captions_are_scored_first_within_the_budget():
    llm = prefer("A")
    plugin, train = scorer(llm)
    counts = Counter({"rare": 1, "common": 50, "middle": 7})
    figures = train.state["saycan"].score_blocking(counts, calls=2, seconds=0, what="test")
    assert [c.last.split("Current state:\n")[1].split("\n")[0] for c in llm.calls] == ["common", "middle"]
    assert figures["covered"] == pytest.approx(57 / 58) and figures["calls"] == 2


class Batched(ScriptedLLM):
    """A fake client with ``chat_many`` that, like the real one, records each call that
    landed and raises the first error of a batch; it can fail the captions holding ``fail``."""

    def __init__(self, fail: str = "", **kwargs):
        super().__init__(**kwargs)
        self.batches: list[int] = []
        self.fail = fail
        self.failed_calls = 0

    def chat(self, messages, **kwargs):
        if self.fail and self.fail in messages[-1]["content"]:
            self.failed_calls += 1
            raise RuntimeError("backend down")
        replies = super().chat(messages, **kwargs)
        self.records.append(SimpleNamespace(messages=messages, replies=replies))
        return replies

    def chat_many(self, calls):
        self.batches.append(len(calls))
        out, errors = [], []
        for call in calls:
            try:
                out.append(self.chat(**call))
            except RuntimeError as exc:
                errors.append(exc)
        if errors:
            raise errors[0]
        return out


def test_blocking_phases_send_batches_through_chat_many():
    llm = Batched(replies=["A"])
    plugin, train = scorer(llm, batch=3)
    figures = train.state["saycan"].score_blocking(Counter({f"s{i}": 10 - i for i in range(7)}), 7, 0, "test")
    assert llm.batches == [3, 3], "the first caption alone (it computes the shared prefix), then batches of 3"
    assert figures["scored"] == 7 and len(plugin.cache) == 7


def test_an_llm_error_costs_one_call_and_never_the_training():
    llm = Batched(fail="s1", replies=["B"])
    plugin, train = scorer(llm, batch=3)
    state = train.state["saycan"]
    figures = state.score_blocking(Counter({"s0": 5, "s1": 4, "s2": 3, "s3": 2}), 4, 0, "test")
    assert figures["scored"] == 3, "the batch's other captions were kept from the client's records"
    assert llm.failed_calls == 1 and len(llm.calls) == 3, "no caption asked twice"
    assert (train.task.goal, "s1") not in plugin.cache
    state.score(["s1"])  # the failed caption is not asked again in this training
    assert llm.failed_calls == 1 and state.calls == 4
    assert plugin.action_prior(train, torch.zeros(2, 4)) is None  # training goes on
    metrics = end(plugin, train)
    assert metrics["saycan/failures"] == 1
    assert "backend down" in train.texts["saycan/scores.md"]


def test_an_unusable_reply_costs_one_call():
    llm = ScriptedLLM(replies=["I would rather not say."])
    plugin, train = scorer(llm, blocking=True)
    obs = torch.zeros(3, 4)
    assert plugin.action_prior(train, obs) is None
    assert plugin.action_prior(train, obs) is None
    metrics = end(plugin, train)
    assert len(llm.calls) == 1 and metrics["saycan/failures"] == 1 and metrics["saycan/covered"] == 0.0
    assert "no skill letter" in train.texts["saycan/scores.md"]


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
    metrics = end(plugin, train)
    assert len(llm.calls) == 1 and metrics["llm/seconds"] >= 0.5


def test_rescoring_at_a_fixed_point_scores_the_agents_most_frequent_captions_blocking():
    llm = prefer("A")
    llm.delay_s = 0.05
    plugin, train = scorer(llm, rescore_at=[0.5], rescore_calls=1, queue_size=1, max_queries=2)
    train.state["saycan"].background.stop(2.0)  # only the rescoring point scores here
    frequent, rare = torch.zeros(3, 4), torch.ones(1, 4)
    plugin.action_prior(train, torch.cat([frequent, rare]))
    assert llm.calls == []
    train.frames = train.total_frames // 2
    prior = plugin.action_prior(train, torch.cat([frequent, rare]))  # the point is reached: scored before acting
    assert len(llm.calls) == 1 and prior.mask.tolist() == [True, True, True, False]
    assert "cart_position: 0.0" in llm.calls[0].last
    plugin.action_prior(train, frequent)
    assert len(llm.calls) == 1, "each point once"
    assert train.metrics["saycan/rescore_calls"][0][1] == 1.0


def test_max_queries_caps_the_llm_calls():
    llm = prefer("A")
    plugin, train = scorer(llm, blocking=True, max_queries=2)
    plugin.action_prior(train, torch.rand(5, 4) * 4)
    assert len(llm.calls) == 2


class Actions:
    """Records the actions collected in training."""

    def __init__(self) -> None:
        self.taken: list[torch.Tensor] = []

    @hookimpl
    def on_rollout(self, batch):
        self.taken.append(batch.get("action").reshape(-1).float())


def push_share(letter: str, weight: float = 3.0) -> tuple[float, dict[str, float]]:
    """Share of CartPole pushes to the right in a short PPO training under an LLM preferring ``letter``."""
    task = CartPole()
    overrides = {"blocking": True, "weight": weight, "max_queries": 100_000, "prescore_episodes": 2}
    llm = prefer(letter, 0.95)
    actions = Actions()
    train_ctx = make_train(task, llm, plugin="saycan", module=saycan, overrides=overrides, config={"progress": False})
    pm = make_plugin_manager(train_ctx.settings, {"saycan": saycan}, extra=(actions,))
    train_ctx.pluginmanager = pm  # and its hooks: the core calls each plugin's prior through it
    cfg = PPOConfig(
        frames=256, num_envs=4, rollout_steps=32, epochs=2, minibatch=64, hidden=[16], eval_every=0, eval_episodes=1
    )
    result = ppo.train(task, Candidate("c", 0), cfg, seed=0, hook=pm.hook, ctx=train_ctx)
    assert result.ok, result.error
    return float(torch.cat(actions.taken).mean()), result.metrics


def test_the_llms_choice_changes_the_actions_taken():
    right, metrics = push_share("B")
    left, _ = push_share("A")
    assert right > 0.8 and left < 0.2, (right, left)
    assert metrics["action_prior/rows"] == 1.0 and metrics["saycan/queries"] > 0
    assert metrics["saycan/covered"] == 1.0 and metrics["llm/changed_share"] == 1.0


def test_weight_zero_is_a_control_that_changes_no_step():
    share, metrics = push_share("B", weight=0.0)
    assert 0.2 < share < 0.8, share  # the policy's own pushes
    assert metrics["saycan/covered"] == 1.0 and metrics["saycan/queries"] > 0, "the same queries as the arm"
    assert metrics["llm/changed_share"] == 0.0 and metrics["action_prior/rows"] == 0.0


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model(tmp_path: Path):
    """``python -m core +plugins=[saycan] env=minecraft`` at a few frames: the embedded model scored
    rollout captions with its log-probabilities before training and the prior covered training steps."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = [
        "+plugins=[saycan]", "env=minecraft", "env.max_episode_steps=200",
        "trainer.frames=128", "trainer.num_envs=2", "trainer.rollout_steps=32", "trainer.epochs=1",
        "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess", "progress=false", "save_policy=false",
        "plugins.saycan.prescore_episodes=2", "plugins.saycan.prescore_steps=100", "plugins.saycan.prescore_calls=3",
        "plugins.saycan.max_queries=3", "plugins.saycan.rescore_at=[]",
    ]  # fmt: skip
    proc = run_cli(tmp_path, *args, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = child.data.metrics
    assert metrics["saycan/queries"] == 3 and metrics["saycan/failures"] == 0, metrics
    assert metrics["saycan/prescore_calls"] == 3 and metrics["saycan/covered"] > 0, metrics
    assert metrics["action_prior/rows"] > 0, metrics
    scores = Path(client.download_artifacts(child.info.run_id, "texts/saycan/scores.md", str(tmp_path)))
    assert "You see:" in scores.read_text() and "->" in scores.read_text()
