"""The Markdown of the MLflow pages that explain a run (core/run_page.py)."""

from __future__ import annotations

import re

from core import run_page
from core.records import Candidate, Fitness, IterationResult, RewardProgram, TrainResult

CODE_WITH_FENCES = 'def compute_reward(s, a, n):\n    """```python\nx = 1\n```"""\n    return 1.0\n'


def _candidate(
    i: int, it: int = 0, source: str = "def compute_reward(s, a, n):\n    return 1.0\n", **meta
) -> Candidate:
    program = RewardProgram(source=source, origin="eureka", meta=dict(meta))
    return Candidate(id=f"it{it}-c{i}", iteration=it, reward=program)


def _ok(cid: str, value: float, run_id: str = "") -> TrainResult:
    return TrainResult(cid, ok=True, fitness=Fitness("return", value), frames=1000, seconds=2.5, run_id=run_id)


def _history() -> list[IterationResult]:
    it0 = IterationResult(
        0,
        [_candidate(0), _candidate(1)],
        [_ok("it0-c0", 20.0, "r00"), TrainResult("it0-c1", ok=False, error="boom", error_kind="timeout", run_id="r01")],
    )
    it1 = IterationResult(1, [_candidate(0, 1, CODE_WITH_FENCES, sample=3)], [_ok("it1-c0", 187.5, "r10")])
    return [it0, it1]


def _page(**kw) -> str:
    history = kw.get("history") or _history()
    best = (history[1].candidates[0], history[1].results[0])
    args = dict(
        name="eureka-s0",
        task="CartPole-v1",
        fitness_name="return",
        experiment_id="7",
        history=history,
        best=best,
        llm={
            "llm/calls": 2,
            "llm/prompt_tokens": 900,
            "llm/completion_tokens": 300,
            "llm/wait_s": 4.2,
            "llm/cost": 0.0012,
        },
        seconds=12.0,
    )
    return run_page.parent_page(**{**args, **kw})


def test_a_fence_is_longer_than_any_backtick_run_inside():
    block = run_page.fence("a ``` b ````` c", "python")
    opening, *_, closing = block.splitlines()
    assert opening == "``````python" and closing == "``````"
    assert run_page.fence("plain").startswith("```\n")


def test_the_parent_page_has_every_candidate_the_winner_and_the_rule():
    page = _page()
    rows = [line for line in page.splitlines() if line.startswith("| ") and "`eureka-s0/" in line]
    assert len(rows) == 3
    assert (
        "| 0 | 1 | `eureka-s0/it0-c1` | - | timeout | boom "
        "| [open](#/experiments/7/runs/r01?workflowType=machine_learning) |" in rows
    )
    assert (
        "| 1 | 3 | **`eureka-s0/it1-c0`** (winner) | 187.5 | ok |  "
        "| [open](#/experiments/7/runs/r10?workflowType=machine_learning) |" in rows
    )
    # the first line, all a collapsed description shows, carries the result
    assert page.splitlines()[0] == (
        "**CartPole-v1: winner it1-c0 (reward by eureka), return 187.5. "
        "3 candidate(s): 2 trained, 1 failed (1 timeout)**"
    )
    assert "**Winner:** [`eureka-s0/it1-c0`](#/experiments/7/runs/r10?workflowType=machine_learning)" in page
    assert "**Rule:** the highest `return`" in page
    assert "| LLM tokens | 900 prompt + 300 completion |" in page and "$0.0012" in page
    assert "| candidates | 3 (1 failed) |" in page and "| training frames | 2000 |" in page


def test_the_winning_code_cannot_close_its_fence_early():
    page = _page()
    code = page.split("## Winning code", 1)[1]
    fence = re.search(r"^(`{3,})python$", code, re.M).group(1)
    assert len(fence) == 4  # the code holds a run of three
    body = code.split(fence + "python\n", 1)[1].split("\n" + fence + "\n", 1)[0]
    assert body == CODE_WITH_FENCES.rstrip()
    assert code.index("## Cost") > code.index("\n" + fence + "\n")


def test_a_run_without_winner_says_so():
    history = _history()
    for it in history:
        it.results = [TrainResult(r.candidate_id, ok=False, error_kind="sandbox") for r in it.results]
    page = _page(history=history, best=None)
    assert page.startswith("**CartPole-v1: no winner. 3 candidate(s): 0 trained, 3 failed (3 sandbox)**")
    assert "Winning code" not in page
    assert page.count("| sandbox |") == 3


def test_a_long_page_fits_the_tag_limit_and_keeps_the_winner():
    history = _history()
    big = "def compute_reward(s, a, n):\n" + "    x = 1  # padding\n" * 2000 + "    return x\n"
    history[1].candidates[0].reward.source = big
    history[0].candidates += [_candidate(i) for i in range(2, 300)]
    history[0].results += [_ok(f"it0-c{i}", float(i % 50), f"r{i}") for i in range(2, 300)]
    page = _page(history=history)
    assert len(page) <= run_page.TAG_LIMIT
    assert "(winner)" in page and "more candidate(s)" in page and "# ... (cut here" in page
    assert page.rstrip().endswith("|")  # the cost table survived


def test_a_candidate_page_links_its_parent_and_shows_its_error():
    c = _candidate(1)
    failed = TrainResult(
        "it0-c1", ok=False, error="Traceback\n  ...\nZeroDivisionError: x", error_kind="ZeroDivisionError"
    )
    page = run_page.candidate_page(
        candidate=c, result=failed, parent_name="eureka-s0", parent_id="p1", experiment_id="7"
    )
    first, _, second, *_ = page.splitlines()
    assert first == "**Failed: ZeroDivisionError: x**"  # why, first: not "return = -"
    assert second.startswith(
        "Candidate `it0-c1` of run [`eureka-s0`](#/experiments/7/runs/p1?workflowType=machine_learning)"
    )
    assert "not scored" in second and "= -" not in page and "## Error (ZeroDivisionError)" in page
    failed.error_kind = "exception"
    assert run_page.status_of(failed) == "exception: ZeroDivisionError"
    assert "## reward: `compute_reward` from `eureka`" in page and "Winner" not in page
    won = run_page.candidate_page(
        candidate=c,
        result=_ok("it0-c1", 3.0),
        parent_name="eureka-s0",
        parent_id="p1",
        experiment_id="7",
        winner=run_page.winner_rule("return"),
    )
    assert "**Winner of the run.** Rule: the highest `return`" in won
    assert won.startswith("**`fitness` = 3** (winner of the run), 1000 frames in 2.5 s.")
    rejected = TrainResult(
        "it0-c1", ok=False, error="No code block in the reply.\nWrite the function in a block.", error_kind="rejected"
    )
    assert run_page.candidate_page(
        candidate=c, result=rejected, parent_name="eureka-s0", parent_id="p1", experiment_id="7"
    ).startswith("**Failed (rejected): No code block in the reply.**")


def test_a_failures_reason_is_one_line():
    def failed(error: str) -> TrainResult:
        return TrainResult("c", ok=False, error=error, error_kind="exception")

    assert (
        run_page.reason(failed("Traceback (most recent call last):\n  File x\nNameError: name 'y' is not defined\n"))
        == "NameError: name 'y' is not defined"
    )
    assert (
        run_page.reason(failed("\n# vetting: pays more for failing\nthe details\n")) == "vetting: pays more for failing"
    )
    assert (
        run_page.reason(failed("The code reads names that do not exist:\n- next_state['x'] (no such field)\n"))
        == "The code reads names that do not exist: next_state['x'] (no such field)"
    )
    # the list of the state's fields the sandbox puts first for the LLM's repair is not the reason
    fields = "The state has exactly these fields: health, food, wood.\n"
    assert (
        run_page.reason(failed(fields + "the reward must be a torch tensor, got NoneType."))
        == "the reward must be a torch tensor, got NoneType."
    )
    assert (
        run_page.reason(failed(fields + "Traceback (most recent call last):\n  File x\nRuntimeError: ambiguous"))
        == "RuntimeError: ambiguous"
    )
    assert len(run_page.reason(failed("x" * 1000))) == run_page.REASON_CHARS
    assert run_page.reason(_ok("c", 1.0)) == ""


def test_the_baseline_has_no_code_to_show():
    page = run_page.code_section(Candidate("it0-c0", 0))
    assert "the env's own reward" in page


def test_table_cells_cannot_break_the_table():
    assert run_page.cell("a|b\nc") == "a\\|b c"
    assert run_page.number(float("nan")) == "NaN" and run_page.number(None) == "-"
    assert run_page.number(float("-inf")) == "-" and run_page.number(487.312) == "487.3"
