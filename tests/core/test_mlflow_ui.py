"""The MLflow UI, in a real browser, shows what a run found: headless Chromium against
``mlflow server`` on 127.0.0.1 (started and stopped here), Playwright driving it.
``LLM4RL_DOCS_IMG=docs/img`` keeps its screenshots (a default window) for docs/mlflow.md.

The run is real (Eureka on CartPole, PPO, MLflow on sqlite); only the LLM's replies are
scripted (:func:`fakes.install_fake_litellm`): a working reward, a reply with no code, and
one that raises, so the page shows every kind of row. Without the system's Chromium
(``apt-get install -y chromium``) or the ``playwright`` package the test fails and says so.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import mlflow
import pytest

from core import run_page
from core.loop import run_experiment
from core.testing import fakes
from core.tracking import CANDIDATES_FILTER, RESULT_TAG, RUNS_VIEW_KEY

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "env=cartpole",
    "trainer.frames=512",
    "trainer.num_envs=4",
    "trainer.rollout_steps=32",
    "trainer.epochs=1",
    "trainer.minibatch=64",
    "trainer.hidden=[16]",
    "trainer.eval_every=256",
    "trainer.eval_episodes=2",
    "executor=inprocess",
    "tracking.log_plots=false",
    "save_policy=false",
    "resume=false",
]
RAISES = """```python
def compute_reward(state, action, next_state):
    return next_state["cart_position"] / 0 + undefined_name
```"""


def _pages():
    spec = importlib.util.spec_from_file_location("mlflow_pages", ROOT / "benchmarks" / "mlflow_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


#: where the test saves its screenshots for the docs (``LLM4RL_DOCS_IMG=docs/img``); unset: a temporary folder
DOCS_IMG = "LLM4RL_DOCS_IMG"


def _lines(page) -> list[str]:
    return [line.strip() for line in page.inner_text("body").splitlines() if line.strip()]


@pytest.mark.slow
def test_the_pages_show_the_result_the_kinds_of_run_and_why_candidates_failed(make_config, monkeypatch, tmp_path):
    """In a default window (nothing closed or expanded): the parent's collapsed description starts
    with the result, a failed candidate's page says why, the candidates view lists candidates alone
    with why each failed, the runs view lists the parent alone. Screenshots of each for the docs."""
    pages = _pages()
    shots = Path(os.environ.get(DOCS_IMG) or tmp_path)
    replies = iter([fakes.REWARD.format(entry="compute_reward"), "I would reward staying upright.", RAISES])
    fakes.install_fake_litellm(monkeypatch, lambda messages: next(replies, RAISES))  # a repair fails again
    cfg = make_config(
        [
            "+plugins=[eureka]",
            "plugins.eureka.iterations=1",
            "plugins.eureka.samples=3",
            *TINY,
            *fakes.FAKE_LLM_OVERRIDES,
            "llm.max_n=1",
            "llm.concurrency=1",
        ]
    )
    summary = run_experiment(cfg)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    experiment_id, name = parent.info.experiment_id, parent.info.run_name
    winner = parent.data.tags["llm4rl.winner_run"]
    assert client.get_run(winner).data.tags[run_page.WINNER_TAG] == "true"
    result = parent.data.tags[RESULT_TAG]
    assert ": winner it0-c0" in result and "3 candidate(s): 1 trained, 2 failed" in result
    failed = [r for r in client.search_runs([experiment_id], CANDIDATES_FILTER) if r.data.tags.get("error")]
    assert len(failed) == 2

    with pages.mlflow_server(cfg.tracking.uri) as base, pages.chromium_page() as page:
        # the parent run, as it opens: the description collapsed, its first lines the result
        pages.open_page(page, pages.run_url(base, experiment_id, summary.run_id), "Description")
        assert result in _lines(page), "the collapsed description does not show the result"
        page.screenshot(path=str(shots / "mlflow_parent.png"))
        pages.tidy(page)  # expanded: the candidate table, the winning code
        body = page.inner_text("body")
        assert f"{name}/it0-c0 (winner)" in body  # the table, rendered: bold name and the mark
        assert "Winner:" in body and "Rule:" in body and "the highest" in body
        rows = [line for line in body.splitlines() if f"{name}/it0-c" in line and "open" in line]
        assert len(rows) == 3 and sum("\tok\t" in r for r in rows) == 1  # the other two: rejected or failed
        assert all("\tok\t" in r or "Error" in r or "code" in r.lower() for r in rows)  # each failure's reason
        assert page.locator("pre code").filter(has_text="def compute_reward").count() >= 1  # the winning code
        assert page.get_by_text("Model registry").count() and not page.get_by_text("Judges").count()  # not GenAI

        with page.context.expect_page() as opened:  # a candidate's link opens its run (in a new tab)
            page.get_by_role("link", name="open").first.click()
        candidate = opened.value
        candidate.get_by_text("Candidate", exact=False).first.wait_for(timeout=60_000)
        assert f"of run {name}" in candidate.inner_text("body")

        # a failed candidate: why, first (not "fitness = -")
        bad = failed[0]
        pages.open_page(page, pages.run_url(base, experiment_id, bad.info.run_id), "Description")
        lines = _lines(page)
        assert f"Failed: {bad.data.tags['error']}" in lines or any(line.startswith("Failed (") for line in lines), lines
        assert not any("= -" in line for line in lines)
        page.screenshot(path=str(shots / "mlflow_failed.png"))
        pages.open_page(page, pages.run_url(base, experiment_id, winner), "Description")
        page.screenshot(path=str(shots / "mlflow_candidate.png"))

        # the candidates view: the three candidates, no parent, why each failed in a column
        pages.open_page(page, pages.runs_url(base, experiment_id), f"{name}/it0-c0")
        lines = _lines(page)
        assert sum(line.startswith(f"{name}/it0-c") for line in lines) == 3
        assert name not in lines  # the parent run is not a row
        assert "error" in lines and any(bad.data.tags["error"][:30] in line for line in lines)
        page.screenshot(path=str(shots / "mlflow_runs.png"))
        # the runs view: the parent alone, its result in a column
        pages.open_page(page, pages.runs_url(base, experiment_id, RUNS_VIEW_KEY), name)
        lines = _lines(page)
        assert name in lines and not any(line.startswith(f"{name}/it0-c") for line in lines)
        assert any(result[:40] in line for line in lines)
        page.screenshot(path=str(shots / "mlflow_parents.png"))
    assert (shots / "mlflow_parent.png").stat().st_size > 10_000
