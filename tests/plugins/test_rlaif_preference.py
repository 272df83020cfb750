"""rlaif_preference: label parsing and votes, captions and pair choice, the reward model and its
agreement figures, the label cache across seeds, the held-out split, the control arm, the
online worker, the reward and its changed share, and end-to-end runs."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from tensordict import TensorDict

from core.context import StepBatch
from core.envs import make_task
from core.errors import UserError
from core.records import TrainResult
from core.resources import conf_dir
from core.testing import fakes
from core.testing.cli import run_cli
from core.testing.fakes import ScriptedLLM, plugin_object
from plugins import rlaif_preference as rp

torch.set_num_threads(1)  # as in training: small nets with 2 threads stall on a busy machine

#: a small offline dataset on CartPole (random policy, 2 x 64 steps)
SMALL = {"offline": {"envs": 2, "steps": 64}, "label_budget": 20, "epochs": 60}


def config(**overrides) -> rp.Config:
    """The plugin's validated config: defaults + ``overrides``."""
    return plugin_object(rp, **overrides).cfg


def logprob_llm(best: str, p: float = 0.8, bias: float = 0.0) -> ScriptedLLM:
    """A one-digit judge that prefers the text shown as ``best`` with probability ``p``
    and the first-shown text by ``bias`` (log-odds)."""

    def p_first_better(messages) -> float:
        first = messages[-1]["content"].split(" 1: ")[1].split("\n")[0]
        p_first = p if first == best else 1 - p
        return float(1 / (1 + np.exp(-(np.log(p_first / (1 - p_first)) + bias))))

    return ScriptedLLM(
        answer=lambda messages, tag: "1" if p_first_better(messages) >= 0.5 else "2",
        logprobs=lambda messages: {
            "1": float(np.log(p_first_better(messages))),
            "2": float(np.log(1 - p_first_better(messages))),
            "The": -9.0,
        },
    )


def make_ctx(llm: ScriptedLLM | None, seed: int = 0, **overrides):
    """A CartPole training context with this plugin's config (defaults + ``overrides``)."""
    return fakes.make_train(
        make_task({"name": "cartpole"}), llm, plugin=rp.NAME, module=rp, overrides=overrides, seed=seed
    )


def make_learner(llm: ScriptedLLM | None, **overrides) -> rp.PreferenceLearner:
    """A training's learner as ``on_train_start`` makes it, without starting any work."""
    ctx = make_ctx(llm, **overrides)
    return rp.PreferenceLearner(ctx, ctx.plugin_config(rp.NAME), rp.Labeller())


def never_called() -> ScriptedLLM:
    """An LLM that fails the test if asked anything."""
    return ScriptedLLM(answer=lambda messages, tag: pytest.fail("the LLM was called"))


def batch_of(task, obs: np.ndarray) -> StepBatch:
    t = torch.as_tensor(obs, dtype=torch.float32)
    n = len(t)
    return StepBatch(
        obs=t,
        action=torch.zeros(n),
        next_obs=t,
        env_reward=torch.zeros(n),
        reward=torch.ones(n),
        done=torch.zeros(n, dtype=torch.bool),
        task=task,
    )


def dataset_states(learner: rp.PreferenceLearner) -> np.ndarray:
    return np.concatenate([r.obs for r in learner.runs])


# -- parsing and labels ---------------------------------------------------------------------


@pytest.mark.parametrize("text, label", [
    ("Segment 1 balances longer. Answer: 1", 1.0),
    ("...\nAnswer: 2", 0.0),
    ("**Answer:** tie", 0.5),
    ("Answer: Segment 2", 0.0),
    ("Answer: Observation 2", 0.0),
    ("Answer: unknown", None),
    ("Answer: 1 ... on reflection, Answer: 2", 0.0),  # the last answer counts
    ("I cannot decide.", None),
    ("Therefore, the episode in Segment 2 makes more progress towards the goal.", 0.0),  # no answer line
    ("In both... Observation 1 shows more progress towards the goal.", 1.0),
    ("Neither segment makes more progress towards the goal.", 0.5),
    ("Therefore, the answer is: tie", 0.5),
    ("Answer: 2, tie or unknown | Reason: both fine", None),  # the template copied back
    ("Answer: 1 or 2", None),
    ("Answer: 2 | Reason: segment 2 survives, 1 or 2 more steps", 0.0),
])  # fmt: skip
def test_parse_label(text, label):
    assert rp.parse_label(text) == label


def test_logit_vote_cancels_an_additive_position_bias():
    t, bias = 1.0, 3.0
    sig = lambda x: 1 / (1 + np.exp(-x))  # noqa: E731
    assert rp.logit_vote([sig(t + bias), sig(t - bias)]) == pytest.approx(sig(t))
    assert rp.vote([sig(t + bias), sig(t - bias)]) < sig(t) - 0.1  # the plain mean shrinks it
    assert rp.logit_vote([1.0, None, 0.0]) == 0.5 and rp.logit_vote([None]) is None  # hard digits: the mean


def test_vote_accuracy_and_preferences():
    assert rp.vote([1.0, 0.0, None, 1.0]) == pytest.approx(2 / 3)
    assert rp.vote([None]) is None
    seg = lambda ret: rp.Segment(np.zeros((2, 4)), [0, 1], ret, False)  # noqa: E731
    assert rp.env_preference(seg(5.0), seg(2.0)) == 1.0 and rp.env_preference(seg(1.0), seg(1.0)) == 0.5
    assert rp.preference(0.0, 2.0) == 0.0
    acc, n = rp.label_accuracy([1.0, 0.0, 0.5, None, 1.0], [1.0, 1.0, 1.0, 0.0, 0.5])
    assert (acc, n) == (0.5, 2)


def test_digit_preference_reads_the_first_tokens_probabilities():
    reply = SimpleNamespace(text="1", logprobs={"1": np.log(0.6), "2": np.log(0.2), "The": np.log(0.2)})
    assert rp.digit_preference(reply) == pytest.approx(0.75)
    assert rp.digit_preference(SimpleNamespace(text="2", logprobs=None)) == 0.0  # no logprobs: the digit
    assert rp.digit_preference(SimpleNamespace(text=" 1\n", logprobs={})) == 1.0
    assert rp.digit_preference(SimpleNamespace(text="The", logprobs={"The": -0.01, "1": -12.0})) is None
    assert rp.digit_preference(SimpleNamespace(text="Answer: 1", logprobs=None)) is None
    # a greedy "2" whose reported log-probabilities favour "1": they are not this reply's, the digit counts
    assert rp.digit_preference(SimpleNamespace(text="2", logprobs={"1": np.log(0.7), "2": np.log(0.3)})) == 0.0


def test_swapped_votes_cancel_a_position_bias_and_are_flipped_back():
    biased = ScriptedLLM(["Answer: 1"])  # always picks the first shown
    cfg = config(judge="text", samples=2, swap=True)
    assert rp.Labeller().label(biased, cfg, "goal", [("A", "B")]) == [0.5]
    assert len(biased.calls) == 2  # one call per order
    assert all((c.n, c.temperature, c.max_tokens) == (1, 0.3, 40) for c in biased.calls)  # the YAML's defaults
    prefers_b = ScriptedLLM(
        answer=lambda messages, tag: "Answer: 2" if "Observation 2: B" in messages[-1]["content"] else "Answer: 1"
    )
    assert rp.Labeller().label(prefers_b, cfg, "goal", [("A", "B")]) == [0.0]


def test_logprob_judge_averages_both_orders_and_cancels_position_bias():
    llm = logprob_llm(best="B", p=0.8, bias=2.0)  # strongly favours whatever is shown first
    cfg = config(judge="logprobs", swap=True, top_logprobs=5)
    lab = rp.Labeller()
    (label,) = lab.label(llm, cfg, "goal", [("A", "B")])
    assert len(llm.calls) == 2 and all(c.max_tokens == 1 and c.top_logprobs == 5 for c in llm.calls)
    assert all(c.temperature == 0.0 and c.tag == "rlaif_preference/label" for c in llm.calls)
    assert "Observation 1: A" in llm.calls[0].last and "Which observation is better" in llm.calls[0].last
    assert label == pytest.approx(0.2)  # alone the bias wins in both orders; their mean log-odds removes it
    assert "P(1st better)" in lab.replies[0]
    assert rp.Labeller().label(logprob_llm(best="A", p=0.8), cfg, "goal", [("A", "B")]) == [pytest.approx(0.8)]


def test_pairs_of_a_batch_go_out_in_one_concurrent_request_where_the_client_can():
    llm = logprob_llm(best="A")
    batches: list[int] = []

    def chat_many(calls):
        batches.append(len(calls))
        return [llm.chat(**c) for c in calls]

    llm.chat_many = chat_many  # the real client's concurrent calls
    rp.Labeller().label(llm, config(), "goal", [("A", "B"), ("C", "A"), ("D", "E")])
    assert batches == [6]  # 3 pairs x both orders, at once


def test_a_failed_call_costs_its_pairs_label_only_and_is_not_cached():
    def flaky(messages, tag):
        if "Observation 1: bad" in messages[-1]["content"] or "Observation 2: bad" in messages[-1]["content"]:
            raise RuntimeError("backend down")
        return "1"

    lab = rp.Labeller()
    labels = lab.label(ScriptedLLM(answer=flaky), config(swap=False), "goal", [("bad", "x"), ("y", "z")])
    assert labels == [None, 1.0] and lab.failures == 1
    assert lab.lookup("goal", "bad", "x") == (False, None) and lab.lookup("goal", "z", "y") == (True, 0.0)
    assert "backend down" in lab.replies[0]


def test_label_cache_answers_repeats_and_reversed_pairs_without_the_llm():
    llm = ScriptedLLM(["1"])
    lab = rp.Labeller()
    cfg = config(swap=False)
    assert lab.label(llm, cfg, "goal", [("A", "B")]) == [1.0]
    assert lab.label(llm, cfg, "goal", [("A", "B"), ("B", "A")]) == [1.0, 0.0]
    assert len(llm.calls) == 1 and lab.cache_hits == 2


def test_label_preferences_hook_uses_the_runs_llm_and_its_own_cache():
    llm = ScriptedLLM(["2"])
    run = fakes.make_run(make_task({"name": "cartpole"}), llm, plugin=rp.NAME, module=rp, overrides={"swap": False})
    plugin = plugin_object(rp, swap=False)
    assert plugin.label_preferences(run=run, goal="g", pairs=[("x", "y")]) == [0.0]
    assert plugin.label_preferences(run=run, goal="g", pairs=[("y", "x")]) == [1.0]  # from the run's cache
    assert len(llm.calls) == 1
    other_run = plugin_object(rp, swap=False)  # another run's plugin object shares no labels
    assert other_run.label_preferences(run=run, goal="g", pairs=[("x", "y")]) == [0.0]
    assert len(llm.calls) == 2 and other_run.labeller is not plugin.labeller


def test_control_labels_are_ties_or_a_fair_coin_that_flips_with_the_order():
    assert rp.control_label("ties", 0, "a", "b") == 0.5
    coins = [rp.control_label("random", 0, f"a{i}", f"b{i}") for i in range(400)]
    assert set(coins) == {0.0, 1.0} and 0.4 < np.mean(coins) < 0.6
    assert all(rp.control_label("random", 0, f"b{i}", f"a{i}") == 1 - c for i, c in enumerate(coins))
    assert coins == [rp.control_label("random", 0, f"a{i}", f"b{i}") for i in range(400)]  # reproducible


# -- captions, items, pairs -------------------------------------------------------------------


def test_caption_words_keep_their_heading():
    assert rp.caption_words("You see: tree, cow. You have: wood. Low: food, drink.") == [
        "You see: tree",
        "You see: cow",
        "You have: wood",
        "Low: food",
        "Low: drink",
    ]
    assert rp.caption_words("cart_position: 0.1\npole_angle: -0.2") == ["cart_position: 0.1", "pole_angle: -0.2"]


def test_returns_so_far_restart_after_each_episode_end():
    ret, running = rp.returns_so_far(np.array([1.0, 1.0, 1.0, 2.0]), np.array([False, True, False, False]), start=3.0)
    assert ret.tolist() == [4.0, 5.0, 1.0, 3.0] and running == 3.0


def test_caption_items_group_states_with_their_mean_return_so_far():
    obs = np.arange(8, dtype=np.float32).reshape(4, 2)
    run = rp.Run(
        obs,
        np.zeros(4),
        np.ones(4),
        np.zeros(4, bool),
        np.zeros(4, bool),
        np.array([1.0, 2.0, 3.0, 4.0]),
        captions=["a", "b", "a", "a"],
    )
    items = {it.text: it for it in rp.make_items(None, [run], config())}
    assert items["a"].count == 3 and items["a"].truth == pytest.approx(8 / 3) and items["b"].truth == 2.0
    assert np.allclose(items["a"].obs, [[10 / 3, 13 / 3]]) and items["a"].captions == ["a"]


def test_pairs_cover_every_item_before_any_twice_and_never_repeat():
    items = [
        rp.Item(f"You see: {w}.", np.zeros((1, 2)), [f"You see: {w}."], 0.0, count=1 + i)
        for i, w in enumerate("abcdefghij")
    ]
    pairs = rp.choose_pairs(items, 5, random.Random(0))
    assert sorted(i for p in pairs for i in p) == list(range(10))  # 5 pairs: every item once
    every = rp.choose_pairs(items, 1000, random.Random(0))
    assert len(every) == 45 and len({frozenset(p) for p in every}) == 45  # all pairs, none twice, no self-pair
    taken = {(items[a].text, items[b].text) for a, b in every[:40]}
    rest = rp.choose_pairs(items, 1000, random.Random(1), taken={(b, a) for a, b in taken})  # either order counts
    assert {frozenset(p) for p in rest} == {frozenset(p) for p in every[40:]}


def test_a_partner_is_the_most_different_of_the_candidates():
    texts = [
        "You see: tree. You have: wood.",
        "You see: tree. You have: wood, sapling.",
        "You see: water. You have: stone.",
    ]
    items = [rp.Item(t, np.zeros((1, 1)), [t], 0.0, count=100 if i == 0 else 1) for i, t in enumerate(texts)]
    (pair,) = rp.choose_pairs(items, 1, random.Random(0), candidates=8)
    assert set(pair) == {0, 2}  # the frequent item first, with the one sharing no word


def test_offline_dataset_pairs_and_labels_are_the_same_for_every_training_seed():
    first, second = (make_learner(ScriptedLLM.plausible(), **SMALL) for _ in range(2))
    first.train.seed, second.train.seed = 0, 7
    first.offline()
    second.offline()
    assert [(p.a.text, p.b.text, p.label) for p in first.labelled] == [
        (p.a.text, p.b.text, p.label) for p in second.labelled
    ]


# -- the reward model and its figures ---------------------------------------------------------


def test_bt_loss_is_the_soft_label_cross_entropy():
    ra, rb, y = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.5])
    p = torch.sigmoid(ra - rb)
    expected = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    assert float(rp.bt_loss(ra, rb, y)) == pytest.approx(float(expected), rel=1e-5)


@pytest.mark.parametrize("hidden", [0, 16])
def test_reward_model_recovers_the_order_of_synthetic_preferences(hidden):
    rng = np.random.default_rng(0)
    true = lambda s: s[:, 0] - 0.5 * s[:, 1]  # noqa: E731 - the hidden per-step reward
    segs = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(160)]
    a, b = segs[:80], segs[80:]
    y = [float(true(x).sum() > true(z).sum()) for x, z in zip(a, b)]
    model = rp.RewardModel(3, members=3, hidden=hidden)
    loss = model.fit(a[:60], b[:60], y[:60], epochs=150)
    assert loss < 0.4
    held = [float(model.score(x) > model.score(z)) for x, z in zip(a[60:], b[60:])]
    assert np.mean([h == t for h, t in zip(held, y[60:])]) >= 0.8


@pytest.mark.parametrize("hidden", [0, 16])
def test_ties_leave_the_reward_model_exactly_zero(hidden):
    rng = np.random.default_rng(0)
    a, b = (
        [rng.normal(size=(1, 5)).astype(np.float32) for _ in range(20)],
        [rng.normal(size=(1, 5)).astype(np.float32) for _ in range(20)],
    )
    model = rp.RewardModel(5, members=2, hidden=hidden)
    model.fit(a, b, [0.5] * 20, epochs=50)
    assert np.all(model.reward(rng.normal(size=(30, 5))) == 0.0)


def test_agreement_counts_decided_labels_and_half_for_no_preference():
    diffs = np.array([1.0, -2.0, 0.5, 0.0, 3.0, -1.0])
    labels = [0.9, 0.8, 0.5, 1.0, None, 0.1]  # right, wrong, tie (skipped), no preference (half), unknown, right
    assert rp.agreement(diffs, labels) == (pytest.approx((1 + 0 + 0.5 + 1) / 4), 4)
    assert rp.agreement(np.array([1.0]), [0.5])[1] == 0  # nothing decided: nan, 0
    share, pairs = rp.truth_agreement(np.array([3.0, 2.0, 1.0, 1.0]), np.array([2.0, 1.0, 0.0, 5.0]))
    # pairs with different truths: (0,1) ok, (0,2) ok, (0,3) wrong, (1,2) ok, (1,3) wrong, (2,3) equal scores: half
    assert pairs == 6 and share == pytest.approx(3.5 / 6)


def word_items(rng: np.random.Generator, n: int) -> tuple[list[rp.Item], dict[str, float]]:
    """Crafter-like captions from a few words, each with a hidden value; an item's truth is its words' sum."""
    value = {
        "You see: tree": 0.5,
        "You see: cow": 0.3,
        "You see: zombie": -1.0,
        "You have: wood": 1.0,
        "You have: sapling": 0.4,
        "You have: stone": 2.0,
        "Low: food": -0.8,
        "Low: drink": -0.6,
    }
    words = list(value)
    out = []
    for _ in range(n):
        chosen = [w for w in words if rng.random() < 0.35]
        see = [w.split(": ")[1] for w in chosen if w.startswith("You see")] or ["only grass"]
        have = [w.split(": ")[1] for w in chosen if w.startswith("You have")] or ["nothing"]
        low = [w.split(": ")[1] for w in chosen if w.startswith("Low")]
        text = f"You see: {', '.join(see)}. You have: {', '.join(have)}." + (f" Low: {', '.join(low)}." if low else "")
        out.append(rp.Item(text, np.zeros((1, 2), np.float32), [text], sum(value[w] for w in chosen)))
    return out, value


def truth_judge(items: list[rp.Item]) -> ScriptedLLM:
    """A one-digit judge that prefers the item with the higher truth (P 0.9)."""
    truth = {it.text: it.truth for it in items}

    def p_first(messages) -> float:
        text = messages[-1]["content"]
        a, b = text.split("Observation 1: ")[1].split("\n\n")[0], text.split("Observation 2: ")[1].split("\n\n")[0]
        return 0.5 if truth[a] == truth[b] else 0.9 if truth[a] > truth[b] else 0.1

    return ScriptedLLM(
        answer=lambda m, tag: "1" if p_first(m) >= 0.5 else "2",
        logprobs=lambda m: {"1": float(np.log(p_first(m))), "2": float(np.log(1 - p_first(m)))},
    )


def test_a_reward_model_on_caption_words_generalises_to_held_out_pairs():
    """The figures the learner reports: agreement with held-out labels, with the ground truth."""
    rng = np.random.default_rng(0)
    items, _ = word_items(rng, 120)
    learner = make_learner(truth_judge(items), epochs=200)
    learner.runs = [
        rp.Run(
            np.zeros((len(items), 4), np.float32),
            np.zeros(len(items)),
            np.zeros(len(items)),
            np.zeros(len(items), bool),
            np.zeros(len(items), bool),
            np.zeros(len(items)),
            captions=[it.text for it in items],
        )
    ]
    chosen = rp.choose_pairs(items, 150, random.Random(0))
    learner.label_blocking([(items[a], items[b]) for a, b in chosen], "test")
    learner.fit(items)
    f = learner.figures
    assert f["preference/heldout_pairs"] >= 20 and f["preference/heldout_agreement"] > 0.8, f
    assert f["preference/truth_agreement"] > 0.8 and f["preference/truth_pairs"] > 1000, f
    held = [p for p in learner.labelled if p.heldout]
    assert len(held) == 30 and all(p.heldout == ((k + 1) % 5 == 0) for k, p in enumerate(learner.labelled))


def test_held_out_pairs_are_kept_out_of_the_fit(monkeypatch):
    seen = []
    fit = rp.RewardModel.fit

    def spy(self, a, b, y, *args):
        seen.append(list(y))
        return fit(self, a, b, y, *args)

    monkeypatch.setattr(rp.RewardModel, "fit", spy)
    learner = make_learner(None, heldout=0.5, epochs=5)
    items = [
        rp.Item(f"You see: {w}.", np.zeros((1, 4), np.float32), [f"You see: {w}."], float(i))
        for i, w in enumerate("abcdef")
    ]
    learner.runs = [
        rp.Run(
            np.zeros((6, 4), np.float32),
            np.zeros(6),
            np.zeros(6),
            np.zeros(6, bool),
            np.zeros(6, bool),
            np.zeros(6),
            captions=[it.text for it in items],
        )
    ]
    learner.add_labels(
        [(items[0], items[1]), (items[2], items[3]), (items[4], items[5]), (items[1], items[4])], [0.9, 0.2, 0.7, 0.4]
    )
    learner.fit(items)
    assert [p.heldout for p in learner.labelled] == [False, True, False, True]
    assert seen == [[0.9, 0.7]] and learner.figures["preference/heldout_pairs"] == 2


# -- offline training: cache across seeds, control, reward ------------------------------------


def test_labels_are_cached_on_the_plugin_and_reused_by_the_next_seed():
    llm = ScriptedLLM.plausible()
    plugin = plugin_object(rp, **SMALL)
    results = []
    for seed in (0, 1):
        ctx = make_ctx(llm, seed=seed, **SMALL)
        plugin.on_train_start(ctx)
        result = TrainResult(f"s{seed}", True)
        plugin.on_train_end(ctx, result)
        results.append(result.metrics)
    first, second = results
    assert first["llm/calls"] == 2 * first["preference/labels"] == 40 and len(llm.calls) == 40
    assert second["llm/calls"] == 0 and second["preference/labels"] == 20  # every label from the cache
    assert (
        plugin.labeller.cache_hits == 20 and second["preference/label_seconds"] < first["preference/label_seconds"] + 1
    )


@pytest.mark.parametrize("control", ["ties", "random"])
def test_the_control_labels_through_the_same_pipeline_without_the_llm(control):
    overrides = {**SMALL, "control": control}
    ctx = make_ctx(never_called(), **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    learner = ctx.state[rp.NAME]
    term = plugin.compute_reward(ctx, batch_of(ctx.task, dataset_states(learner)))
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    m = result.metrics
    assert m["llm/calls"] == 0 and m["llm/control"] == 1.0 and m["preference/labels"] == 20
    if control == "ties":  # the model learned nothing: r = 0, no term on any step
        assert m["preference/ties"] == 20 and torch.all(term == 0) and m["llm/changed_share"] == 0.0
        assert m["preference/term_spread"] == 0.0 and m["preference/label_margin"] == 0.0
        assert "preference/heldout_agreement" not in m  # no decided held-out label to agree with
    else:  # a model fitted to coin flips changes steps, and agrees with nothing
        assert m["preference/ties"] == 0 and m["llm/changed_share"] > 0 and "preference/heldout_agreement" in m


def test_informative_labels_change_the_reward_of_most_steps():
    ctx = make_ctx(ScriptedLLM.plausible(), **SMALL)
    plugin = plugin_object(rp, **SMALL)
    plugin.on_train_start(ctx)
    learner = ctx.state[rp.NAME]
    states = dataset_states(learner)
    term = plugin.compute_reward(ctx, batch_of(ctx.task, states))
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    m = result.metrics
    assert m["llm/calls"] == 40 and m["llm/control"] == 0.0 and m["llm/seconds"] >= 0
    assert m["preference/labels"] == 20 and m["preference/ties"] < 20
    assert m["llm/changed_share"] == pytest.approx(float((term != 0).float().mean())) and m["llm/changed_share"] > 0.5
    # the term is scale * (r - its mean over the dataset's states), r in the model's log-odds units
    feats = learner.features
    r = learner.model.reward(feats.of_captions([ctx.task.caption(o) for o in states]))
    assert torch.allclose(term, torch.as_tensor(0.1 * (r - r.mean()), dtype=torch.float32), atol=1e-5)
    assert m["preference/term_spread"] == pytest.approx(float(term.std(unbiased=False)), rel=1e-3)
    assert m["preference/term_spread"] > 0.01
    assert m["preference/label_margin"] > 0.1 and m["preference/r_spread"] > 0.1
    assert {"preference/rm_loss", "preference/truth_agreement", "preference/fit_agreement"} <= m.keys()


def test_threshold_and_replace_mode():
    overrides = {**SMALL, "mode": "replace", "scale": 1.0, "threshold": 0.0}
    ctx = make_ctx(ScriptedLLM.plausible(), **overrides)
    plugin = plugin_object(rp, **overrides)
    batch = batch_of(ctx.task, np.zeros((3, 4), np.float32))
    assert plugin.compute_reward(ctx, batch) is None  # before on_train_start: no learner, no term
    plugin.on_train_start(ctx)
    try:
        learner = ctx.state[rp.NAME]
        states = dataset_states(learner)
        out = plugin.compute_reward(ctx, batch_of(ctx.task, states))
        z = out + 1.0  # replace: the term is the thresholded z minus the reward so far (1)
        assert (z >= 0).all() and (z == 0).any() and (z > 0).any()
    finally:
        plugin.on_train_end(ctx, TrainResult("c", True))
    assert rp.NAME not in ctx.state


def test_labelling_stops_at_its_time_budget():
    llm = ScriptedLLM.plausible(delay_s=0.05)
    overrides = {**SMALL, "label_seconds": 0.3, "batch": 2}
    ctx = make_ctx(llm, **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    m = result.metrics
    assert 2 <= m["preference/labels"] < m["preference/pairs_planned"] == 20
    assert m["llm/seconds"] < 0.3 + 0.05 * 4 + 0.5 and m["llm/calls"] == 2 * m["preference/labels"]


def test_blocking_labelling_advances_a_progress_bar_per_batch(monkeypatch):
    updates: list[int] = []

    class Bar:
        def add_task(self, description, total):
            assert "labelling 20 pairs" in description and total == 20
            return 0

        def update(self, task, completed, info):
            updates.append(completed)

    class Shown:
        def __init__(self, enabled):
            self.enabled = enabled

        def __enter__(self):
            return Bar() if self.enabled else None

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(rp, "make_progress", Shown)
    learner = make_learner(ScriptedLLM.plausible(), **{**SMALL, "batch": 8})
    learner.offline()
    assert updates == [8, 16, 20]


@pytest.mark.parametrize("unit, features", [("segment", "caption"), ("segment", "obs"), ("caption", "obs")])
def test_the_other_units_and_features_train_a_model(unit, features):
    overrides = {**SMALL, "unit": unit, "features": features, "segment_len": 8}
    ctx = make_ctx(ScriptedLLM.plausible(), **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    learner = ctx.state[rp.NAME]
    assert learner.model is not None and len(learner.labelled) == 20
    kind = "Segment 1:" if unit == "segment" else "Observation 1:"
    assert all(kind in c.last for c in learner.train.llm.calls)
    term = plugin.compute_reward(ctx, batch_of(ctx.task, dataset_states(learner)))
    assert term.shape == (128,) and torch.isfinite(term).all()
    plugin.on_train_end(ctx, TrainResult("c", True))


# -- online (RL-VLM-F) -----------------------------------------------------------------------


def rollout(task, envs: int = 2, steps: int = 32, seed: int = 0) -> TensorDict:
    """A batch as the trainer hands it to ``on_rollout``: random CartPole steps, ``[envs, steps]``."""
    runs = rp.random_runs(task, envs, steps, seed)
    stack = lambda key: torch.as_tensor(np.stack([getattr(r, key) for r in runs]))  # noqa: E731
    nxt = TensorDict(
        {
            "observation": stack("obs"),
            "reward": stack("rew").float()[..., None],
            "env_reward": stack("rew").float()[..., None],
            "done": stack("done")[..., None],
            "terminated": stack("term")[..., None],
        },
        batch_size=[envs, steps],
    )
    return TensorDict({"action": stack("act"), "next": nxt}, batch_size=[envs, steps])


def test_online_labels_in_the_background_on_schedule_and_fits_when_they_land():
    overrides = {
        "labelling": "online",
        "label_every": 64,
        "pairs_per_query": 4,
        "label_budget": 8,
        "finish_s": 5.0,
        "heldout": 0.0,
        "epochs": 30,
    }
    llm = ScriptedLLM.plausible(delay_s=0.01)
    ctx = make_ctx(llm, **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    learner = ctx.state[rp.NAME]
    try:
        for k in range(6):
            ctx.frames = 64 * (k + 1)
            plugin.on_rollout(ctx, rollout(ctx.task, seed=k))
            deadline = time.time() + 5
            while not learner.background.idle() and time.time() < deadline:
                time.sleep(0.01)
        plugin.on_rollout(ctx, rollout(ctx.task, seed=9))  # drains the last labels and refits
        assert learner.requested == 8 and len(learner.labelled) == 8 and learner.model is not None
        assert len({(p.a.text, p.b.text) for p in learner.labelled}) == 8  # no pair asked twice
    finally:
        result = TrainResult("c", True)
        plugin.on_train_end(ctx, result)
    assert result.metrics["llm/calls"] == 16 and result.metrics["preference/labels"] == 8


def test_online_never_waits_for_the_llm():
    overrides = {"labelling": "online", "label_every": 64, "pairs_per_query": 2, "finish_s": 0.0}
    llm = ScriptedLLM.plausible(delay_s=0.5)
    ctx = make_ctx(llm, **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    start = time.perf_counter()
    for k in range(4):
        ctx.frames = 64 * (k + 1)
        plugin.on_rollout(ctx, rollout(ctx.task, seed=k))
    assert time.perf_counter() - start < 0.5 * 2 * 2  # less than one job's calls
    plugin.on_train_end(ctx, TrainResult("c", True))


def test_interleaved_trainings_keep_their_own_learners_and_share_the_runs_labeller():
    """One plugin object (one run), two trainings at once: their states and models stay apart."""
    overrides = {"labelling": "online", "label_every": 1, "finish_s": 0.0}
    plugin = plugin_object(rp, **overrides)
    first, second = make_ctx(ScriptedLLM.plausible(), **overrides), make_ctx(ScriptedLLM.plausible(), **overrides)
    plugin.on_train_start(first)
    plugin.on_train_start(second)
    try:
        a, b = first.state[rp.NAME], second.state[rp.NAME]
        assert a is not b and a.train is first and b.train is second
        assert a.labeller is b.labeller is plugin.labeller  # the label cache is the run's
        a.add_rollout(rollout(first.task))
        assert a.runs and not b.runs
    finally:
        plugin.on_train_end(first, TrainResult("a", True))
        plugin.on_train_end(second, TrainResult("b", True))
    assert not first.state and not second.state
    assert vars(plugin).keys() == {"cfg", "labeller"}


# -- config ----------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    ({"judge": "vibes"}, "judge must be one of 'logprobs', 'text', got 'vibes'"),
    ({"labelling": "later"}, "labelling must be one of"),
    ({"unit": "frame"}, "unit must be one of 'caption', 'segment'"),
    ({"control": "shuffle"}, "control must be null or one of 'ties', 'random'"),
    ({"mode": "multiply"}, "mode must be one of"),
    ({"heldout": 1.0}, "heldout must be in"),
    ({"samples": 0}, "samples must be >= 1"),
    ({"offline": {"steps": 0}}, "offline.envs and offline.steps must be >= 1"),
    ({"label_every": "often"}, "plugins.rlaif_preference.label_every"),
])  # fmt: skip
def test_bad_config_values_are_refused_before_any_work(overrides, message):
    with pytest.raises(UserError, match=message):
        make_ctx(ScriptedLLM(["1"]), **overrides)


def test_yaml_holds_the_schema_defaults():
    yaml = OmegaConf.to_container(OmegaConf.load(conf_dir() / "plugins" / "rlaif_preference.yaml"))
    assert yaml == dataclasses.asdict(rp.Config())
    assert (rp.Config().labelling, rp.Config().unit, rp.Config().control) == ("offline", "caption", None)


# -- end to end ------------------------------------------------------------------------------


def _run_preference(make_config, overrides):
    """One in-process run with this plugin on CartPole and a tiny PPO; (summary, recorder)."""
    from core.loop import run_experiment
    from core.testing.contract import PPO_TINY, SMOKE_BASE, Recorder

    recorder = Recorder()
    cfg = make_config(
        [
            "+plugins=[rlaif_preference]",
            "env=cartpole",
            "plugins.rlaif_preference.label_budget=12",
            "plugins.rlaif_preference.offline.envs=2",
            "plugins.rlaif_preference.offline.steps=64",
            "plugins.rlaif_preference.finish_s=5",
            *SMOKE_BASE,
            *PPO_TINY,
            *overrides,
        ]
    )
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def _spy(monkeypatch):
    """Records the labels each Bradley-Terry fit trains on, and the reward terms the learner adds to training."""
    seen: dict[str, list] = {"labels": [], "terms": []}
    loss, reward = rp.bt_loss, rp.PreferenceLearner.reward

    def bt_loss(score_a, score_b, label):
        seen["labels"].append(label.detach().clone())
        return loss(score_a, score_b, label)

    def learner_reward(self, batch):
        term = reward(self, batch)
        if term is not None:
            seen["terms"].append(term)
        return term

    monkeypatch.setattr(rp, "bt_loss", bt_loss)
    monkeypatch.setattr(rp.PreferenceLearner, "reward", learner_reward)
    return seen


def test_the_llms_labels_train_the_reward_model_and_its_reward_reaches_training(make_config, monkeypatch):
    """The shared fake LLM through the real client (:func:`fakes.install_fake_litellm`)
    answers each caption pair with one digit (:func:`fakes.preferred_observation`); asked in
    both orders, its labels are 0.85, 0.15 or 0.5 (a tie). They are the targets of the reward
    model's Bradley-Terry loss (offline, Motif: fitted before training), and the fitted
    model's reward changes the rewards PPO trains on."""
    llm = fakes.install_fake_litellm(monkeypatch)
    seen = _spy(monkeypatch)
    summary, recorder = _run_preference(make_config, [])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0 and summary.failed == 0, recorder.report()
    asked = [c for c in llm.calls if "Observation 1: " in c["messages"][-1]["content"]]
    assert len(asked) == 24 and result.metrics["preference/labels"] == 12 and result.metrics["llm/calls"] == 24
    targets = torch.cat(seen["labels"])
    allowed = torch.tensor([0.85, 0.15, 0.5])
    assert all(torch.isclose(t, allowed, atol=1e-4).any() for t in targets), targets  # the LLM's labels are the targets
    assert (torch.abs(targets - 0.5) > 0.1).any()
    assert seen["terms"] and any(bool(t.abs().sum() > 0) for t in seen["terms"])  # the model's reward reached training
    assert result.metrics["llm/changed_share"] > 0


def test_labels_the_llm_cannot_give_train_nothing_and_are_recorded(make_config, monkeypatch):
    """Failure handling (the fake LLM never answers with a label): every label is unknown
    and counted, no reward model is fitted, no term is added, the training itself
    succeeds, and the replies are recorded."""
    fakes.install_fake_litellm(monkeypatch, reply=lambda messages: "I cannot tell which one is better.")
    seen = _spy(monkeypatch)
    summary, recorder = _run_preference(
        make_config, ["plugins.rlaif_preference.judge=text", "plugins.rlaif_preference.samples=1"]
    )
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0, recorder.report()
    labels = result.metrics["preference/labels"]
    assert labels == 12 and result.metrics["preference/unknown"] == labels
    assert result.metrics["judge/rejected_replies"] >= labels and result.metrics["llm/changed_share"] == 0
    assert not seen["labels"] and not seen["terms"] and "preference/rm_loss" not in result.metrics
    assert "cannot tell" in result.texts["rlaif_preference/labels.md"]


def _artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path):
        out += _artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return out


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model_labels_captions(tmp_path: Path):
    """``python -m core +plugins=[rlaif_preference] env=minecraft`` with a small budget."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    args = [
        "+plugins=[rlaif_preference]", "env=minecraft", "env.max_episode_steps=300",
        "trainer.frames=2048", "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess",
        "progress=false",
        "save_policy=false", "plugins.rlaif_preference.label_budget=4", "plugins.rlaif_preference.offline.envs=2",
        "plugins.rlaif_preference.offline.steps=128",
    ]  # fmt: skip
    proc = run_cli(tmp_path, *args, env=env, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = fakes.final_metrics(child.data.metrics)  # the counts at the end, not at the last rollout
    assert metrics["preference/labels"] == 4 and metrics["judge/latency_llm_s"] > 0, metrics
    assert "llm/changed_share" in metrics and metrics["preference/label_seconds"] > 0
    artifacts = _artifact_paths(client, child.info.run_id)
    assert "texts/rlaif_preference/labels.md" in artifacts and "texts/llm_calls.md" in artifacts
    labels = Path(client.download_artifacts(child.info.run_id, "texts/rlaif_preference/labels.md", str(tmp_path)))
    assert "You see:" in labels.read_text()  # each label with its captions, votes and the LLM's replies
