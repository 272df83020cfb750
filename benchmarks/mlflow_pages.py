"""The MLflow pages a run writes, seen in a real browser: screenshots for docs/mlflow.md.

    python benchmarks/mlflow_pages.py --out docs/img            # a new Eureka run, embedded LLM
    python benchmarks/mlflow_pages.py --uri sqlite:///mlflow.db  # pages of the newest run there

Without ``--uri`` it runs ``python -m core +plugins=[eureka] env=cartpole`` with a small
budget into a temporary store. It then serves the store with ``mlflow server`` on
127.0.0.1 (a free port), opens the parent run, its winning candidate and the runs table
(the saved candidates view) and the parent runs' view in headless Chromium, in a default
window, and saves ``mlflow_parent.png``, ``mlflow_candidate.png``, ``mlflow_runs.png`` and
``mlflow_parents.png``. ``tests/core/test_mlflow_ui.py`` uses the
same helpers on a run with scripted LLM replies.

Chromium is the system's (Debian: ``apt-get install -y chromium``); nothing is downloaded.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import subprocess
import tempfile
from contextlib import contextmanager
from typing import Any, Iterator

from core.ui import serve

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


#: MLflow's server on a store at 127.0.0.1, as ``python -m core.ui`` starts it (yields its base URL)
mlflow_server = serve


@contextmanager
def chromium_page(width: int = 1400, height: int = 1000) -> Iterator[Any]:
    """A headless Chromium page (Playwright driving the system's Chromium); RuntimeError if either is missing."""
    if not Path(CHROMIUM).exists():
        raise RuntimeError(
            f"no Chromium at {CHROMIUM}: install it with `apt-get install -y chromium` "
            "(the browser test needs the system's Chromium; it never downloads one)"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as e:
        raise RuntimeError("the python package `playwright` is missing: pip install -e '.[test]'") from e
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page(viewport={"width": width, "height": height})
        finally:
            browser.close()


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    from core.run_page import run_link

    return f"{base}/{run_link(experiment_id, run_id)}"


def runs_url(base: str, experiment_id: str, view: str = "") -> str:
    """The experiment's runs table in a saved view (default: the candidates view)."""
    from core.run_page import ML_VIEW
    from core.tracking import VIEW_KEY

    return f"{base}/#/experiments/{experiment_id}/runs?viewStateShareKey={view or VIEW_KEY}&{ML_VIEW}"


def tidy(page: Any) -> None:
    """Close the assistant panel and expand a collapsed run description, where there are."""
    for label in ("Close", "Expand description"):
        button = page.get_by_role("button", name=label, exact=True)
        if button.count():
            button.first.click()
            page.wait_for_timeout(500)


def open_page(page: Any, url: str, text: str, timeout_ms: int = 60_000) -> None:
    """Go to ``url`` and wait until ``text`` is visible (the app renders after loading)."""
    page.goto(url)
    page.get_by_text(text, exact=False).first.wait_for(state="visible", timeout=timeout_ms)
    page.wait_for_timeout(1000)  # charts and tables settle


def newest_run(uri: str) -> tuple[str, str, str]:
    """``(experiment_id, parent_run_id, winner_run_id)`` of the newest parent run in ``uri``."""
    import mlflow

    client = mlflow.MlflowClient(uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    parents = [
        r
        for r in client.search_runs(experiments, order_by=["attributes.start_time DESC"])
        if "mlflow.parentRunId" not in r.data.tags
    ]
    if not parents:
        raise SystemExit(f"no parent run in {uri}")
    parent = parents[0]
    return parent.info.experiment_id, parent.info.run_id, parent.data.tags.get("llm4rl.winner_run", "")


def screenshots(uri: str, out: Path) -> list[Path]:
    """The parent run, its winning candidate and the two runs views of the newest run in ``uri``, as PNGs."""
    experiment_id, parent_id, winner_id = newest_run(uri)
    out.mkdir(parents=True, exist_ok=True)
    saved = []
    from core.tracking import RUNS_VIEW_KEY

    with mlflow_server(uri) as base, chromium_page() as page:
        shots = [("mlflow_parent.png", run_url(base, experiment_id, parent_id), "Description")]
        if winner_id:
            shots.append(("mlflow_candidate.png", run_url(base, experiment_id, winner_id), "Description"))
        shots += [
            ("mlflow_runs.png", runs_url(base, experiment_id), "fitness"),
            ("mlflow_parents.png", runs_url(base, experiment_id, RUNS_VIEW_KEY), "fitness"),
        ]
        for name, url, text in shots:  # as a default window shows them: nothing closed or expanded
            open_page(page, url, text)
            page.screenshot(path=str(out / name))
            saved.append(out / name)
    return saved


def eureka_run(store: Path, frames: int = 4096) -> str:
    """A small Eureka run on CartPole with the embedded LLM into ``store``; returns its URI."""
    uri = f"sqlite:///{store / 'mlflow.db'}"
    cmd = [
        sys.executable,
        "-m",
        "core",
        "+plugins=[eureka]",
        "env=cartpole",
        "plugins.eureka.iterations=2",
        "plugins.eureka.samples=2",
        "plugins.eureka.max_tokens=400",
        f"trainer.frames={frames}",
        f"trainer.eval_every={frames // 4}",
        "executor=inprocess",
        f"tracking.uri={uri}",
        f"tracking.artifact_location={store / 'artifacts'}",
        "experiment=mlflow-pages",
        "progress=false",
    ]
    subprocess.run(cmd, check=True)
    return uri


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--uri", help="an MLflow store with a finished run (default: make one)")
    parser.add_argument("--out", default="docs/img", help="folder for the PNGs")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        uri = args.uri or eureka_run(Path(tmp))
        for path in screenshots(uri, Path(args.out)):
            print(path)


if __name__ == "__main__":
    main()
