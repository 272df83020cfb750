"""``python -m core.ui``: the MLflow UI on a run's store, opened at the experiment's own page.

``mlflow ui`` as such starts on MLflow's home page, fetches litellm's price table from the
network at start (dozens of warnings offline) and needs the store's URI typed out. This
starts MLflow's app on 127.0.0.1 with the environment set (no price-table fetch, no job
runner, the file store allowed; under uvicorn directly, :func:`server_command`), waits
until it answers and prints the URL of the experiment's
candidate view (the saved view ``llm4rl-candidates``, :data:`core.tracking.VIEW_KEY`).
Ctrl-C stops it.

    python -m core.ui                                   # sqlite:///mlflow.db, experiment llm4rl
    python -m core.ui --uri sqlite:///studies/results/mlflow.db --experiment results
"""

from __future__ import annotations

import argparse
import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

#: the environment MLflow's server runs with: no network fetch of litellm's price table, no job
#: runner (GenAI evaluation jobs; its extra process took 18 of 43 s to the first page at a load of 5)
SERVER_ENV = {
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "MLFLOW_ALLOW_FILE_STORE": "true",
    "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
}

#: how ``mlflow server`` hands its options to the app it starts under uvicorn (``mlflow.server``'s
#: constants, MLflow 3.x): starting that app directly skips the CLI's own process, which imports
#: MLflow a second time (26 s -> 15 s to the first page at a load of 5). Should a future MLflow
#: read other names, the app fails to start and :func:`serve` falls back to ``mlflow server``.
APP_ENV = {
    "_MLFLOW_SERVER_SERVE_ARTIFACTS": "true",
    "_MLFLOW_SERVER_ARTIFACT_ROOT": "mlflow-artifacts:/",
    "_MLFLOW_SERVER_ARTIFACT_DESTINATION": "./mlartifacts",
    "_MLFLOW_SGI_NAME": "uvicorn",
}


def server_command(uri: str, port: int, direct: bool = True) -> tuple[list[str], dict[str, str]]:
    """The command that serves the store ``uri`` on 127.0.0.1:``port`` and its extra environment:
    MLflow's app under uvicorn directly, or (``direct=False``) through ``mlflow server``."""
    if direct:
        env = {**SERVER_ENV, **APP_ENV, "_MLFLOW_SERVER_FILE_STORE": uri, "_MLFLOW_SERVER_BOOT_ID": uuid.uuid4().hex}
        return [
            sys.executable,
            "-m",
            "uvicorn",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "mlflow.server.fastapi_app:app",
        ], env
    return [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--backend-store-uri",
        uri,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ], dict(SERVER_ENV)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(uri: str, port: int = 0, timeout_s: float = 300.0) -> Iterator[str]:
    """MLflow's server on the store ``uri`` at 127.0.0.1 (``port``, or a free one); yields its
    base URL once it answers, stops it on the way out."""
    port = port or free_port()
    log = tempfile.TemporaryFile()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    proc = None
    try:
        for direct in (True, False):  # MLflow's app directly; should it not start, through `mlflow server`
            command, extra = server_command(uri, port, direct)
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **extra})
            while not _answers(base):
                if proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            else:
                break
            if direct and proc.poll() is not None and time.monotonic() < deadline:
                continue
            log.seek(0)
            raise RuntimeError(f"MLflow's server did not start on {base}:\n{log.read().decode()[-3000:]}")
        yield base
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def _answers(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def experiment_url(base: str, uri: str, experiment: str) -> str:
    """The experiment's candidate view at ``base`` (the experiments list if it does not exist)."""
    from core import run_page
    from core.tracking import VIEW_KEY

    found = experiment_id(uri, experiment)
    if found is None:
        return f"{base}/#/experiments"
    return f"{base}/#/experiments/{found}/runs?viewStateShareKey={VIEW_KEY}&{run_page.ML_VIEW}"


def experiment_id(uri: str, experiment: str) -> str | None:
    """The id of the experiment named ``experiment`` in the store ``uri``, None if there is none.

    A sqlite store is read directly: importing MLflow for this one lookup took 10 s at a load
    of 8, after the server was up (the first page waited for it). Other stores ask MLflow.
    """
    if uri.startswith("sqlite:///"):
        import sqlite3

        try:
            with contextlib.closing(sqlite3.connect(f"file:{uri[len('sqlite:///') :]}?mode=ro", uri=True)) as db:
                row = db.execute(
                    "select experiment_id from experiments where name = ? and lifecycle_stage = 'active'", (experiment,)
                ).fetchone()
            return str(row[0]) if row else None
        except sqlite3.Error:
            pass  # not MLflow's schema (yet): MLflow knows
    import mlflow

    found = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    return None if found is None else str(found.experiment_id)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--uri", default="sqlite:///mlflow.db", help="the tracking store (default: sqlite:///mlflow.db)"
    )
    parser.add_argument("--experiment", default="llm4rl", help="the experiment to open (default: llm4rl)")
    parser.add_argument("--port", type=int, default=5000, help="the port on 127.0.0.1 (default: 5000; 0: a free one)")
    args = parser.parse_args(argv)
    if args.uri.startswith("sqlite:///") and not os.path.exists(args.uri[len("sqlite:///") :]):
        print(
            f"error: no MLflow store at {args.uri}; run something first (python -m core) or pass --uri", file=sys.stderr
        )
        return 2
    from core import interrupts

    interrupts.install()  # SIGTERM too ends in the `finally` that stops the server
    began = time.perf_counter()
    try:
        with serve(args.uri, args.port) as base:
            print(
                f"MLflow UI ready in {time.perf_counter() - began:.0f} s: "
                f"{experiment_url(base, args.uri, args.experiment)}",
                flush=True,
            )
            print("Ctrl-C stops it.", flush=True)
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        return 0
    except RuntimeError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
