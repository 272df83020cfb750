"""Repeating an LLM experiment pays for nothing twice: no model call, no retraining, same result."""

from __future__ import annotations

import json

import mlflow
import pytest
from omegaconf import OmegaConf, open_dict

from core.app import print_summary
from core.executor import build_runtime
from core.loop import run_experiment
from core.records import Candidate
from core.store import job_key
from core.testing.cli import CliResult, run_cli


def _run(tmp_path, *extra: str) -> CliResult:
    # Eureka on CartPole, one round of two samples (one LLM request, plus the vetting's repairs);
    # 1,024 frames and 2 evaluation episodes: nothing here depends on what the policy learnt.
    return run_cli(
        tmp_path,
        "+plugins=[eureka]",
        "plugins.eureka.iterations=1",
        "plugins.eureka.samples=2",
        "plugins.eureka.max_tokens=400",
        "trainer.frames=1024",
        "trainer.eval_episodes=2",
        f"llm.cache_path={tmp_path}/cache/llm.sqlite",
        "progress=false",
        *extra,
        timeout=1500,
    )


def _parent_runs(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(
        search_all_experiments=True, filter_string="tags.plugins = 'eureka'", order_by=["start_time ASC"]
    )
    return runs


@pytest.mark.slow
def test_second_identical_run_makes_no_model_call_and_gives_the_same_result(tmp_path):
    """Also the embedded model's end-to-end Eureka run (the first run): it logs every
    candidate's code and its fitness or error, the reflection and the LLM's exchanges.
    One pipeline for both checks, as the first run is the whole cost of each."""
    first = _run(tmp_path)
    # exit 1 is allowed: every candidate of the weak embedded model may fail, and that is a
    # result too, which the run says; anything else is a crash
    all_failed = first.returncode == 1 and "every candidate failed" in first.stdout
    assert first.returncode == 0 or all_failed, first.stdout + first.stderr
    _check_eureka_records(tmp_path, all_failed)
    second = _run(tmp_path)
    assert second.returncode == first.returncode, second.stdout + second.stderr
    runs = _parent_runs(tmp_path)
    assert len(runs) == 2
    one, two = runs.iloc[0], runs.iloc[1]
    assert one["metrics.llm/requests"] >= 1
    assert two["metrics.llm/requests"] == 0
    assert two["metrics.llm/cache_hits"] >= 2  # both samples served from the cache
    assert two["metrics.candidates"] == one["metrics.candidates"]
    f1, f2 = one.get("metrics.fitness"), two.get("metrics.fitness")
    assert (f1 != f1 and f2 != f2) or f1 == f2  # both NaN (all failed) or equal


def _check_eureka_records(tmp_path, all_failed: bool) -> None:
    """What the (only) Eureka run so far recorded in MLflow: the reflection and the LLM's
    exchanges on the parent; every candidate's code, and its fitness or its error."""
    client = mlflow.MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (experiment,) = [e for e in client.search_experiments() if e.name == "llm4rl"]
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    assert len(parents) == 1 and len(children) >= 1
    parent_files = _artifact_paths(client, parents[0].info.run_id)
    assert any(p.startswith("reflection/it0-") for p in parent_files), parent_files
    assert any(p.startswith("llm/") for p in parent_files), parent_files
    for child in children:  # every candidate: its code and its fitness (or its error)
        files = _artifact_paths(client, child.info.run_id)
        assert any(p.endswith(".py") for p in files), files
        if child.data.tags["ok"] == "True":
            assert "fitness" in child.data.metrics
        else:
            assert "error.txt" in files, files
    assert all_failed or any(c.data.tags["ok"] == "True" for c in children)
    assert json.dumps(parents[0].data.metrics)  # summary metrics exist


def _artifact_paths(client, run_id: str, path: str | None = None) -> list[str]:
    out: list[str] = []
    for item in client.list_artifacts(run_id, path):
        out += _artifact_paths(client, run_id, item.path) if item.is_dir else [item.path]
    return out


# -- results keyed by code ---------------------------------------------------------------

VERSION = '''
    """Says which version of its code ran."""

    from core import hookimpl


    @hookimpl
    def on_train_end(train, result):
        train.log_text("version.txt", "{version}")
'''


def _candidate_runs(uri: str, parent_id: str):
    client = mlflow.MlflowClient(uri)
    parent = client.get_run(parent_id)
    runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'")
    assert len(runs) == 1
    return client, runs[0]


def _version(client, run, folder) -> str:
    from pathlib import Path

    return Path(client.download_artifacts(run.info.run_id, "texts/version.txt", str(folder))).read_text()


def test_editing_a_plugin_retrains_instead_of_replaying(local_plugins, tiny_run, tmp_path, capsys):
    source = local_plugins("version", VERSION.format(version="v1"))
    cfg = tiny_run("save_policy=false")
    with open_dict(cfg):
        cfg.plugins = {"version": {}}
    container = OmegaConf.to_container(cfg, resolve=True)
    candidate = Candidate("it0-c0", 0)
    key_before = job_key(candidate, container, 0, build_runtime(container).fingerprint)

    first = run_experiment(cfg)
    assert first.reused == 0
    store = tmp_path / "llm4rl-results.sqlite"  # beside the tracking store, not in a global cache
    assert cfg.tracking.uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert first.results_store == str(store) and store.exists()
    client, trained = _candidate_runs(cfg.tracking.uri, first.run_id)
    assert _version(client, trained, tmp_path / "dl1") == "v1"

    second = run_experiment(cfg)  # same code, config and seed: the training is reused
    assert second.reused == 1 and second.fitness == first.fitness
    _, reused = _candidate_runs(cfg.tracking.uri, second.run_id)
    assert reused.data.tags["resumed"] == "True"
    assert reused.data.tags["reused_from_run"] == trained.info.run_id
    assert reused.data.tags["results_store"] == str(store)
    capsys.readouterr()
    print_summary(second)
    printed = "".join(capsys.readouterr().out.split())  # the console wraps long paths
    assert str(store) in printed and "1training(s)reused" in printed

    local_plugins("version", VERSION.format(version="v2 (edited)"))  # the plugin's code changes, its config does not
    assert source.read_text().count("v2") == 1
    key_after = job_key(candidate, container, 0, build_runtime(container).fingerprint)
    assert key_after != key_before
    third = run_experiment(cfg)
    assert third.reused == 0
    _, retrained = _candidate_runs(cfg.tracking.uri, third.run_id)
    assert retrained.data.tags["resumed"] == "False" and "reused_from_run" not in retrained.data.tags
    assert _version(client, retrained, tmp_path / "dl3") == "v2 (edited)"
