"""rlaif_preference: label parsing, segments, the Bradley-Terry loss on synthetic preferences,
the label cache and hook, online scheduling, offline mode, the reward, and an end-to-end run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import fakes
import numpy as np
import pytest
import torch
from fakes import ScriptedLLM, plugin_object
from omegaconf import OmegaConf

from core.context import StepBatch, TrainContext
from core.envs import make_task
from core.errors import UserError
from core.records import TrainResult
from core.resources import conf_dir
from plugins import rlaif_preference as rp

torch.set_num_threads(1)  # as in training: small nets with 2 threads stall on a busy machine


def config(**overrides) -> rp.Config:
    """The plugin's validated config: defaults + ``overrides``."""
    return plugin_object(rp, **overrides).cfg


def logprob_llm(best: str, p: float = 0.8, bias: float = 0.0) -> ScriptedLLM:
    """A one-digit judge that prefers the segment shown as ``best`` with probability ``p``
    and the first-shown segment by ``bias`` (log-odds)."""

    def p_first_better(messages) -> float:
        first = messages[-1]["content"].split("Segment 1: ")[1].split("\n")[0]
        p_first = p if first == best else 1 - p
        return float(1 / (1 + np.exp(-(np.log(p_first / (1 - p_first)) + bias))))

    return ScriptedLLM(answer=lambda messages, tag: "1" if p_first_better(messages) >= 0.5 else "2",
                       logprobs=lambda messages: {"1": float(np.log(p_first_better(messages))),
                                                  "2": float(np.log(1 - p_first_better(messages))), "The": -9.0})


def make_ctx(llm: ScriptedLLM, **overrides) -> TrainContext:
    """A CartPole training context with this plugin's config (defaults + ``overrides``)."""
    return fakes.make_train(make_task({"name": "cartpole"}), llm, plugin=rp.NAME, module=rp, overrides=overrides)


def make_learner(llm: ScriptedLLM, **overrides) -> rp.PreferenceLearner:
    """A training's learner as ``on_train_start`` makes it, without starting its worker."""
    ctx = make_ctx(llm, **overrides)
    return rp.PreferenceLearner(ctx, ctx.plugin_config(rp.NAME), rp.Labeller())


# -- parsing and labels ---------------------------------------------------------------------


@pytest.mark.parametrize("text, label", [
    ("Segment 1 balances longer. Answer: 1", 1.0),
    ("...\nAnswer: 2", 0.0),
    ("**Answer:** tie", 0.5),
    ("Answer: Segment 2", 0.0),
    ("Answer: unknown", None),
    ("Answer: 1 ... on reflection, Answer: 2", 0.0),  # the last answer counts
    ("I cannot decide.", None),
    ("Therefore, the episode in Segment 2 makes more progress towards the goal.", 0.0),  # no answer line
    ("In both... Segment 1 makes more progress towards the goal.", 1.0),
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


def test_vote_accuracy_and_env_preference():
    assert rp.vote([1.0, 0.0, None, 1.0]) == pytest.approx(2 / 3)
    assert rp.vote([None]) is None
    seg = lambda ret: rp.Segment(np.zeros((2, 4)), [0, 1], ret, False)  # noqa: E731
    assert rp.env_preference(seg(5.0), seg(2.0)) == 1.0 and rp.env_preference(seg(1.0), seg(1.0)) == 0.5
    acc, n = rp.label_accuracy([1.0, 0.0, 0.5, None, 1.0], [1.0, 1.0, 1.0, 0.0, 0.5])
    assert (acc, n) == (0.5, 2)


def test_split_segments_stays_within_episodes():
    T = 10
    obs = np.arange(T, dtype=np.float32)[:, None].repeat(4, 1)
    done = np.zeros(T, bool)
    done[2] = True  # an episode ends after 3 steps
    term = done.copy()
    segs = rp.split_segments(obs, np.zeros(T, np.int64), np.ones(T), term, done, length=4, min_len=3)
    assert [len(s.obs) for s in segs] == [3, 4, 3]
    assert segs[0].ended and not segs[1].ended and segs[0].env_return == 3.0
    short = rp.split_segments(obs, np.zeros(T, np.int64), np.ones(T), np.zeros(T, bool), done, length=4, min_len=4)
    assert [len(s.obs) for s in short] == [4]  # short pieces without a termination are dropped


class Undescribed:
    """CartPole's rendering without its plain-language account: the generic path."""

    def __init__(self) -> None:
        self.task = make_task({"name": "cartpole"})

    def describe_segment(self, obs, ended) -> str:
        return ""

    def __getattr__(self, name):
        return getattr(self.task, name)


def test_render_segment_shows_states_actions_and_end():
    task = Undescribed()
    seg = rp.Segment(np.zeros((3, 4), np.float32), [0, 1, 1], 3.0, True)
    text = rp.render_segment(task, seg)
    assert "End state" in text and "1 x2" in text and "ENDED" in text
    moving = np.zeros((3, 4), np.float32)
    moving[:, 2] = [0.0, 0.1, 0.2]  # the pole leans more and more
    text = rp.render_segment(task, rp.Segment(moving, [1, 1, 1], 3.0, False))
    assert "pole_angle 0 -> 0.2 rad (range 0 to 0.2)" in text and "still running" in text
    assert "cart_position" not in text.split("Changes:")[1]  # unchanged fields are left out


def test_render_segment_prefers_the_tasks_account():
    task = make_task({"name": "cartpole"})
    fell = rp.render_segment(task, rp.Segment(np.zeros((7, 4), np.float32), [0] * 7, 7.0, True))
    assert fell.startswith("The agent kept the pole up for 7 steps") and "failure" in fell


# -- Bradley-Terry --------------------------------------------------------------------------


def test_bt_loss_is_the_soft_label_cross_entropy():
    ra, rb, y = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 1.0]), torch.tensor([1.0, 0.5])
    p = torch.sigmoid(ra - rb)
    expected = -(y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
    assert float(rp.bt_loss(ra, rb, y)) == pytest.approx(float(expected), rel=1e-5)


def test_reward_model_recovers_the_order_of_synthetic_preferences():
    rng = np.random.default_rng(0)
    true = lambda s: s[:, 0] - 0.5 * s[:, 1]  # noqa: E731 - the hidden per-step reward
    segs = [rng.normal(size=(8, 3)).astype(np.float32) for _ in range(160)]
    a, b = segs[:80], segs[80:]
    y = [float(true(x).sum() > true(z).sum()) for x, z in zip(a, b)]
    model = rp.RewardModel(3, members=3, hidden=32)
    loss = model.fit(a[:60], b[:60], y[:60], epochs=150)
    assert loss < 0.4
    held = [float(model.reward(x).sum() > model.reward(z).sum()) for x, z in zip(a[60:], b[60:])]
    assert np.mean([h == t for h, t in zip(held, y[60:])]) >= 0.8


# -- labeller, cache, hook ------------------------------------------------------------------


def test_swapped_votes_cancel_a_position_bias_and_are_flipped_back():
    biased = ScriptedLLM(["Answer: 1"])  # always picks the first shown
    cfg = config(judge="text", samples=2, swap=True)
    assert rp.Labeller().label(biased, cfg, "goal", [("A", "B")]) == [0.5]
    assert len(biased.calls) == 2  # one call per order
    assert all((c.n, c.temperature, c.max_tokens) == (1, 0.3, 40) for c in biased.calls)  # the YAML's defaults
    prefers_b = ScriptedLLM(answer=lambda messages, tag: "Answer: 2" if "Segment 2: B" in messages[-1]["content"]
                            else "Answer: 1")
    assert rp.Labeller().label(prefers_b, cfg, "goal", [("A", "B")]) == [0.0]


def test_digit_preference_reads_the_first_tokens_probabilities():
    reply = SimpleNamespace(text="1", logprobs={"1": np.log(0.6), "2": np.log(0.2), "The": np.log(0.2)})
    assert rp.digit_preference(reply) == pytest.approx(0.75)
    assert rp.digit_preference(SimpleNamespace(text="2", logprobs=None)) == 0.0  # no logprobs: the digit
    assert rp.digit_preference(SimpleNamespace(text=" 1\n", logprobs={})) == 1.0
    assert rp.digit_preference(SimpleNamespace(text="The", logprobs={"The": -0.01, "1": -12.0})) is None
    assert rp.digit_preference(SimpleNamespace(text="Answer: 1", logprobs=None)) is None


def test_logprob_judge_averages_both_orders_and_cancels_position_bias():
    llm = logprob_llm(best="B", p=0.8, bias=2.0)  # strongly favours whatever is shown first
    cfg = config(judge="logprobs", swap=True, top_logprobs=5)
    label, votes, texts = rp.Labeller().ask(llm, cfg, "goal", "A", "B")
    assert len(llm.calls) == 2 and all(c.max_tokens == 1 and c.top_logprobs == 5 for c in llm.calls)
    assert all(c.temperature == 0.0 and c.tag == "rlaif_preference/label" for c in llm.calls)
    assert votes[0] > 0.5 and votes[1] < 0.5  # alone, the bias wins in both orders...
    assert label == pytest.approx(0.2)  # ...their mean log-odds removes it: B better with p=0.8
    assert "P(1st better)" in texts[0]
    unbiased = rp.Labeller().ask(logprob_llm(best="A", p=0.8), cfg, "goal", "A", "B")[0]
    assert unbiased == pytest.approx(0.8)


@pytest.mark.parametrize("overrides, message", [
    ({"judge": "vibes"}, "judge must be one of 'logprobs', 'text', got 'vibes'"),
    ({"labelling": "later"}, "labelling must be one of"),
    ({"mode": "multiply"}, "mode must be one of"),
    ({"samples": 0}, "samples must be >= 1"),
    ({"offline": {"steps": 0}}, "offline.envs and offline.steps must be >= 1"),
    ({"label_every": "often"}, "plugins.rlaif_preference.label_every"),
])  # fmt: skip
def test_bad_config_values_are_refused_before_any_work(overrides, message):
    with pytest.raises(UserError, match=message):
        make_ctx(ScriptedLLM(["1"]), **overrides)


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


# -- online / offline -----------------------------------------------------------------------


def _segments(n: int, ret=lambda i: float(i)) -> list[rp.Segment]:
    return [rp.Segment(np.full((4, 4), i / n, np.float32), [0] * 4, ret(i), False) for i in range(n)]


def test_online_requests_follow_the_schedule_and_budget_and_never_wait():
    learner = make_learner(ScriptedLLM(["Answer: 1"]), label_every=100, pairs_per_query=2, label_budget=3)
    learner.pool = _segments(10)
    learner.train.frames = 50
    learner.maybe_request()
    assert learner.requested == 0
    for frames in (100, 200, 300, 400):
        learner.train.frames = frames
        learner.maybe_request()  # no worker runs: the queue fills up, and nothing blocks
    assert learner.requested == 3 and learner.jobs.qsize() == 2


def test_labelling_fits_the_reward_model_and_logs_label_accuracy():
    learner = make_learner(ScriptedLLM(["1"]), min_pairs=2, swap=False)
    learner.scale_obs = np.ones(4)
    segs = _segments(8)
    learner.label_and_fit([(segs[7], segs[0]), (segs[1], segs[6]), (segs[5], segs[2])])
    assert learner.model is not None
    out = learner.metrics()
    assert out["preference/labels"] == 3 and out["preference/label_accuracy"] == pytest.approx(2 / 3)
    reward = learner.reward(StepBatch(obs=torch.zeros(2, 4), action=torch.zeros(2), next_obs=torch.zeros(2, 4),
                                      env_reward=torch.ones(2), reward=torch.ones(2), done=torch.zeros(2, dtype=torch.bool),
                                      task=learner.task))
    assert reward.shape == (2,) and torch.isfinite(reward).all()


def test_reward_is_none_before_a_model_and_replace_mode_removes_the_reward():
    overrides = {"mode": "replace", "scale": 1.0, "threshold": 0.0, "finish_s": 0.0}
    ctx = make_ctx(ScriptedLLM(["Answer: 1"]), **overrides)
    plugin = plugin_object(rp, **overrides)
    batch = StepBatch(obs=torch.zeros(3, 4), action=torch.zeros(3), next_obs=torch.randn(3, 4),
                      env_reward=torch.ones(3), reward=torch.full((3,), 2.0), done=torch.zeros(3, dtype=torch.bool),
                      task=ctx.task)
    assert plugin.compute_reward(ctx, batch) is None  # before on_train_start: no learner, no term
    plugin.on_train_start(ctx)
    try:
        learner = ctx.state[rp.NAME]
        assert plugin.compute_reward(ctx, batch) is None  # no reward model yet
        learner.model, learner.scale_obs = rp.RewardModel(4), np.ones(4)
        out = plugin.compute_reward(ctx, batch)
        z = out + 2.0  # replace: the term is scale * thresholded z minus the reward so far
        assert (z >= 0).all()  # thresholded at 0
    finally:
        plugin.on_train_end(ctx, TrainResult("c", True))
    assert rp.NAME not in ctx.state


def test_interleaved_trainings_keep_their_own_learners_and_share_the_runs_labeller():
    """One plugin object (one run), two trainings at once: their segments and models stay apart."""
    overrides = {"label_every": 1, "finish_s": 0.0}
    plugin = plugin_object(rp, **overrides)
    first, second = make_ctx(ScriptedLLM(["1"]), **overrides), make_ctx(ScriptedLLM(["2"]), **overrides)
    plugin.on_train_start(first)
    plugin.on_train_start(second)
    try:
        a, b = first.state[rp.NAME], second.state[rp.NAME]
        assert a is not b and a.train is first and b.train is second
        assert a.labeller is b.labeller is plugin.labeller  # the label cache is the run's
        a.pool = _segments(6)
        assert not b.pool
    finally:
        plugin.on_train_end(first, TrainResult("a", True))
        plugin.on_train_end(second, TrainResult("b", True))
    assert not first.state and not second.state
    assert vars(plugin).keys() == {"cfg", "labeller"}


def test_offline_mode_labels_a_random_dataset_before_training():
    llm = ScriptedLLM(["1", "2"])
    overrides = {"labelling": "offline", "label_budget": 6, "min_pairs": 2, "offline": {"envs": 2, "steps": 64}}
    ctx = make_ctx(llm, **overrides)
    plugin = plugin_object(rp, **overrides)
    plugin.on_train_start(ctx)
    learner = ctx.state[rp.NAME]
    assert learner.pool and len(llm.calls) >= 1 and learner.model is not None
    result = TrainResult("c", True)
    plugin.on_train_end(ctx, result)
    assert rp.NAME not in ctx.state
    assert result.metrics["preference/labels"] == 6
    assert "Preference labels (6)" in ctx.texts["rlaif_preference/labels.md"]


# -- config ----------------------------------------------------------------------------------


def test_yaml_holds_the_schema_defaults():
    yaml = OmegaConf.to_container(OmegaConf.load(conf_dir() / "plugins" / "rlaif_preference.yaml"))
    assert yaml == dataclasses.asdict(rp.Config())
    assert (rp.Config().max_tokens, rp.Config().finish_s) == (40, 30.0)  # once 96 and 2.0 in code, 40 and 30 in YAML


# -- end to end ------------------------------------------------------------------------------


def _artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path):
        out += _artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return out


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model_labels_segments(tmp_path: Path):
    """``python -m core +plugins=[rlaif_preference] env=minecraft`` with a small budget."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [
        sys.executable, "-m", "core", "+plugins=[rlaif_preference]", "env=minecraft", "env.max_episode_steps=300",
        "trainer.frames=2048", "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess", "progress=false",
        "save_policy=false", "plugins.rlaif_preference.label_every=256", "plugins.rlaif_preference.label_budget=2",
        "plugins.rlaif_preference.pairs_per_query=1", "plugins.rlaif_preference.finish_s=150",
        f"cache_dir={tmp_path / 'cache'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifact_location={tmp_path / 'art'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = fakes.final_metrics(child.data.metrics)  # the counts at the end, not at the last rollout
    assert metrics["judge/llm_calls"] >= 1 and metrics["preference/labels"] >= 1, metrics
    assert "judge/cache_hits" in metrics and metrics["judge/latency_llm_s"] > 0
    artifacts = _artifact_paths(client, child.info.run_id)
    assert "texts/rlaif_preference/labels.md" in artifacts and "texts/llm_calls.md" in artifacts
    labels = Path(client.download_artifacts(child.info.run_id, "texts/rlaif_preference/labels.md", str(tmp_path)))
    assert "votes" in labels.read_text()  # each label with its votes and the LLM's replies


# -- end to end: the LLM's labels train the reward model that trains the agent ------------------------------------


def _run_preference(make_config, overrides):
    """One in-process run with this plugin on CartPole and a tiny PPO; (summary, recorder)."""
    from contract import PPO_TINY, SMOKE_BASE, Recorder

    from core.loop import run_experiment

    recorder = Recorder()
    cfg = make_config(["+plugins=[rlaif_preference]", "env=cartpole", "plugins.rlaif_preference.label_every=256",
                       "plugins.rlaif_preference.label_budget=4", "plugins.rlaif_preference.segment_len=8",
                       "plugins.rlaif_preference.finish_s=5", *SMOKE_BASE, *PPO_TINY, *overrides])
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
    """Plumbing, not the model: the shared fake LLM through the real client
    (:func:`fakes.install_fake_litellm`) answers each pair with one digit whose
    log-probabilities give P("1") = 0.7 (``swap=false``: that is the label). The labels
    are the targets of the reward model's Bradley-Terry loss, and the fitted model's
    reward is added to the rewards PPO trains on. Offline labelling (Motif): the model is
    fitted before training, so every step gets its term; online, whether a label lands
    before a 1k-frame training ends depends on the machine's load."""
    llm = fakes.install_fake_litellm(monkeypatch)
    seen = _spy(monkeypatch)
    summary, recorder = _run_preference(make_config, ["plugins.rlaif_preference.swap=false",
                                                      "plugins.rlaif_preference.labelling=offline",
                                                      "plugins.rlaif_preference.offline.envs=2",
                                                      "plugins.rlaif_preference.offline.steps=64"])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0 and summary.failed == 0, recorder.report()
    asked = [c for c in llm.calls if "Segment 1" in c["messages"][-1]["content"]]
    assert len(asked) >= 2 and result.metrics["preference/labels"] >= 2
    targets = torch.cat(seen["labels"])
    assert len(targets) >= 2 and torch.allclose(targets, torch.tensor(0.7)), targets  # the LLM's labels are the loss's targets
    assert result.metrics["preference/rm_loss"] == result.metrics["preference/rm_loss"]  # a fit happened (not nan)
    assert seen["terms"] and any(bool(t.abs().sum() > 0) for t in seen["terms"])  # the model's reward reached training


def test_labels_the_llm_cannot_give_train_nothing_and_are_recorded(make_config, monkeypatch):
    """Failure handling (the fake LLM never answers with a label): every label is unknown
    and counted, no reward model is fitted, no term is added, the training itself
    succeeds, and the replies are recorded."""
    fakes.install_fake_litellm(monkeypatch, reply=lambda messages: "I cannot tell which one is better.")
    seen = _spy(monkeypatch)
    summary, recorder = _run_preference(make_config, ["plugins.rlaif_preference.judge=text",
                                                      "plugins.rlaif_preference.samples=1"])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0, recorder.report()
    labels = result.metrics["preference/labels"]
    assert labels >= 1 and result.metrics["preference/unknown"] == labels
    assert result.metrics["judge/rejected_replies"] >= labels
    assert not seen["labels"] and not seen["terms"] and "preference/rm_loss" not in result.metrics
    assert "cannot tell" in result.texts["rlaif_preference/labels.md"]
