"""``python -m core.ui``: the MLflow UI on a run's store, opened at the experiment's own page.

``mlflow ui`` as such starts on MLflow's home page, fetches litellm's price table from the
network at start (dozens of warnings offline) and needs the store's URI typed out. This
starts MLflow's server on 127.0.0.1 with the environment set (no price-table fetch, the
file store allowed), waits until it answers and prints the URL of the experiment's
candidate view (the saved view ``llm4rl-candidates``, :data:`core.tracking.VIEW_KEY`).
Ctrl-C stops it.

    python -m core.ui                                   # sqlite:///mlflow.db, experiment llm4rl
    python -m core.ui --uri sqlite:///studies/results/mlflow.db --experiment results
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager

#: the environment MLflow's server runs with: no network fetch of litellm's price table
SERVER_ENV = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MLFLOW_ALLOW_FILE_STORE": "true"}


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
    proc = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri", uri, "--host", "127.0.0.1",
                             "--port", str(port), "--workers", "1"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **SERVER_ENV})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"MLflow's server did not start on {base}:\n{log.read().decode()[-3000:]}")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def experiment_url(base: str, uri: str, experiment: str) -> str:
    """The experiment's candidate view at ``base`` (the experiments list if it does not exist)."""
    import mlflow

    from core import run_page
    from core.tracking import VIEW_KEY

    found = mlflow.MlflowClient(tracking_uri=uri).get_experiment_by_name(experiment)
    if found is None:
        return f"{base}/#/experiments"
    return f"{base}/#/experiments/{found.experiment_id}/runs?viewStateShareKey={VIEW_KEY}&{run_page.ML_VIEW}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m core.ui", description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", default="sqlite:///mlflow.db", help="the tracking store (default: sqlite:///mlflow.db)")
    parser.add_argument("--experiment", default="llm4rl", help="the experiment to open (default: llm4rl)")
    parser.add_argument("--port", type=int, default=5000, help="the port on 127.0.0.1 (default: 5000; 0: a free one)")
    args = parser.parse_args(argv)
    if args.uri.startswith("sqlite:///") and not os.path.exists(args.uri[len("sqlite:///"):]):
        print(f"error: no MLflow store at {args.uri}; run something first (python -m core) or pass --uri", file=sys.stderr)
        return 2
    from core import interrupts

    interrupts.install()  # SIGTERM too ends in the `finally` that stops the server
    began = time.perf_counter()
    try:
        with serve(args.uri, args.port) as base:
            print(f"MLflow UI ready in {time.perf_counter() - began:.0f} s: {experiment_url(base, args.uri, args.experiment)}",
                  flush=True)
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
