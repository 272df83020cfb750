"""``python -m core.ui``: MLflow's server on a store, opened at the experiment's candidate view."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import mlflow
import pytest

from core.tracking import VIEW_KEY
from core.ui import main


def test_a_store_that_does_not_exist_is_refused_with_what_to_do(tmp_path, capsys):
    assert main(["--uri", f"sqlite:///{tmp_path / 'none.db'}"]) == 2
    assert "no MLflow store" in capsys.readouterr().err


@pytest.mark.slow
def test_the_ui_starts_on_the_store_and_prints_the_experiments_own_page(tmp_path: Path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    mlflow.set_tracking_uri(uri)
    experiment_id = mlflow.create_experiment("abl")
    with mlflow.start_run(experiment_id=experiment_id, run_name="r"):
        mlflow.log_metric("fitness", 1.0)
    proc = subprocess.Popen([sys.executable, "-m", "core.ui", "--uri", uri, "--experiment", "abl", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("MLflow UI ready in"), line + proc.stdout.read()
        url = line.split(": ", 1)[1].strip()
        assert f"#/experiments/{experiment_id}/runs?viewStateShareKey={VIEW_KEY}" in url
        base = url.split("/#/")[0]
        query = urllib.parse.urlencode({"experiment_id": experiment_id})
        with urllib.request.urlopen(f"{base}/api/2.0/mlflow/experiments/get?{query}", timeout=30) as r:
            assert json.load(r)["experiment"]["name"] == "abl"  # the server reads this store
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    time.sleep(0.5)
    with pytest.raises(OSError):  # the server went with it
        urllib.request.urlopen(f"{base}/health", timeout=2)
