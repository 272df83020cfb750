"""progress_reward: expected scores from log-probabilities, the median option, blocking scoring
before and during training, the rank-correlation check, the distilled per-step term, the
no-LLM control, the mixed reward, and end-to-end runs."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core.context import StepBatch, TrainContext
from core.envs import make_task
from core.envs.task import Trajectory
from core.errors import UserError
from core.llm.client import Reply
from core.records import TrainResult
from core.resources import conf_dir
from core.testing import fakes
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, plugin_object
from plugins import progress_reward as pr

torch.set_num_threads(1)  # as in training: small nets with 2 threads stall on a busy machine
DEFAULTS = pr.Config()
#: a small pre-training set: CartPole's 4 random and 4 controller episodes (500 steps: the
#: controller succeeds), 24 states scored
SMALL = {"reference": {"episodes": 4, "max_steps": 500, "states": 24}, "rounds": {"states": 6}}
LLM_OFF = {"stages": {"early": [0.5, 0.0, 0.1], "middle": [0.7, 0.0, 0.05], "late": [0.9, 0.0, 0.02]}}


def reply(text: str, logprobs: dict[str, float] | None = None) -> Reply:
    return Reply(
        text=text,
        prompt_tokens=0,
        completion_tokens=1,
        latency_s=0.0,
        cost=0.0,
        cached=False,
        model="x",
        logprobs=logprobs,
    )


def log(probs: dict[str, float]) -> dict[str, float]:
    return {k: math.log(v) for k, v in probs.items()}


def state_of(messages: list[dict[str, str]]) -> str:
    return messages[-1]["content"].split("Current state:", 1)[1]


def angle_digit(messages: list[dict[str, str]]) -> str:
    """A judge that can be checked: the more upright the pole, the higher the digit (CartPole)."""
    angle = float(re.search(r"pole_angle: (-?[\d.]+)", state_of(messages)).group(1))
    return str(int(np.clip(9 - abs(angle) / 0.21 * 9, 0, 9)))


def angle_llm(**kwargs) -> ScriptedLLM:
    """``angle_digit`` as the reply, with log-probabilities split between it and its neighbour."""

    def logprobs(messages):
        d = int(angle_digit(messages))
        return log({str(d): 0.6, str(max(0, d - 1)) if d else "1": 0.4})

    return ScriptedLLM(answer=lambda messages, tag: angle_digit(messages), logprobs=logprobs, **kwargs)


def make_ctx(llm: ScriptedLLM | None, frames: int = 10_000, task: str = "cartpole", **overrides) -> TrainContext:
    """A training context with this plugin's config (defaults + ``overrides``)."""
    return fakes.make_train(
        make_task({"name": task}), llm, plugin=pr.NAME, module=pr, overrides=overrides, total_frames=frames
    )


def make_judge(llm: ScriptedLLM | None, prepare: bool = False, **overrides) -> pr.ProgressJudge:
    """A training's judge as ``on_train_start`` makes it (``prepare``: and scores the reference states)."""
    ctx = make_ctx(llm, **overrides)
    judge = pr.ProgressJudge(ctx, ctx.plugin_config(pr.NAME))
    if prepare:
        judge.prepare()
    return judge


def step_batch(task, obs: torch.Tensor, done: bool = False) -> StepBatch:
    B = obs.shape[0]
    return StepBatch(
        obs=obs,
        action=torch.zeros(B, dtype=torch.int64),
        next_obs=obs,
        env_reward=torch.ones(B),
        reward=torch.ones(B),
        done=torch.full((B,), done),
        task=task,
    )


def cartpole_states(n: int, seed: int = 0) -> torch.Tensor:
    """States like training's: positions and angles within CartPole's limits."""
    rng = np.random.default_rng(seed)
    return torch.as_tensor(rng.uniform(-1, 1, (n, 4)) * [2.0, 1.5, 0.2, 1.5], dtype=torch.float32)


# -- reading a score --------------------------------------------------------------------------


def test_expected_score_is_the_mean_digit_under_the_first_token_probabilities():
    got = pr.expected_score(reply("3", log({"3": 0.5, "7": 0.3, " 7": 0.1, "x": 0.1})), min_mass=0.5)
    assert got.source == "logprobs"
    # digits 3 and 7 (" 7" is the same digit), renormalised over the digits: 1 + (3*.5 + 7*.4) / .9
    assert got.score == pytest.approx(1 + (3 * 0.5 + 7 * 0.4) / 0.9)
    assert got.probs == pytest.approx({3: 0.5 / 0.9, 7: 0.4 / 0.9})
    nine = pr.expected_score(reply("9", log({"9": 0.9, "8": 0.1})))
    assert nine.score == pytest.approx(1 + 0.9 * 9 + 0.1 * 8)  # the top of the scale is one token: 9 -> 10


def test_expected_score_falls_back_to_the_replied_digit_when_the_probabilities_do_not_fit():
    assert pr.expected_score(reply("6")).score == 7.0  # a backend without log-probabilities
    text = pr.expected_score(reply("6", log({"1": 0.7, "2": 0.3})))  # the reply is not their most likely digit
    assert (text.score, text.source) == (7.0, "text")
    low = pr.expected_score(reply("4", log({"4": 0.2, "a": 0.8})), min_mass=0.5)  # digits hold too little mass
    assert (low.score, low.source) == (5.0, "text")
    assert pr.expected_score(reply("no idea", log({"a": 0.9}))) is None
    assert pr.expected_score(reply("", None)) is None


@pytest.mark.parametrize("text, score, reason", [
    ("Score: 7 | Reason: the pole is upright", 7.0, "the pole is upright"),
    ("**Score:** 8/10\n**Reason:** close to the flag", 8.0, "close to the flag"),
    ("评分：6 理由：不错", 6.0, "不错"),
    ("I would give it 4/10.", 4.0, ""),
    ("Score: 0 | Reason: nothing done", 1.0, "nothing done"),  # "no progress" is the lowest score
])  # fmt: skip
def test_parse_reply_accepts_the_median_format_and_its_variants(text, score, reason):
    got = pr.parse_reply(text)
    assert got is not None and got.score == score and got.reason == reason


@pytest.mark.parametrize("text", ["Score: 12", "Score: -1", "no idea", "Score: 3 ... no wait, Score: 8", ""])
def test_parse_reply_rejects_malformed_replies(text):
    assert pr.parse_reply(text) is None


def test_prompts_have_short_background_dimensions_state_and_one_answer_format():
    background = pr.background_of("One. Two! Three? Four. Five.")
    assert background == "One. Two! Three?"
    digit = pr.build_prompt(background, ["closeness", "safety"], "x: 1.0")[-1]["content"]
    assert "- closeness\n- safety" in digit and "x: 1.0" in digit
    assert digit.endswith("Reply with a single digit from 0 (no progress) to 9 (the goal is fully achieved).")
    text = pr.build_prompt(background, ["closeness"], "x: 1.0", score="median")[-1]["content"]
    assert "Score: <integer 1-10> | Reason:" in text and "single digit" not in text


def test_consensus_and_rule_score():
    assert pr.consensus([6, 7, 7], 3) == (7.0, 1.0)
    median, conf = pr.consensus([2, 7, 9], 3)
    assert median == 7.0 and conf == pytest.approx(1 / 3)
    assert pr.consensus([7, 7], 3)[1] == pytest.approx(2 / 3)  # a malformed sample lowers confidence
    assert pr.rule_score(10.0, []) == 5.5
    assert pr.rule_score(100.0, [1.0, 2.0, 3.0]) == 10.0 and pr.rule_score(0.0, [1.0, 2.0, 3.0]) == 1.0


# -- rank correlation and the reference states --------------------------------------------------


def test_spearman_matches_scipy_with_ties_and_is_nan_when_undefined():
    from scipy.stats import spearmanr

    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 4, 50).astype(float), rng.normal(size=50)
    y[:25] += x[:25]
    assert pr.spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)
    assert pr.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert pr.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    assert math.isnan(pr.spearman([1, 1, 1], [1, 2, 3])) and math.isnan(pr.spearman([1, 2], [1, 2]))


def test_spread_order_is_a_permutation_whose_prefixes_cover_the_range():
    for n in (1, 5, 100, 1000):
        order = pr.spread_order(n)
        assert sorted(order.tolist()) == list(range(n))
    first = pr.spread_order(100)[:4].tolist()
    assert first == [0, 50, 25, 75]


def test_reference_states_are_taken_from_every_level_of_true_progress_in_turn():
    assert pr.levels_of(np.array([0.0, 2.0, np.nan, 2.0, 5.0])).tolist() == [0, 1, -1, 1, 2]
    many = pr.levels_of(np.arange(100.0), bins=4)
    assert sorted(set(many.tolist())) == [0, 1, 2, 3] and np.bincount(many).tolist() == [25, 25, 25, 25]
    # 90 states at progress 0, 10 at 1: the first picks alternate between the two levels
    truth = np.r_[np.zeros(90), np.ones(10)]
    time = np.r_[np.linspace(0, 1, 90), np.linspace(0, 1, 10)]
    order = pr.stratified_order(truth, time)
    assert sorted(order.tolist()) == list(range(100))
    assert truth[order[:20]].tolist() == [0.0, 1.0] * 10
    assert time[order[0]] == 0.0 and time[order[2]] == pytest.approx(0.5, abs=0.02)  # each level spread over time
    # no true progress (random episodes of a task with a controller): grouped by time instead, after the levels
    mixed = pr.stratified_order(np.r_[np.full(4, np.nan), [0.5, 1.0]], np.r_[0.1, 0.4, 0.6, 0.9, 0.5, 1.0])
    assert sorted(mixed.tolist()) == list(range(6)) and set(mixed[:2].tolist()) == {4, 5}


def _traj(task, obs: np.ndarray, source: str, success: bool, rewards: np.ndarray | None = None) -> Trajectory:
    T = len(obs)
    return Trajectory(
        obs=obs,
        action=np.zeros(T),
        next_obs=obs,
        env_reward=np.ones(T) if rewards is None else rewards,
        terminated=True,
        success=success,
        ground_truth=float(T),
        source=source,
    )


def test_reference_progress_is_defined_per_task():
    crafter = make_task({"name": "minecraft"})
    obs = np.zeros((3, crafter.obs_dim), np.float32)
    start = next(f.start for f in crafter.state_fields if f.name == "achievement_collect_wood")
    obs[1:, start] = 1
    obs[2, start + 1] = 1
    (got,), words = pr.reference_progress(crafter, [_traj(crafter, obs, "random", False)])
    assert got.tolist() == [0, 1, 2] and "achievements unlocked" in words

    cartpole = make_task({"name": "cartpole"})
    four = np.zeros((4, 4), np.float32)
    got, words = pr.reference_progress(
        cartpole, [_traj(cartpole, four, "random", False), _traj(cartpole, four, "controller", True)]
    )
    assert got[0] is None and got[1] == pytest.approx([0.25, 0.5, 0.75, 1.0]) and "controller" in words

    (got,), words = pr.reference_progress(
        cartpole, [_traj(cartpole, four[:3], "random", False, np.array([1.0, -2.0, 4.0]))]
    )
    assert got.tolist() == [1.0, -1.0, 3.0] and "return so far" in words


def test_reference_states_are_scored_before_training_and_checked_against_true_progress():
    """Crafter, a judge that reads the achievements count: its scores rank the states exactly
    as the true progress does (1.0); one that reads it backwards ranks them the other way."""

    def count(messages):
        return int(re.search(r"Achievements \((\d+)/22\)", state_of(messages)).group(1))

    small = {"reference": {"episodes": 4, "max_steps": 300, "states": 40}}
    up = make_judge(ScriptedLLM(answer=lambda m, t: str(min(9, count(m)))), task="minecraft", **small)
    rollouts = up.task.reference_trajectories(4, 0, 300)
    up.task.reference_trajectories = lambda *args, **kwargs: rollouts  # the same episodes for both judges
    up.prepare()
    ref = [lab for lab in up.labels if lab.origin == "reference"]
    assert len(ref) == 40 and len(up.train.llm.calls) == 40  # every chosen state was asked, before any step
    truths = [lab.truth for lab in ref]
    assert len(set(truths)) >= 2, "the random rollouts unlocked no achievement: the check has nothing to rank"
    assert up.quality["judge/rank_correlation"] == pytest.approx(1.0)
    assert up.quality["judge/rank_correlation"] == pytest.approx(pr.spearman([lab.score for lab in ref], truths))
    assert up.train.metrics["judge/rank_correlation"][0] == (0, pytest.approx(1.0))
    down = make_judge(ScriptedLLM(answer=lambda m, t: str(max(0, 9 - count(m)))), task="minecraft", **small)
    down.task.reference_trajectories = lambda *args, **kwargs: rollouts
    down.prepare()
    assert down.quality["judge/rank_correlation"] == pytest.approx(-1.0)
    assert "true progress (achievements unlocked so far in the episode)" in up.report()


def test_reference_scoring_asks_one_greedy_token_per_state_in_batches_with_a_fixed_seed():
    llm = angle_llm()
    judge = make_judge(llm, prepare=True, batch=5, **SMALL)
    assert len(llm.calls) == 24 and judge.counts.llm_calls == 24
    call = llm.calls[0]
    assert (call.n, call.temperature, call.max_tokens, call.top_logprobs, call.tag) == (
        1,
        0.0,
        1,
        20,
        "progress_reward/score",
    )
    assert {c.seed for c in llm.calls} == {
        DEFAULTS.reference.seed
    }  # the same for every training seed: cached across seeds
    assert all(lab.source == "logprobs" for lab in judge.labels)
    # the states cover the episodes' time: early and late states of the controller's 200-step episodes
    lengths = {lab.truth for lab in judge.labels if lab.truth == lab.truth}
    assert min(lengths) < 0.2 and max(lengths) > 0.8
    assert judge.quality["judge/reference_states"] == len([lab for lab in judge.labels if lab.truth == lab.truth])


def test_blocking_scoring_shows_a_progress_bar_per_batch(monkeypatch):
    from contextlib import contextmanager

    seen: list[tuple] = []

    class Bar:
        def add_task(self, description, total):
            seen.append(("add", description, total))
            return 0

        def update(self, task, advance, info):
            seen.append(("update", advance, info))

    @contextmanager
    def fake_progress(enabled=True):
        yield Bar() if enabled else None

    monkeypatch.setattr(pr, "make_progress", fake_progress)
    make_judge(angle_llm(), prepare=True, batch=10, **SMALL)
    assert seen[0] == ("add", "progress_reward: scoring reference states", 24)
    assert [a for kind, a, _ in seen[1:]] == [10, 10, 4] and seen[-1][2].startswith("24 calls, ")


def test_near_duplicate_states_are_scored_once():
    judge = make_judge(angle_llm(), **SMALL)
    judge._scale = np.ones(4)
    obs = np.zeros((5, 4))
    obs[3] = 3.0
    assert judge._choose(obs, np.arange(5), 5) == [0, 3] and judge.counts.duplicates == 3
    caption = make_judge(angle_llm(), dedupe="caption", **SMALL)
    caption._scale = np.ones(4)
    near = np.array([[0.01, 0, 0, 0], [0.02, 0, 0, 0], [0.5, 0, 0, 0]])  # the first two round to the same caption
    assert caption._choose(near, np.arange(3), 3) == [0, 2]
    none = make_judge(angle_llm(), dedupe="none", **SMALL)
    none._scale = np.ones(4)
    assert none._choose(obs, np.arange(5), 5) == [0, 1, 2, 3, 4]


def test_an_llm_failure_costs_one_state():
    def flaky(messages, tag):
        if "pole_angle: 0.0" in state_of(messages):
            raise RuntimeError("backend down")
        return angle_digit(messages)

    judge = make_judge(ScriptedLLM(answer=flaky), prepare=True, **SMALL)
    assert judge.counts.llm_errors >= 1
    assert len(judge.labels) == 24 - judge.counts.llm_errors and judge.distiller is not None
    assert "LLM error RuntimeError: backend down" in judge.report()


def test_median_mode_takes_three_samples_and_falls_back_to_the_rule_when_they_disagree():
    agree = make_judge(ScriptedLLM(["Score: 8 | Reason: good"]), score="median")
    label = agree._read(np.zeros(4), 0.0, agree.train.llm.chat([{"role": "user", "content": "q"}], n=3), "reference")
    assert (label.score, label.source) == (8.0, "llm") and "good" in label.detail
    split = make_judge(ScriptedLLM(["Score: 1", "Score: 9", "garbage"]), score="median")
    split.returns_seen = [1.0, 2.0, 3.0, 4.0]
    label = split._read(np.zeros(4), 2.5, split.train.llm.chat([{"role": "user", "content": "q"}], n=3), "agent")
    assert (label.source, label.score) == ("rule", pytest.approx(1 + 9 * 0.5))
    assert split.counts.fallbacks == 1 and split.counts.rejected == 1
    llm = ScriptedLLM(["Score: 6 | Reason: ok"])
    make_judge(llm, prepare=True, score="median", **SMALL)
    call = llm.calls[0]
    assert (call.n, call.temperature, call.max_tokens, call.stop) == (3, 0.7, 40, ["\n"])
    assert "Score: <integer 1-10>" in call.last


# -- the distilled term ----------------------------------------------------------------------------


def test_the_distilled_llm_term_is_nonzero_and_varied_on_nearly_every_step():
    """The regression this plugin had: a constant 0 LLM term. Here the evaluator, fitted on
    the LLM's scores of the reference states, scores every step's states differently."""
    plugin = plugin_object(pr, **SMALL)
    ctx = make_ctx(angle_llm(), **SMALL)
    plugin.on_train_start(ctx)
    judge = ctx.state[pr.NAME]
    assert judge.distiller is not None and judge.counts.llm_calls == 24  # scored before the first step
    held_out = np.concatenate([t.next_obs for t in ctx.task.reference_trajectories(2, seed=7, max_steps=40)])
    terms, angles = [], []
    for k in range(0, len(held_out) - 8, 8):  # states like training's, none of them scored by the LLM
        obs = torch.as_tensor(held_out[k : k + 8])
        out = plugin.compute_reward(ctx, step_batch(ctx.task, obs))
        assert out.shape == (8,)
        terms.append(judge.progress.copy())
        angles.append(np.abs(held_out[k : k + 8, 2]))
    steps = len(terms)
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    m = result.metrics
    assert m["llm/changed_share"] > 0.95 and m["judge/llm_term_std"] > 0.05
    assert m["judge/distilled"] == steps * 8 and m["llm/calls"] == m["judge/llm_calls"] == 24
    assert m["llm/seconds"] >= 0 and "judge/rank_correlation" in m
    scores = np.concatenate(terms)
    assert scores.std() > 0.2  # the evaluator's scores differ between states
    assert pr.spearman(-np.concatenate(angles), scores) > 0.5  # more upright poles score higher, as the LLM said


def test_rounds_score_the_agents_own_states_at_the_budget_points_and_refit():
    llm = angle_llm()
    judge = make_judge(llm, prepare=True, frames=1000, **SMALL)
    before = judge.distiller
    for k in range(10):
        judge.reward(step_batch(judge.task, cartpole_states(8, seed=100 + k)))
    judge.train.frames = 100  # 10 %: before the first round (0.15)
    judge.maybe_round()
    assert len(llm.calls) == 24
    judge.train.frames = 400  # past 0.15 and 0.35: one round for both
    judge.maybe_round()
    agent = [lab for lab in judge.labels if lab.origin == "agent"]
    assert len(agent) == 6 and len(llm.calls) == 30 and judge.distiller is not before
    assert all(lab.frames == 400 for lab in agent)
    judge.train.frames = 700
    judge.maybe_round()
    assert len(llm.calls) == 36
    judge.train.frames = 1000
    judge.maybe_round()  # no round left
    assert len(llm.calls) == 36 and judge.metrics()["judge/agent_labels"] == 12


def test_mixed_reward_blends_env_llm_and_exploration_with_the_stage_weights():
    judge = make_judge(angle_llm(), prepare=True, **SMALL)

    class Fixed:  # an evaluator that scores every state 8
        def predict(self, x):
            return np.full(len(x), 8.0), np.zeros(len(x))

    judge.distiller = Fixed()
    task, obs = judge.task, torch.full((1, 4), 7.0)  # far from every reference state: a first visit
    judge.z.mean, judge.z.var, judge.z.decay = 6.0, 4.0, 1.0  # decay 1: the statistics stay put
    first = judge.reward(step_batch(task, obs))  # z = (8-6)/2 = 1; bonus 1 (first visit)
    assert float(first[0]) == pytest.approx(0.5 * 1 + 0.4 * 1.0 + 0.1 * 1.0 - 1.0, abs=1e-5)
    second = judge.reward(step_batch(task, obs))  # second visit: bonus 1/sqrt(2)
    assert float(second[0]) == pytest.approx(0.5 + 0.4 + 0.1 / np.sqrt(2) - 1.0, abs=1e-5)


def test_potential_shaping_uses_the_difference_of_potentials():
    judge = make_judge(angle_llm(), prepare=True, shaping=True, gamma=0.9, **SMALL)

    class Fixed:
        def predict(self, x):
            return np.full(len(x), 6.0), np.zeros(len(x))

    judge.distiller = Fixed()
    judge.z.mean, judge.z.var, judge.z.decay = 5.0, 1.0, 1.0
    obs = torch.full((1, 4), 7.0)
    out = judge.reward(step_batch(judge.task, obs))  # z = 1, previous potential 0
    assert float(out[0]) == pytest.approx(0.5 + 0.4 * (0.9 * 1.0 - 0.0) + 0.1 - 1.0, abs=1e-5)
    out = judge.reward(step_batch(judge.task, obs))  # potential unchanged: 0.9*1 - 1
    assert float(out[0]) == pytest.approx(0.5 + 0.4 * (0.9 - 1.0) + 0.1 / np.sqrt(2) - 1.0, abs=1e-5)


def test_sparse_guard_moves_the_llm_weight_to_exploration_and_says_so():
    judge = make_judge(angle_llm(), prepare=True, **SMALL)
    judge.sparse = False
    for _ in range(DEFAULTS.sparse.window):
        judge._sparse_guard(1.0)
    assert judge.sparse and any("scores were all <= 2;" in r for r in judge.reasons)
    assert judge.train.metrics["judge/sparse"][-1][1] == 1.0
    obs = torch.full((1, 4), 7.0)
    out = judge.reward(step_batch(judge.task, obs))  # LLM term ignored, bonus weighted 0.5
    assert float(out[0]) == pytest.approx(0.5 + 0.5 - 1.0, abs=1e-5)
    assert judge.metrics()["llm/changed_share"] == 0.0
    judge._sparse_guard(8.0)
    assert not judge.sparse


# -- the no-LLM control ------------------------------------------------------------------------------


def test_the_control_makes_no_llm_call_and_its_llm_term_is_zero():
    """``progress_no_llm``: every stage's LLM weight 0. No call, the same blend without the LLM."""
    llm = angle_llm()
    plugin = plugin_object(pr, **SMALL, **LLM_OFF)
    ctx = make_ctx(llm, **SMALL, **LLM_OFF)
    plugin.on_train_start(ctx)
    judge = ctx.state[pr.NAME]
    with_llm = make_judge(angle_llm(), prepare=True, **SMALL)
    for k in range(5):
        obs = cartpole_states(4, seed=k)
        out = plugin.compute_reward(ctx, step_batch(ctx.task, obs))
        other = with_llm.reward(step_batch(ctx.task, obs))
        bonus = judge.novelty.counts[judge.novelty.slots(judge.features(obs.double().numpy()))]
        assert out.numpy() == pytest.approx(0.5 * 1 + 0.1 / np.sqrt(bonus) - 1.0, abs=1e-5)
        assert not np.allclose(out.numpy(), other.numpy())  # the LLM arm's reward differs on the same states
    ctx.frames = ctx.total_frames
    plugin.on_rollout(ctx)
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    assert llm.calls == []
    m = result.metrics
    assert m["llm/changed_share"] == 0.0 and m["llm/calls"] == 0 and m["judge/llm_term_std"] == 0.0
    assert "no LLM call was made" in ctx.texts["progress_reward/reasons.md"]


def test_the_control_needs_no_llm_but_the_method_does():
    ctx = make_ctx(None, **SMALL, **LLM_OFF)
    plugin_object(pr, **SMALL, **LLM_OFF).on_train_start(ctx)
    assert ctx.state[pr.NAME].llm_off
    with pytest.raises(UserError, match="progress_reward needs an LLM"):
        plugin_object(pr, **SMALL).on_train_start(make_ctx(None, **SMALL))


# -- per-training state ---------------------------------------------------------------------------


def test_interleaved_trainings_keep_their_own_judges():
    """One plugin object (one run), two trainings at once: nothing is shared between them."""
    plugin = plugin_object(pr, **SMALL)
    first, second = make_ctx(angle_llm(), **SMALL), make_ctx(angle_llm(), **SMALL)
    plugin.on_train_start(first)
    plugin.on_train_start(second)
    try:
        assert first.state[pr.NAME] is not second.state[pr.NAME]
        for _ in range(3):
            plugin.compute_reward(first, step_batch(first.task, cartpole_states(2)))
        plugin.compute_reward(second, step_batch(second.task, cartpole_states(1)))
        assert first.state[pr.NAME].counts.steps == 3 and second.state[pr.NAME].counts.steps == 1
        assert first.state[pr.NAME].train is first and second.state[pr.NAME].train is second
    finally:
        plugin.on_train_end(first, TrainResult("a", True))
        plugin.on_train_end(second, TrainResult("b", True))
    assert not first.state and not second.state
    assert vars(plugin).keys() == {"cfg"}  # the plugin object itself keeps no training's state


def test_compute_reward_before_on_train_start_adds_nothing():
    ctx = make_ctx(angle_llm())
    assert plugin_object(pr).compute_reward(ctx, step_batch(ctx.task, torch.zeros(1, 4))) is None


# -- building blocks -----------------------------------------------------------------------------------


def test_running_z_follows_the_ema_formula():
    z = pr.RunningZ(0.99, var0=1.0)
    xs = [5.0, 7.0, 3.0]
    mean, var = xs[0], 1.0
    for x in xs:
        z.update(x)
    for x in xs[1:]:
        mean = 0.99 * mean + 0.01 * x
        var = 0.99 * var + 0.01 * (x - mean) ** 2
    assert z.mean == pytest.approx(mean) and z.var == pytest.approx(var)
    assert z.normalize(np.array([mean + np.sqrt(var)]))[0] == pytest.approx(1.0, rel=1e-6)
    batch = pr.RunningZ(0.9)
    batch.update_batch(np.array([2.0, 4.0]))
    batch.update_batch(np.array([6.0, 8.0]))
    m = 0.9 * 3.0 + 0.1 * 7.0
    assert batch.mean == pytest.approx(m) and batch.var == pytest.approx(
        0.9 + 0.1 * np.mean((np.array([6.0, 8.0]) - m) ** 2)
    )


def test_stage_weights_follow_the_default_schedule():
    stages = DEFAULTS.stages
    table = [stages.early, stages.middle, stages.late]
    assert pr.stage_weights(0.0, stages.boundaries, table) == (0.5, 0.4, 0.1)
    assert pr.stage_weights(0.3, stages.boundaries, table) == (0.7, 0.25, 0.05)
    assert pr.stage_weights(0.95, stages.boundaries, table) == (0.9, 0.08, 0.02)


def test_state_cache_is_exact_between_rare_tree_rebuilds():
    from scipy.spatial import cKDTree

    rng = np.random.default_rng(0)
    cache = pr.StateCache(radius=0.5, rebuild_min=8)
    points = rng.normal(size=(200, 3))
    rebuilds = 0
    for k, p in enumerate(points):
        cache.add(p, float(k))
        before = cache._tree
        query = rng.normal(size=(4, 3))
        dist, value = cache.query(query)
        rebuilds += cache._tree is not before
        d_exact, i_exact = cKDTree(points[: k + 1]).query(query)
        assert np.allclose(dist, d_exact) and np.allclose(value, i_exact)
    assert rebuilds < 20  # not once per added state


def test_novelty_bonus_is_one_over_sqrt_visits_per_cell():
    counter = pr.NoveltyCounter(cell=0.5)
    first = counter.visit(np.array([[0.1, 0.1], [0.2, 0.3], [3.0, 3.0]]))  # the first two share a cell
    assert first == pytest.approx([1 / np.sqrt(2), 1 / np.sqrt(2), 1.0])
    assert counter.visit(np.array([[3.1, 3.2]])) == pytest.approx([1 / np.sqrt(2)])


def test_distiller_learns_a_score_and_is_unsure_far_away():
    rng = np.random.default_rng(0)
    x = rng.uniform(-1, 1, (128, 2))
    y = 5.5 + 4 * x[:, 0]
    model = pr.Distiller(2, hidden=32, members=3)
    model.fit(x, y, epochs=300)
    mean, std = model.predict(np.array([[0.5, 0.0], [-0.5, 0.0]]))
    assert abs(mean[0] - 7.5) < 0.7 and abs(mean[1] - 3.5) < 0.7
    _, far = model.predict(np.array([[30.0, -30.0]]))
    assert far[0] > std.max()


# -- config ----------------------------------------------------------------------------------


def test_yaml_holds_the_schema_defaults():
    yaml = OmegaConf.to_container(OmegaConf.load(conf_dir() / "plugins" / "progress_reward.yaml"))
    assert yaml == dataclasses.asdict(pr.Config())


@pytest.mark.parametrize("overrides, message", [
    ({"samples": 0}, "samples must be >= 1"),
    ({"score": "mean"}, "score must be one of expected, median"),
    ({"dedupe": "hash"}, "dedupe must be one of"),
    ({"top_logprobs": 40}, "top_logprobs must be in 1..20"),
    ({"rounds": {"at": [0.5, 0.2]}}, "rounds.at must be increasing"),
    ({"stages": {"early": [0.5, 0.5]}}, "stages.early must be three weights"),
    ({"confidence": 1.5}, "confidence and min_mass must be in"),
    ({"eval_every": "often"}, "plugins.progress_reward.eval_every"),
])  # fmt: skip
def test_bad_config_values_are_refused_before_any_work(overrides, message):
    with pytest.raises(UserError, match=message):
        make_ctx(angle_llm(), **overrides)


# -- end to end: the LLM's scores reach the reward PPO trains on -----------------------------------------


def _run_progress(make_config, overrides):
    """One in-process run with this plugin on CartPole and a tiny PPO; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import PPO_TINY, SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        [
            "+plugins=[progress_reward]",
            "env=cartpole",
            "plugins.progress_reward.reference.states=16",
            "plugins.progress_reward.reference.episodes=4",
            "plugins.progress_reward.rounds.states=4",
            *SMOKE_BASE,
            *PPO_TINY,
            *overrides,
        ]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def test_the_llms_scores_change_the_reward_of_nearly_every_training_step(make_config, monkeypatch):
    """Plumbing through the real client: the shared fake LLM answers each state with a digit
    of its own (:func:`fakes.progress_digit`); the distilled term changes nearly every step."""
    llm = fakes.install_fake_litellm(monkeypatch)
    summary, recorder = _run_progress(make_config, [])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0 and summary.failed == 0, recorder.report()
    m = result.metrics
    assert m["judge/llm_calls"] >= 16 + 4 and len(llm.calls) == m["judge/llm_calls"]
    assert all(c["max_tokens"] == 1 and c["logprobs"] for c in llm.calls)
    assert m["judge/agent_labels"] >= 4  # a round during training scored the agent's own states
    assert m["llm/changed_share"] > 0.9 and m["judge/llm_term_std"] > 0.01
    assert m["judge/progress_std"] > 0.5  # the fake's digits differ between states
    assert "(reference): **" in result.texts["progress_reward/reasons.md"]


def test_the_control_run_trains_without_the_llm(make_config, monkeypatch):
    llm = fakes.install_fake_litellm(monkeypatch)
    summary, recorder = _run_progress(
        make_config,
        [
            f"plugins.progress_reward.stages.{s}={w}"
            for s, w in (("early", "[0.5,0.0,0.1]"), ("middle", "[0.7,0.0,0.05]"), ("late", "[0.9,0.0,0.02]"))
        ],
    )
    ((_, result),) = recorder.trained
    assert result.ok and summary.failed == 0, recorder.report()
    assert llm.calls == [] and result.metrics["llm/changed_share"] == 0.0 and result.metrics["llm/calls"] == 0


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model_logs_calls_and_the_rank_correlation(tmp_path: Path):
    """``python -m core +plugins=[progress_reward] env=minecraft`` with a small budget."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = [
        "+plugins=[progress_reward]", "env=minecraft", "env.max_episode_steps=300",
        "trainer.frames=2048", "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess",
        "progress=false", "save_policy=false", "plugins.progress_reward.reference.episodes=2",
        "plugins.progress_reward.reference.states=6",
        "plugins.progress_reward.rounds.states=2", "plugins.progress_reward.rounds.at=[0.5]",
    ]  # fmt: skip
    proc = run_cli(tmp_path, *args, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = fakes.final_metrics(child.data.metrics)
    assert metrics["judge/llm_calls"] == 8, metrics
    assert metrics["llm/changed_share"] > 0.5 and "judge/rank_correlation" in metrics
    reasons = Path(client.download_artifacts(child.info.run_id, "texts/progress_reward/reasons.md", str(tmp_path)))
    assert "Vitals:" in reasons.read_text()  # the Crafter states the judge saw
