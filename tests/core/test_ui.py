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
    proc = subprocess.Popen(
        [sys.executable, "-m", "core.ui", "--uri", uri, "--experiment", "abl", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
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


def test_the_server_is_mlflows_app_under_uvicorn_on_the_store_with_no_job_runner():
    from core.ui import server_command

    command, env = server_command("sqlite:///x.db", 5000)
    assert command[1:4] == ["-m", "uvicorn", "--host"] and command[-1] == "mlflow.server.fastapi_app:app"
    assert env["_MLFLOW_SERVER_FILE_STORE"] == "sqlite:///x.db" and env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"
    assert env["LITELLM_LOCAL_MODEL_COST_MAP"] == "True"
    command, env = server_command("sqlite:///x.db", 5000, direct=False)
    assert command[1:4] == ["-m", "mlflow", "server"] and "sqlite:///x.db" in command
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false"


HEALTH = """
import http.server, sys
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"OK")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def test_a_direct_start_that_fails_falls_back_to_mlflow_server(monkeypatch):
    """Should a future MLflow read other settings, its app dies at start: serve() then uses the CLI."""
    import core.ui

    used = []

    def command(uri, port, direct=True):
        used.append(direct)
        if direct:
            return [sys.executable, "-c", "raise SystemExit(3)"], {}
        return [sys.executable, "-c", HEALTH, str(port)], {}

    monkeypatch.setattr(core.ui, "server_command", command)
    with core.ui.serve("sqlite:///x.db", timeout_s=60) as base:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            assert r.status == 200
    assert used == [True, False]


def test_the_experiments_id_is_read_from_a_sqlite_store_without_importing_mlflow(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = mlflow.MlflowClient(uri)
    ids = {name: client.create_experiment(name) for name in ("abl", "other")}
    code = (
        "import sys; from core.ui import experiment_id; print(experiment_id(sys.argv[1], 'abl'), "
        "experiment_id(sys.argv[1], 'none'), 'mlflow' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code, uri], capture_output=True, text=True, timeout=60)
    assert proc.stdout.split() == [ids["abl"], "None", "False"], proc.stderr
    from core.ui import experiment_id

    client.delete_experiment(ids["abl"])
    assert experiment_id(uri, "abl") is None  # a deleted one is not opened
