"""The MLflow UI, in a real browser, shows what a run found: headless Chromium against
``mlflow server`` on 127.0.0.1 (started and stopped here), Playwright driving it.

The run is real (Eureka on CartPole, PPO, MLflow on sqlite); only the LLM's replies are
scripted (:func:`fakes.install_fake_litellm`): a working reward, a reply with no code, and
one that raises, so the page shows every kind of row. Without the system's Chromium
(``apt-get install -y chromium``) or the ``playwright`` package the test fails and says so.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlflow
import pytest

from core import run_page
from core.loop import run_experiment
from core.testing import fakes

ROOT = Path(__file__).resolve().parents[2]
TINY = ["env=cartpole", "trainer.frames=512", "trainer.num_envs=4", "trainer.rollout_steps=32", "trainer.epochs=1",
        "trainer.minibatch=64", "trainer.hidden=[16]", "trainer.eval_every=256", "trainer.eval_episodes=2",
        "executor=inprocess", "tracking.log_plots=false", "save_policy=false", "resume=false"]
RAISES = """```python
def compute_reward(state, action, next_state):
    return next_state["cart_position"] / 0 + undefined_name
```"""


def _pages():
    spec = importlib.util.spec_from_file_location("mlflow_pages", ROOT / "benchmarks" / "mlflow_pages.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_parent_run_page_shows_the_candidates_and_the_winner(make_config, monkeypatch, tmp_path):
    pages = _pages()
    replies = iter([fakes.REWARD.format(entry="compute_reward"), "I would reward staying upright.", RAISES])
    fakes.install_fake_litellm(monkeypatch, lambda messages: next(replies, RAISES))  # a repair fails again
    cfg = make_config(["+plugins=[eureka]", "plugins.eureka.iterations=1", "plugins.eureka.samples=3", *TINY,
                       *fakes.FAKE_LLM_OVERRIDES, "llm.max_n=1", "llm.concurrency=1"])
    summary = run_experiment(cfg)
    client = mlflow.MlflowClient(cfg.tracking.uri)
    parent = client.get_run(summary.run_id)
    experiment_id, name = parent.info.experiment_id, parent.info.run_name
    winner = parent.data.tags["llm4rl.winner_run"]
    assert client.get_run(winner).data.tags[run_page.WINNER_TAG] == "true"

    with pages.mlflow_server(cfg.tracking.uri) as base, pages.chromium_page() as page:
        pages.open_page(page, pages.run_url(base, experiment_id, summary.run_id), "Candidates (3)")
        pages.tidy(page)  # the description opens collapsed
        body = page.inner_text("body")
        assert f"{name}/it0-c0 (winner)" in body  # the table, rendered: bold name and the mark
        assert "Winner:" in body and "Rule:" in body and "the highest" in body
        rows = [line for line in body.splitlines() if f"{name}/it0-c" in line and "open" in line]
        assert len(rows) == 3 and sum("\tok\t" in r for r in rows) == 1  # the other two: rejected or failed
        assert page.locator("pre code").filter(has_text="def compute_reward").count() >= 1  # the winning code
        assert page.get_by_text("Model registry").count() and not page.get_by_text("Judges").count()  # not GenAI
        page.screenshot(path=str(tmp_path / "parent.png"), full_page=True)

        with page.context.expect_page() as opened:  # a candidate's link opens its run (in a new tab)
            page.get_by_role("link", name="open").first.click()
        candidate = opened.value
        candidate.get_by_text("Candidate", exact=False).first.wait_for(timeout=60_000)
        assert f"of run {name}" in candidate.inner_text("body")
    assert (tmp_path / "parent.png").stat().st_size > 10_000
