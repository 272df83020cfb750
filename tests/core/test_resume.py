"""Repeating an LLM experiment pays for nothing twice: no model call, no retraining, same result."""

from __future__ import annotations

import subprocess
import sys

import mlflow
import pytest


def _run(tmp_path, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable, "-m", "core", "+plugins=[eureka]", "plugins.eureka.iterations=1", "plugins.eureka.samples=2",
        "plugins.eureka.max_tokens=400", "trainer.frames=4096", "trainer.eval_episodes=3",
        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", f"tracking.artifact_location={tmp_path}/art",
        f"cache_dir={tmp_path}/cache", f"llm.cache_path={tmp_path}/cache/llm.sqlite", "progress=false",
        f"hydra.run.dir={tmp_path}/out", *extra,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=1500, cwd=tmp_path)


def _parent_runs(tmp_path):
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path}/mlflow.db")
    runs = mlflow.search_runs(search_all_experiments=True, filter_string="tags.plugins = 'eureka'", order_by=["start_time ASC"])
    return runs


@pytest.mark.slow
def test_second_identical_run_makes_no_model_call_and_gives_the_same_result(tmp_path):
    first = _run(tmp_path)
    # exit 1 is allowed: every candidate of the weak embedded model may fail, and that is a result too
    assert first.returncode in (0, 1), first.stdout + first.stderr
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
