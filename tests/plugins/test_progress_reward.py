"""progress_reward: prompt parsing, consensus and fallback, normalisation, weight schedule,
caching, distillation, the sparse guard, the async reward path, and an end-to-end run."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
from pathlib import Path

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
from plugins import progress_reward as pr

torch.set_num_threads(1)  # as in training: small nets with 2 threads stall on a busy machine
DEFAULTS = pr.Config()


def make_ctx(llm: ScriptedLLM, frames: int = 10_000, **overrides) -> TrainContext:
    """A CartPole training context with this plugin's config (defaults + ``overrides``)."""
    return fakes.make_train(make_task({"name": "cartpole"}), llm, plugin=pr.NAME, module=pr, overrides=overrides,
                            total_frames=frames)


def make_judge(llm: ScriptedLLM, **overrides) -> pr.ProgressJudge:
    """A training's judge as ``on_train_start`` makes it, without starting its worker."""
    ctx = make_ctx(llm, **overrides)
    return pr.ProgressJudge(ctx, ctx.plugin_config(pr.NAME))


def step_batch(task, obs: torch.Tensor, done: bool = False) -> StepBatch:
    B = obs.shape[0]
    return StepBatch(obs=obs, action=torch.zeros(B, dtype=torch.int64), next_obs=obs, env_reward=torch.ones(B),
                     reward=torch.ones(B), done=torch.full((B,), done), task=task)


def wait_for(cond, timeout: float = 5.0) -> None:
    end = time.time() + timeout
    while not cond() and time.time() < end:
        time.sleep(0.01)


# -- prompt and parsing ----------------------------------------------------------------------


@pytest.mark.parametrize("text, score, reason", [
    ("Score: 7 | Reason: the pole is upright", 7.0, "the pole is upright"),
    ("**Score:** 8/10\n**Reason:** close to the flag", 8.0, "close to the flag"),
    ("评分：6 理由：不错", 6.0, "不错"),
    ("Rating = 3", 3.0, ""),
    ("I would give it 4/10.", 4.0, ""),
    ("Score: 0 | Reason: nothing done", 1.0, "nothing done"),  # "no progress" is the lowest score
])  # fmt: skip
def test_parse_reply_accepts_the_format_and_its_variants(text, score, reason):
    got = pr.parse_reply(text)
    assert got is not None and got.score == score and got.reason == reason


@pytest.mark.parametrize("text", ["Score: 12", "Score: -1", "no idea", "Score: 3 ... no wait, Score: 8", ""])
def test_parse_reply_rejects_malformed_replies(text):
    assert pr.parse_reply(text) is None


def test_prompt_has_short_background_dimensions_state_and_format():
    background = pr.background_of("One. Two! Three? Four. Five.")
    assert background == "One. Two! Three?"
    messages = pr.build_prompt(background, ["closeness", "safety"], "x: 1.0", "0, 1")
    user = messages[-1]["content"]
    assert "- closeness\n- safety" in user and "x: 1.0" in user and "Recent actions: 0, 1" in user
    assert "Score: <integer 1-10> | Reason:" in user


# -- consensus and fallback -------------------------------------------------------------------


def test_consensus_median_and_agreement():
    assert pr.consensus([6, 7, 7], 3) == (7.0, 1.0)
    median, conf = pr.consensus([2, 7, 9], 3)
    assert median == 7.0 and conf == pytest.approx(1 / 3)
    assert pr.consensus([7, 7], 3)[1] == pytest.approx(2 / 3)  # a malformed sample lowers confidence
    assert pr.consensus([], 3)[1] == 0.0


def test_rule_score_ranks_the_return_so_far():
    assert pr.rule_score(10.0, []) == 5.5
    assert pr.rule_score(100.0, [1.0, 2.0, 3.0]) == 10.0
    assert pr.rule_score(0.0, [1.0, 2.0, 3.0]) == 1.0


def test_low_agreement_falls_back_to_the_rule_and_agreement_uses_the_median():
    task = make_task({"name": "cartpole"})
    agree = make_judge(ScriptedLLM(["Score: 8 | Reason: good"]))
    res = agree._evaluate(agree.train.llm, pr._Request(0, 0, np.zeros(4, np.float32), np.zeros(4), "", 5.0, 0))
    assert (res.source, res.score, res.reason) == ("llm", 8.0, "good") and agree.counts.fallbacks == 0
    split = make_judge(ScriptedLLM(["Score: 1", "Score: 9", "garbage"]))
    split.returns_seen.extend([1.0, 2.0, 3.0, 4.0])
    res = split._evaluate(split.train.llm, pr._Request(0, 0, np.zeros(4, np.float32), np.zeros(4), "", 2.5, 0))
    assert res.source == "rule" and res.score == pytest.approx(1 + 9 * 0.5)
    assert split.counts.fallbacks == 1 and split.counts.rejected == 1
    (call,) = split.train.llm.calls
    assert task.render_state(np.zeros(4)) in call.last
    assert (call.n, call.temperature, call.max_tokens, call.tag) == (3, 0.7, 40, "progress_reward/evaluate")


# -- normalisation, schedule, cache, distillation ----------------------------------------------


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
    assert z.normalize(np.array([mean]))[0] == pytest.approx(0.0)
    assert z.normalize(np.array([mean + np.sqrt(var)]))[0] == pytest.approx(1.0, rel=1e-6)


def test_stage_weights_follow_the_default_schedule():
    stages = DEFAULTS.stages
    table = [stages.early, stages.middle, stages.late]
    assert pr.stage_weights(0.0, stages.boundaries, table) == (0.5, 0.4, 0.1)
    assert pr.stage_weights(0.3, stages.boundaries, table) == (0.7, 0.25, 0.05)
    assert pr.stage_weights(0.95, stages.boundaries, table) == (0.9, 0.08, 0.02)
    assert pr.stage_weights(0.5, [0.1, 0.2], table) == (0.9, 0.08, 0.02)  # boundaries are configurable


def test_state_cache_reuses_scores_of_near_states_only():
    cache = pr.StateCache(radius=0.5)
    dist, _ = cache.query(np.zeros((1, 3)))
    assert np.isinf(dist[0])
    cache.add(np.zeros(3), 7.0)
    cache.add(np.full(3, 5.0), 2.0)
    dist, value = cache.query(np.array([[0.1, 0.0, 0.0], [3.0, 3.0, 3.0]]))
    assert dist[0] <= 0.5 and value[0] == 7.0
    assert dist[1] > 0.5


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
    again = counter.visit(np.array([[3.1, 3.2]]))
    assert again == pytest.approx([1 / np.sqrt(2)])


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


# -- the reward path -------------------------------------------------------------------------


def test_compute_reward_never_waits_for_a_slow_llm_and_uses_its_scores_later():
    llm = ScriptedLLM(["Score: 9 | Reason: great"], delay_s=0.5)
    ctx = make_ctx(llm, eval_every=1)
    plugin = plugin_object(pr, eval_every=1)
    task = ctx.task
    plugin.on_train_start(ctx)
    judge = ctx.state[pr.NAME]
    try:
        obs = torch.zeros(2, 4)
        t0 = time.perf_counter()
        out = plugin.compute_reward(ctx, step_batch(task, obs))
        assert time.perf_counter() - t0 < 0.2  # the call returned long before the LLM
        assert out.shape == (2,)
        wait_for(lambda: len(llm.calls) >= 1 and not judge.requests.qsize(), 3.0)
        time.sleep(0.7)
        plugin.compute_reward(ctx, step_batch(task, obs))  # drains the ring buffer
        assert judge.cache.values and judge.cache.values[0] == 9.0
        plugin.compute_reward(ctx, step_batch(task, obs))
        assert judge.counts.cache_hits >= 2  # the same state now comes from the cache
    finally:
        result = TrainResult("c", True)
        plugin.on_train_end(ctx, result)
    assert pr.NAME not in ctx.state  # the judge goes with its training
    assert result.metrics["judge/llm_calls"] >= 1 and result.metrics["judge/cache_hits"] >= 2
    assert "great" in ctx.texts["progress_reward/reasons.md"]


def test_interleaved_trainings_keep_their_own_judges():
    """One plugin object (one run), two trainings at once: nothing is shared between them."""
    plugin = plugin_object(pr, finish_s=0.0)
    first, second = make_ctx(ScriptedLLM(["Score: 3"]), finish_s=0.0), make_ctx(ScriptedLLM(["Score: 7"]), finish_s=0.0)
    plugin.on_train_start(first)
    plugin.on_train_start(second)
    try:
        assert first.state[pr.NAME] is not second.state[pr.NAME]
        for _ in range(3):
            plugin.compute_reward(first, step_batch(first.task, torch.zeros(2, 4)))
        plugin.compute_reward(second, step_batch(second.task, torch.zeros(1, 4)))
        assert first.state[pr.NAME].counts.steps == 3 and second.state[pr.NAME].counts.steps == 1
        assert first.state[pr.NAME].train is first and second.state[pr.NAME].train is second
    finally:
        plugin.on_train_end(first, TrainResult("a", True))
        plugin.on_train_end(second, TrainResult("b", True))
    assert not first.state and not second.state
    assert vars(plugin).keys() == {"cfg"}  # the plugin object itself keeps no training's state


def test_compute_reward_before_on_train_start_adds_nothing():
    ctx = make_ctx(ScriptedLLM(["Score: 5"]))
    assert plugin_object(pr).compute_reward(ctx, step_batch(ctx.task, torch.zeros(1, 4))) is None


def test_mixed_reward_blends_env_llm_and_exploration_with_the_stage_weights():
    judge = make_judge(ScriptedLLM(["Score: 5"]))
    task = judge.task
    obs = torch.zeros(1, 4)
    first = judge.reward(step_batch(task, obs))  # unknown progress: LLM term 0, bonus 1 (first visit)
    assert float(first[0]) == pytest.approx(0.5 * 1 + 0.1 * 1.0 - 1.0)
    judge.progress[:] = 8.0
    judge.z.mean, judge.z.var = 6.0, 4.0
    second = judge.reward(step_batch(task, obs))  # z = (8-6)/2 = 1; second visit: bonus 1/sqrt(2)
    assert float(second[0]) == pytest.approx(0.5 + 0.4 * 1.0 + 0.1 / np.sqrt(2) - 1.0, abs=1e-5)


def test_potential_shaping_uses_the_difference_of_potentials():
    judge = make_judge(ScriptedLLM(["Score: 5"]), shaping=True, gamma=0.9)
    task = judge.task
    judge.reward(step_batch(task, torch.zeros(1, 4)))
    judge.z.mean, judge.z.var = 5.0, 1.0
    judge.progress[:] = 6.0  # z = 1, previous potential 0
    out = judge.reward(step_batch(task, torch.zeros(1, 4)))
    assert float(out[0]) == pytest.approx(0.5 + 0.4 * (0.9 * 1.0 - 0.0) + 0.1 / np.sqrt(2) - 1.0, abs=1e-5)
    out = judge.reward(step_batch(task, torch.zeros(1, 4)))  # potential unchanged: 0.9*1 - 1
    assert float(out[0]) == pytest.approx(0.5 + 0.4 * (0.9 - 1.0) + 0.1 / np.sqrt(3) - 1.0, abs=1e-5)


def test_sparse_guard_moves_the_llm_weight_to_exploration_and_says_so():
    judge = make_judge(ScriptedLLM(["Score: 1"]))
    for _ in range(DEFAULTS.sparse.window):
        judge._sparse_guard(1.0)
    assert judge.sparse and any("scores were all <= 2;" in r for r in judge.reasons)
    assert judge.train.metrics["judge/sparse"][-1][1] == 1.0
    task = judge.task
    judge.reward(step_batch(task, torch.zeros(1, 4)))
    judge.progress[:] = 9.0
    out = judge.reward(step_batch(task, torch.zeros(1, 4)))  # LLM term ignored, bonus weighted 0.5
    assert float(out[0]) == pytest.approx(0.5 + 0.5 / np.sqrt(2) - 1.0, abs=1e-5)
    judge._sparse_guard(8.0)
    assert not judge.sparse


def test_distilled_evaluator_serves_states_near_judged_ones():
    judge = make_judge(ScriptedLLM(["Score: 5"]), eval_every=1, cache_radius=0.01, distill={"min_labels": 32})
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 4))
    for row in x:
        judge.labels.append((row, 6.0))
        judge.cache.add(row, 6.0)
    judge._maybe_distill()
    assert judge.distiller is not None
    judge._scale = np.ones(4)
    judge.reward(step_batch(judge.task, torch.as_tensor(x[:2] + 0.05, dtype=torch.float32)))
    assert judge.counts.distilled == 2
    assert judge.progress == pytest.approx([6.0, 6.0], abs=0.5)
    assert judge.metrics()["judge/latency_distilled_s"] < 0.05


# -- config ----------------------------------------------------------------------------------


def test_yaml_holds_the_schema_defaults():
    yaml = OmegaConf.to_container(OmegaConf.load(conf_dir() / "plugins" / "progress_reward.yaml"))
    assert yaml == dataclasses.asdict(pr.Config())


@pytest.mark.parametrize("overrides, message", [
    ({"samples": 0}, "samples must be >= 1"),
    ({"stages": {"early": [0.5, 0.5]}}, "stages.early must be three weights"),
    ({"confidence": 1.5}, "confidence must be in"),
    ({"eval_every": "often"}, "plugins.progress_reward.eval_every"),
])  # fmt: skip
def test_bad_config_values_are_refused_before_any_work(overrides, message):
    with pytest.raises(UserError, match=message):
        make_ctx(ScriptedLLM(["Score: 5"]), **overrides)


# -- end to end ------------------------------------------------------------------------------


def _artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out = []
    for item in client.list_artifacts(run_id, path):
        out += _artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return out


@pytest.mark.slow
def test_end_to_end_on_minecraft_with_the_embedded_model_logs_calls_latency_and_reasons(tmp_path: Path):
    """``python -m core +plugins=[progress_reward] env=minecraft`` with a small budget."""
    env = {**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"}
    cmd = [
        sys.executable, "-m", "core", "+plugins=[progress_reward]", "env=minecraft", "env.max_episode_steps=300",
        "trainer.frames=2048", "trainer.eval_episodes=1", "trainer.eval_every=0", "executor=inprocess", "progress=false",
        "save_policy=false", "plugins.progress_reward.samples=2", "plugins.progress_reward.finish_s=120",
        f"cache_dir={tmp_path / 'cache'}", f"tracking.uri=sqlite:///{tmp_path / 'mlflow.db'}",
        f"tracking.artifact_location={tmp_path / 'art'}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    (child,) = [r for r in client.search_runs([experiment.experiment_id]) if "mlflow.parentRunId" in r.data.tags]
    metrics = fakes.final_metrics(child.data.metrics)  # the judge's counts at the end, not at the last rollout
    assert metrics["judge/llm_calls"] >= 1, metrics
    assert "judge/cache_hits" in metrics and metrics["judge/latency_llm_s"] > 0
    artifacts = _artifact_paths(client, child.info.run_id)
    assert "texts/progress_reward/reasons.md" in artifacts and "texts/llm_calls.md" in artifacts
    reasons = Path(client.download_artifacts(child.info.run_id, "texts/progress_reward/reasons.md", str(tmp_path)))
    assert "Vitals:" in reasons.read_text()  # the Crafter state the judge saw


# -- end to end: the LLM's progress scores reach the reward PPO trains on -----------------------------------------


def _run_progress(make_config, overrides):
    """One in-process run with this plugin on CartPole and a tiny PPO; (summary, recorder)."""
    from contract import PPO_TINY, SMOKE_BASE, Recorder

    from core.loop import run_experiment

    recorder = Recorder()
    cfg = make_config(["+plugins=[progress_reward]", "env=cartpole", "plugins.progress_reward.finish_s=5",
                       *SMOKE_BASE, *PPO_TINY, *overrides])
    return run_experiment(cfg, extra_plugins=(recorder,)), recorder


def _spy_on_scores(monkeypatch):
    """Records, at each training step, the judged progress scores the mixed reward is computed from."""
    seen: list[float] = []
    reward = pr.ProgressJudge.reward

    def judge_reward(self, batch):
        out = reward(self, batch)
        known = self.progress[~np.isnan(self.progress)]
        seen.extend(float(x) for x in known)
        return out

    monkeypatch.setattr(pr.ProgressJudge, "reward", judge_reward)
    return seen


def test_the_llms_progress_scores_are_used_in_the_training_reward(make_config, monkeypatch):
    """Plumbing, not the model: the shared fake LLM through the real client
    (:func:`fakes.install_fake_litellm`) scores every state 7. Its scores, not the rule's
    fallback, are the progress the per-step reward is mixed from during training."""
    llm = fakes.install_fake_litellm(monkeypatch)
    seen = _spy_on_scores(monkeypatch)
    summary, recorder = _run_progress(make_config, [])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0 and summary.failed == 0, recorder.report()
    assert llm.count("Score: 7") >= 1 and result.metrics["judge/llm_calls"] >= 1
    assert result.metrics["judge/fallbacks"] == 0 and result.metrics["judge/sparse_fraction"] < 1.0
    assert seen and 7.0 in seen  # a score of the LLM was the progress of a training step
    assert result.metrics["judge/progress_mean"] == pytest.approx(7.0, abs=1.0)
    assert "Score" in llm.replies[0] and "**7.0** (llm;" in result.texts["progress_reward/reasons.md"]


def test_scores_the_llm_cannot_give_fall_back_to_the_rule_and_are_recorded(make_config, monkeypatch):
    """Failure handling (the fake LLM never writes a score): every evaluation is rejected
    and replaced by the rule's score, counted as a fallback and recorded; training succeeds."""
    fakes.install_fake_litellm(monkeypatch, reply=lambda messages: "The agent is doing something.")
    summary, recorder = _run_progress(make_config, [])
    ((_, result),) = recorder.trained
    assert result.ok and result.frames > 0, recorder.report()
    calls = result.metrics["judge/llm_calls"]
    assert calls >= 1 and result.metrics["judge/fallbacks"] == calls
    assert result.metrics["judge/rejected_replies"] >= calls
    assert "(rule;" in result.texts["progress_reward/reasons.md"] and "(llm;" not in result.texts["progress_reward/reasons.md"]
