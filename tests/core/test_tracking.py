"""MLflow tracking: the pages, names, times and metrics a person sees (core/tracking.py)."""

from __future__ import annotations

import json
import logging
import math
import time
from dataclasses import dataclass

import mlflow
import numpy as np
import pytest
from markdown_it import MarkdownIt
from omegaconf import open_dict

from core import run_page
from core.loop import run_experiment
from core.records import Candidate, CurvePoint, Fitness, IterationResult, RewardProgram, TrainResult
from core.tracking import (
    CANDIDATES_FILTER,
    EXPERIMENT_KIND,
    MAX_KEY_CHARS,
    NAMES_ARTIFACT,
    RENAMED_TAG,
    RESULT_TAG,
    RUNS_FILTER,
    RUNS_VIEW_KEY,
    VIEW_KEY,
    Tracker,
    candidate_metrics,
    format_llm_call,
    safe_key,
    valid_key,
)
from core.train.common import config_from, pearson
from core.train.ppo import PPOConfig


@dataclass
class _Reply:
    text: str
    cached: bool = False


@dataclass
class _Call:
    tag: str
    messages: list
    replies: list


def _headings(markdown: str) -> list[str]:
    tokens = MarkdownIt().parse(markdown)
    return [tokens[i + 1].content for i, t in enumerate(tokens) if t.type == "heading_open"]


def test_a_code_fence_in_a_prompt_cannot_swallow_the_next_heading():
    system = "Write a reward.\n```python\ndef compute_reward(s, a, n):\n    ...\n```\nand ```` this too"
    reply = "Here:\n```python\ndef compute_reward(s, a, n):\n    return 1.0\n```"
    call = _Call(
        "eureka",
        [{"role": "system", "content": system}, {"role": "user", "content": "Go.\nTwo lines."}],
        [_Reply(reply), _Reply("no code", cached=True)],
    )
    text = format_llm_call(call)
    assert _headings(text) == ["system", "user", "reply 0", "reply 1 (cached)"]
    blocks = [t.content for t in MarkdownIt().parse(text) if t.type == "fence"]
    assert blocks == [system + "\n", "Go.\nTwo lines.\n", reply + "\n", "no code\n"]  # every line kept


# -- metrics: one name per meaning, one value per step --------------------------------------


def _result(**kw) -> TrainResult:
    curve = [CurvePoint(256, 10.0, 12.0), CurvePoint(512, 30.0, 31.0)]
    series = {
        "charts/episodic_return": [(128, 9.0), (256, 11.0), (384, 20.0), (512, 25.0)],
        "losses/value_loss": [(512, 0.5)],
        "reward/env_correlation": [(512, 0.3)],
    }
    metrics = {
        "charts/episodic_return": 21.0,
        "losses/value_loss": 0.5,
        "reward/env_correlation": 0.3,
        "time/update_s": 1.5,
    }
    args = dict(
        candidate_id="it0-c0",
        ok=True,
        fitness=Fitness("return", 30.0),
        frames=512,
        seconds=3.0,
        curve=curve,
        series=series,
        metrics=metrics,
    )
    return TrainResult(**{**args, **kw})


def test_each_metric_has_one_value_per_step_and_summaries_their_own_names():
    points, summary = candidate_metrics(_result())
    steps = [(k, s) for k, _, s in points]
    assert len(steps) == len(set(steps)), "a metric got two values at one step"
    assert [(s, v) for k, v, s in points if k == "fitness"] == [(256, 10.0), (512, 30.0)]  # the final score once
    assert [(s, v) for k, v, s in points if k == "eval/return"] == [(256, 12.0), (512, 31.0)]
    assert [s for k, _, s in points if k == "charts/episodic_return"] == [128, 256, 384, 512]  # training episodes
    assert not any(k == "reward/env_correlation" for k, _, _ in points)  # a summary, never a series
    assert summary == {
        "frames": 512.0,
        "seconds": 3.0,
        "summary/charts/episodic_return": 21.0,
        "reward/env_correlation": 0.3,
        "time/update_s": 1.5,
    }


def test_a_final_score_no_evaluation_logged_is_added_once():
    points, _ = candidate_metrics(_result(curve=[]))
    assert [(k, v, s) for k, v, s in points if k == "fitness"] == [("fitness", 30.0, 512)]


def test_a_correlation_with_a_constant_signal_is_undefined():
    x = np.array([1.0, 2.0, 3.0])
    sums = lambda y: np.array([3, x.sum(), y.sum(), (x * x).sum(), (y * y).sum(), (x * y).sum()])  # noqa: E731
    assert math.isnan(pearson(sums(np.ones(3))))
    assert pearson(sums(2 * x)) == pytest.approx(1.0)


def test_eval_every_adapts_to_a_small_budget(caplog):
    with caplog.at_level(logging.WARNING):
        cfg = config_from(PPOConfig, {"frames": 2048, "eval_every": 25_000}, "ppo")
    assert cfg.eval_every == 512 and "evaluating every 512 frames" in caplog.text
    assert config_from(PPOConfig, {"frames": 100_000, "eval_every": 25_000}, "ppo").eval_every == 25_000
    assert config_from(PPOConfig, {"frames": 2048, "eval_every": 0}, "ppo").eval_every == 0  # 0: only at the end


# -- runs, names, times, pages ----------------------------------------------------------------


@pytest.fixture
def tracker(tmp_path):
    return Tracker(
        {"uri": f"sqlite:///{tmp_path / 'mlflow.db'}", "artifact_location": str(tmp_path / "art"), "log_plots": False},
        "pages",
    )


def test_candidate_runs_carry_their_parent_real_times_and_a_page(tracker, make_config):
    candidate = Candidate("it1-c0", 1, reward=RewardProgram(source="def compute_reward(s, a, n):\n    return 1.0\n"))
    constant = _result(metrics={"reward/env_correlation": float("nan")}, series={}, seconds=4.0)
    ended = time.time() - 60
    with tracker.experiment_run(make_config(["env=cartpole"]), "eureka-s0", {}):
        rid = tracker.log_candidate(candidate, constant, {}, ended=ended)
        iteration = IterationResult(1, [candidate], [constant])
        page = tracker.describe_run(
            task="CartPole-v1",
            fitness_name="return",
            history=[iteration],
            best=(candidate, constant),
            llm={},
            seconds=9.0,
        )
    client = mlflow.MlflowClient(tracker.uri)
    run = client.get_run(rid)
    assert run.info.run_name == "eureka-s0/it1-c0"
    assert run.info.end_time == int(ended * 1000) and run.info.end_time - run.info.start_time == 4000
    assert run.data.tags[run_page.WINNER_TAG] == "true"
    assert "**Winner of the run.**" in run.data.tags[run_page.NOTE_TAG]
    assert math.isnan(run.data.metrics["reward/env_correlation"])
    assert "constant" in run.data.tags["note.reward/env_correlation"]
    history = client.get_metric_history(rid, "fitness")
    assert [(m.step, m.value) for m in history] == [(256, 10.0), (512, 30.0)]
    parent = client.get_run(tracker.parent_id)
    assert parent.data.tags[run_page.NOTE_TAG] == page and "eureka-s0/it1-c0" in page
    assert parent.data.tags["llm4rl.winner_run"] == rid


def test_the_experiment_opens_as_model_training_with_a_candidates_view(tracker):
    tags = mlflow.MlflowClient(tracker.uri).get_experiment(tracker.experiment_id).tags
    assert tags[EXPERIMENT_KIND[0]] == "custom_model_development"
    view = json.loads(tags[f"mlflow.sharedViewState.{VIEW_KEY}"])
    state = json.loads(view["state"])
    assert state["orderByKey"] == "metrics.`fitness`" and "metrics.`fitness`" in state["selectedColumns"]
    assert (
        state["searchFilter"] == CANDIDATES_FILTER and "tags.`error`" in state["selectedColumns"]
    )  # candidates alone, why they failed
    runs = json.loads(json.loads(tags[f"mlflow.sharedViewState.{RUNS_VIEW_KEY}"])["state"])
    assert runs["searchFilter"] == RUNS_FILTER and f"tags.`{RESULT_TAG}`" in runs["selectedColumns"]
    assert tracker.ui_hint().startswith(f"python -m core.ui --uri {tracker.uri} --experiment ")  # it opens the view
    tracker.uri = "http://tracking.example:5000"
    assert f"viewStateShareKey={VIEW_KEY}" in tracker.ui_hint()  # a server's own address: the view's page


PROPOSER = '''
    """Proposes two constant rewards; the second scores the same, so the rule picks by order."""

    from core import PluginConfig, hookimpl
    from core.records import RewardProgram


    class Plugin:
        def __init__(self, config: PluginConfig) -> None:
            self.config = config

        @hookimpl
        def propose_rewards(self, run, iteration):
            good = "def compute_reward(state, action, next_state):\\n    return 1.0 - next_state['pole_angle'].abs()\\n"
            bad = "def compute_reward(state, action, next_state):\\n    return 1 / 0\\n"
            return [RewardProgram(source=good), RewardProgram(source=bad)]
'''


def test_a_run_explains_itself_on_its_parent_page(local_plugins, tiny_run):
    local_plugins("proposer", PROPOSER)
    cfg = tiny_run("save_policy=false", "trainer.eval_every=256")
    with open_dict(cfg):
        cfg.plugins = {"proposer": {}}
    summary = run_experiment(cfg)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    page = parent.data.tags[run_page.NOTE_TAG]
    name = parent.info.run_name
    assert f"**`{name}/it0-c0`** (winner)" in page and f"`{name}/it0-c1`" in page
    (failed,) = [line for line in page.splitlines() if f"`{name}/it0-c1`" in line]
    assert (
        "| exception: ZeroDivisionError |" in failed or "| timeout |" in failed
    )  # a loaded machine may time out first
    assert "```python\ndef compute_reward(state, action, next_state):" in page
    children = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'")
    by_name = {c.info.run_name: c for c in children}
    assert set(by_name) == {f"{name}/it0-c0", f"{name}/it0-c1"}
    winner = by_name[f"{name}/it0-c0"]
    assert (
        winner.data.tags[run_page.WINNER_TAG] == "true"
        and by_name[f"{name}/it0-c1"].data.tags[run_page.WINNER_TAG] == "false"
    )
    seconds = winner.data.metrics["seconds"]
    # the metric is rounded to 0.1 s (a table reads 3.2, not 3.2165479)
    assert abs((winner.info.end_time - winner.info.start_time) / 1000 - seconds) <= 0.051 and seconds > 0.05
    assert seconds == round(seconds, 1)
    assert [m.step for m in client.get_metric_history(winner.info.run_id, "fitness")] == [256, 512]
    returns = [m.value for m in client.get_metric_history(winner.info.run_id, "charts/episodic_return")]
    assert returns and all(v == round(v, 2) for v in returns)
    # the kinds of run are told apart, by the filters the saved views use
    experiment = [parent.info.experiment_id]
    assert [r.info.run_id for r in client.search_runs(experiment, RUNS_FILTER)] == [summary.run_id]
    assert {r.info.run_name for r in client.search_runs(experiment, CANDIDATES_FILTER)} == set(by_name)
    # a failed candidate says why in its tags (columns of the candidates view), the parent its result
    bad = by_name[f"{name}/it0-c1"].data.tags
    assert bad["error_kind"] in ("exception: ZeroDivisionError", "timeout") and bad["error"]
    assert "ZeroDivisionError" in bad["error"] or bad["error_kind"] == "timeout"
    assert "error" not in winner.data.tags
    assert ": winner it0-c0 (reward by proposer)" in parent.data.tags[RESULT_TAG]
    assert page.splitlines()[0] == f"**{parent.data.tags[RESULT_TAG]}**"


# -- names MLflow refuses, and a candidate that cannot be recorded ------------------------------

ODD = ["angle (rad)", "upright/", 'a"b', "n" * 300, "a\nb"]  # a"b and a\nb meet at components/a_b


def _logged_names(client, rid: str, tmp_path) -> dict[str, str]:
    path = client.download_artifacts(rid, NAMES_ARTIFACT, str(tmp_path))
    with open(path) as f:
        return json.load(f)


def test_component_names_mlflow_refuses_are_logged_under_valid_names_with_the_originals_kept(
    tracker, make_config, tmp_path
):
    components = {name: [(256, float(i)), (512, float(i) + 0.5)] for i, name in enumerate(ODD)}
    result = _result(components=components, series={**_result().series, "reward/angle (rad)": [(512, 0.25)]})
    candidate = Candidate("it0-c0", 0)
    with tracker.experiment_run(make_config(["env=cartpole"]), "odd-names", {}):
        rid = tracker.log_candidate(candidate, result, {})
    assert result.ok and result.error_kind == ""
    client = mlflow.MlflowClient(tracker.uri)
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert all(valid_key(k) for k in run.data.metrics)
    names = _logged_names(client, rid, tmp_path)
    assert sorted(names.values()) == sorted([f"components/{n}" for n in ODD] + ["reward/angle (rad)"])
    assert run.data.tags[RENAMED_TAG] == str(len(ODD) + 1)
    for logged, original in names.items():  # every original's points, under its own logged name
        assert logged in run.data.metrics and logged != original
        if original.startswith("components/"):
            history = client.get_metric_history(rid, logged)
            assert [(m.step, m.value) for m in history] == components[original[len("components/") :]]
    assert "components/angle _rad_" in names and "components/upright" in names
    assert max(len(k) for k in names) == MAX_KEY_CHARS
    assert len({k for k, v in names.items() if v in ('components/a"b', "components/a\nb")}) == 2  # kept apart
    assert run.data.metrics["fitness"] == 30.0  # valid names are untouched


def test_names_are_valid_as_mlflow_says():
    from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH

    assert MAX_KEY_CHARS == MAX_ENTITY_KEY_LENGTH
    for name in [
        "fitness",
        "components/angle (rad)",
        "a:b c-d.e_f/g",
        "upright/",
        "/x",
        "a//b",
        "..x",
        ".",
        "",
        "x\n",
        "é°",
        "n" * 251,
    ]:
        logged = safe_key(name)
        assert valid_key(logged), name
        assert (logged == name) == valid_key(name)
    assert valid_key("components/angle_rad.x:y") and not valid_key("x\n")  # MLflow's own pattern lets "x\n" through


def test_a_candidate_that_cannot_be_recorded_fails_alone_and_its_run_ends_failed(
    tracker, make_config, tmp_path, monkeypatch
):
    from mlflow.exceptions import MlflowException

    log_batch = tracker.client.log_batch
    broken: set[str] = set()

    def refuses(run_id, metrics=(), **kw):
        if run_id in broken and metrics:
            raise MlflowException("Invalid value for metric: the backend refused it")
        return log_batch(run_id, metrics=metrics, **kw)

    create_run = tracker.client.create_run

    def created(*args, **kw):
        run = create_run(*args, **kw)
        if kw.get("tags", {}).get("candidate") == "it0-c0":
            broken.add(run.info.run_id)
        return run

    monkeypatch.setattr(tracker.client, "log_batch", refuses)
    monkeypatch.setattr(tracker.client, "create_run", created)
    first, second = _result(), _result(candidate_id="it0-c1")
    with tracker.experiment_run(make_config(["env=cartpole"]), "broken", {}):
        rid = tracker.log_candidate(Candidate("it0-c0", 0), first, {})  # does not raise
        other = tracker.log_candidate(Candidate("it0-c1", 0), second, {})
    client = mlflow.MlflowClient(tracker.uri)
    run = client.get_run(rid)
    assert (first.ok, first.error_kind, first.run_id) == (False, "tracking", rid)
    assert "MlflowException" in first.error and "backend refused" in first.error
    assert run.info.status == "FAILED" and run.data.tags["error_kind"] == "tracking" and run.data.tags["ok"] == "False"
    error = client.download_artifacts(rid, "error.txt", str(tmp_path))
    with open(error) as f:
        assert "backend refused" in f.read()
    assert second.ok and client.get_run(other).info.status == "FINISHED"
    assert client.get_run(tracker.parent_id).info.status == "FINISHED"


ODD_PROPOSER = '''
"""Proposes one reward whose components have names MLflow refuses."""

from core import hookimpl
from core.records import RewardProgram

SOURCE = """
def compute_reward(state, action, next_state):
    angle = next_state["pole_angle"].abs()
    return 1.0 - angle, {"angle (rad)": angle, "upright/": 1.0 - angle, 'a"b': angle * 0.5, "angle°": angle * 2.0}
"""


@hookimpl
def propose_rewards(run, iteration):
    return [RewardProgram(source=SOURCE)]
'''


def test_a_reward_whose_component_names_mlflow_refuses_trains_and_is_logged(local_plugins, tiny_run, tmp_path):
    local_plugins("odd", ODD_PROPOSER)
    cfg = tiny_run("save_policy=false", "resume=false")
    with open_dict(cfg):
        cfg.plugins = {"odd": {}}
    summary = run_experiment(cfg)
    assert summary.failed == 0 and summary.best_id == "it0-c0"
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    assert parent.info.status == "FINISHED"
    (child,) = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{summary.run_id}'")
    assert child.info.status == "FINISHED" and child.data.tags["ok"] == "True"
    names = _logged_names(client, child.info.run_id, tmp_path)
    originals = {
        f"{prefix}/{n}" for prefix in ("components", "reward") for n in ("angle (rad)", "upright/", 'a"b', "angle°")
    }
    assert set(names.values()) == originals
    assert all(k in child.data.metrics for k in names)
    assert {"components/angle _rad_", "components/upright", "components/a_b", "components/angle_"} <= set(names)


def test_the_store_names_its_local_files_and_a_run_hides_them_from_workers(tracker, tmp_path, monkeypatch):
    from core.sandbox import hidden_records, hide_from_programs
    from core.sandbox.host import RECORDS_ENV

    monkeypatch.delenv(RECORDS_ENV, raising=False)
    paths = tracker.local_paths()
    assert str(tmp_path / "mlflow.db") in paths and str(tmp_path / "art") in paths
    hide_from_programs(*paths)
    hidden = hidden_records()
    assert str(tmp_path / "mlflow.db-journal") in hidden and str(tmp_path / "art") in hidden
    hide_from_programs(*paths)
    assert hidden_records() == hidden  # once each
