"""rlaif_preference: label parsing, segments, the Bradley-Terry loss on synthetic preferences,
the label cache and hook, online scheduling, offline mode, the reward, and an end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

from core.envs import make_task
from core.records import Candidate, TrainResult
from core.resources import conf_dir
from core.context import StepBatch, TrainContext
from plugins import rlaif_preference as rp

torch.set_num_threads(1)  # as in training: small nets with 2 threads stall on a busy machine
DEFAULTS = OmegaConf.to_container(OmegaConf.load(conf_dir() / "plugins" / "rlaif_preference.yaml"))


class FakeLLM:
    """Replies from a list (cycled); counts calls. Replies carry no log-probabilities, so
    the logprobs judge reads their digit."""

    def __init__(self, texts: list[str], delay_s: float = 0.0) -> None:
        self.texts, self.delay_s, self.calls = texts, delay_s, 0

    def chat(self, messages, *, n=1, **_):
        self.calls += 1
        time.sleep(self.delay_s)
        return [SimpleNamespace(text=self.texts[i % len(self.texts)], cached=False) for i in range(n)]


class LogprobLLM:
    """A one-digit judge that prefers the segment containing ``best`` with probability
    ``p`` and the first-shown segment by ``bias`` (log-odds); records the calls' options."""

    def __init__(self, best: str, p: float = 0.8, bias: float = 0.0) -> None:
        self.best, self.p, self.bias, self.calls = best, p, bias, []

    def chat(self, messages, *, n=1, **options):
        self.calls.append(options)
        user = messages[-1]["content"]
        first = user.split("Segment 1: ")[1].split("\n")[0]
        p_first = self.p if first == self.best else 1 - self.p
        logit = float(np.log(p_first / (1 - p_first))) + self.bias
        p1 = 1 / (1 + np.exp(-logit))
        logprobs = {"1": float(np.log(p1)), "2": float(np.log(1 - p1)), "The": -9.0}
        return [SimpleNamespace(text="1" if p1 >= 0.5 else "2", cached=False, logprobs=logprobs)] * n


def make_ctx(llm, **overrides) -> TrainContext:
    cfg = {**DEFAULTS, **overrides}
    return TrainContext(task=make_task({"name": "cartpole"}), candidate=Candidate("c", 0),
                        config={"plugins": {"rlaif_preference": cfg}}, seed=0, total_frames=10_000,
                        llm_factory=lambda: llm)


@pytest.fixture(autouse=True)
def fresh_labeller(monkeypatch):
    monkeypatch.setattr(rp, "_LABELLER", rp.Labeller())


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
    biased = FakeLLM(["Answer: 1"])  # always picks the first shown
    cfg = rp.settings({**DEFAULTS, "judge": "text", "samples": 2, "swap": True})
    assert rp.Labeller().label(biased, cfg, "goal", [("A", "B")]) == [0.5]
    assert biased.calls == 2  # one call per order
    sure = rp.Labeller()
    llm = FakeLLM(["Answer: 2 | Reason: longer"])
    llm.chat = lambda messages, n=1, **_: [SimpleNamespace(  # noqa: E731 - prefers the segment "B"
        text="Answer: 2" if "Segment 2: B" in messages[-1]["content"] else "Answer: 1", cached=False)] * n
    assert sure.label(llm, cfg, "goal", [("A", "B")]) == [0.0]


def test_digit_preference_reads_the_first_tokens_probabilities():
    reply = SimpleNamespace(text="1", logprobs={"1": np.log(0.6), "2": np.log(0.2), "The": np.log(0.2)})
    assert rp.digit_preference(reply) == pytest.approx(0.75)
    assert rp.digit_preference(SimpleNamespace(text="2", logprobs=None)) == 0.0  # no logprobs: the digit
    assert rp.digit_preference(SimpleNamespace(text=" 1\n", logprobs={})) == 1.0
    assert rp.digit_preference(SimpleNamespace(text="The", logprobs={"The": -0.01, "1": -12.0})) is None
    assert rp.digit_preference(SimpleNamespace(text="Answer: 1", logprobs=None)) is None


def test_logprob_judge_averages_both_orders_and_cancels_position_bias():
    llm = LogprobLLM(best="B", p=0.8, bias=2.0)  # strongly favours whatever is shown first
    cfg = rp.settings({**DEFAULTS, "judge": "logprobs", "swap": True, "top_logprobs": 5})
    label, votes, texts = rp.Labeller().ask(llm, cfg, "goal", "A", "B")
    assert len(llm.calls) == 2 and all(c["max_tokens"] == 1 and c["top_logprobs"] == 5 for c in llm.calls)
    assert all(c["temperature"] == 0.0 for c in llm.calls)
    assert votes[0] > 0.5 and votes[1] < 0.5  # alone, the bias wins in both orders...
    assert label == pytest.approx(0.2)  # ...their mean log-odds removes it: B better with p=0.8
    assert "P(1st better)" in texts[0]
    unbiased = rp.Labeller().ask(LogprobLLM(best="A", p=0.8), cfg, "goal", "A", "B")[0]
    assert unbiased == pytest.approx(0.8)


def test_unknown_judge_is_an_actionable_error():
    with pytest.raises(ValueError, match="logprobs' or 'text'"):
        rp.Labeller().ask(FakeLLM(["1"]), {**DEFAULTS, "judge": "vibes"}, "goal", "A", "B")


def test_label_cache_answers_repeats_and_reversed_pairs_without_the_llm():
    llm = FakeLLM(["1"])
    lab = rp.Labeller()
    cfg = rp.settings({**DEFAULTS, "swap": False})
    assert lab.label(llm, cfg, "goal", [("A", "B")]) == [1.0]
    assert lab.label(llm, cfg, "goal", [("A", "B"), ("B", "A")]) == [1.0, 0.0]
    assert llm.calls == 1 and lab.cache_hits == 2


def test_label_preferences_hook_uses_the_runs_llm():
    llm = FakeLLM(["2"])
    run = SimpleNamespace(llm=llm, plugin_config=lambda name: {**DEFAULTS, "swap": False})
    assert rp.label_preferences(run=run, goal="g", pairs=[("x", "y")]) == [0.0]
    assert llm.calls == 1


# -- online / offline -----------------------------------------------------------------------


def _segments(n: int, ret=lambda i: float(i)) -> list[rp.Segment]:
    return [rp.Segment(np.full((4, 4), i / n, np.float32), [0] * 4, ret(i), False) for i in range(n)]


def test_online_requests_follow_the_schedule_and_budget_and_never_wait():
    learner = rp._learner_for(make_ctx(FakeLLM(["Answer: 1"]), label_every=100, pairs_per_query=2, label_budget=3))
    learner.pool = _segments(10)
    learner.train.frames = 50
    learner.maybe_request()
    assert learner.requested == 0
    for frames in (100, 200, 300, 400):
        learner.train.frames = frames
        learner.maybe_request()  # no worker runs: the queue fills up, and nothing blocks
    assert learner.requested == 3 and learner.jobs.qsize() == 2
    rp._LEARNERS.clear()


def test_labelling_fits_the_reward_model_and_logs_label_accuracy():
    ctx = make_ctx(FakeLLM(["1"]), min_pairs=2, swap=False)
    learner = rp._learner_for(ctx)
    learner.scale_obs = np.ones(4)
    segs = _segments(8)
    learner.label_and_fit([(segs[7], segs[0]), (segs[1], segs[6]), (segs[5], segs[2])])
    assert learner.model is not None
    out = learner.metrics()
    assert out["preference/labels"] == 3 and out["preference/label_accuracy"] == pytest.approx(2 / 3)
    reward = learner.reward(StepBatch(obs=torch.zeros(2, 4), action=torch.zeros(2), next_obs=torch.zeros(2, 4),
                                      env_reward=torch.ones(2), reward=torch.ones(2), done=torch.zeros(2, dtype=torch.bool),
                                      task=ctx.task))
    assert reward.shape == (2,) and torch.isfinite(reward).all()
    rp._LEARNERS.clear()


def test_reward_is_none_before_a_model_and_replace_mode_removes_the_reward():
    ctx = make_ctx(FakeLLM(["Answer: 1"]), mode="replace", scale=1.0, threshold=0.0)
    learner = rp._learner_for(ctx)
    batch = StepBatch(obs=torch.zeros(3, 4), action=torch.zeros(3), next_obs=torch.randn(3, 4),
                      env_reward=torch.ones(3), reward=torch.full((3,), 2.0), done=torch.zeros(3, dtype=torch.bool),
                      task=ctx.task)
    assert rp.compute_reward(ctx, batch) is None
    learner.model, learner.scale_obs = rp.RewardModel(4), np.ones(4)
    out = rp.compute_reward(ctx, batch)
    z = out + 2.0  # replace: the term is scale * thresholded z minus the reward so far
    assert (z >= 0).all()  # thresholded at 0
    rp._LEARNERS.clear()


def test_offline_mode_labels_a_random_dataset_before_training():
    llm = FakeLLM(["1", "2"])
    ctx = make_ctx(llm, labelling="offline", label_budget=6, min_pairs=2, offline={"envs": 2, "steps": 64})
    rp.on_train_start(ctx)
    learner = rp._LEARNERS[id(ctx)]
    assert learner.pool and llm.calls >= 1 and learner.model is not None
    result = TrainResult("c", True)
    rp.on_train_end(ctx, result)
    assert result.metrics["preference/labels"] == 6
    assert "Preference labels (6)" in ctx.texts["rlaif_preference/labels.md"]


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
    metrics = child.data.metrics
    assert metrics["judge/llm_calls"] >= 1 and metrics["preference/labels"] >= 1, metrics
    assert "judge/cache_hits" in metrics and metrics["judge/latency_llm_s"] > 0
    artifacts = _artifact_paths(client, child.info.run_id)
    assert "texts/rlaif_preference/labels.md" in artifacts and "texts/llm_calls.md" in artifacts
    labels = Path(client.download_artifacts(child.info.run_id, "texts/rlaif_preference/labels.md", str(tmp_path)))
    assert "votes" in labels.read_text()  # each label with its votes and the LLM's replies
