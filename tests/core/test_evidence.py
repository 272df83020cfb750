"""What a study's scores can show, checked by hand: calibration, intent to treat, targets
judged with intervals, controls, the LLM's contribution and the aggregate's bootstrap."""

from __future__ import annotations

import numpy as np
import pytest

from core.report.contribution import Contribution, contribution
from core.report.data import FAILED, OK, UNFINISHED, StudyRun
from core.report.evidence import (
    Calibration,
    Scored,
    aggregate,
    bounds,
    check_target,
    compare_variants,
    controls_of,
    score,
    variant_pairs,
)
from core.report.stats import (
    Interval,
    average_improvement,
    final_score_intervals,
    iqm,
    rank_test_p,
    stratified_iqm,
)
from core.report.study import ArmResult
from core.study import ArmSpec, StudySpec, TargetSpec

REPS = 300


def _arm(name: str, scores: list[float], failed: int = 0) -> ArmResult:
    values = dict(enumerate(scores))
    failures = {len(scores) + i: "no policy" for i in range(failed)}
    iqm_, mean = final_score_intervals(scores, REPS)
    return ArmResult(name, values, failures, [], 0, iqm_, mean, {})


def _cell(
    task: str,
    name: str,
    scores: list[float],
    failed: int = 0,
    search: bool = False,
    random: float = 0.0,
    llm: list[float] | None = None,
) -> Scored:
    kind = Contribution("none") if llm is None else Contribution("llm", values=llm)
    return score(task, name, _arm(name, scores, failed), search, kind, random, REPS)


def _ok(task: str = "t") -> Calibration:
    return Calibration(task, "human", 1.0, "", 2.0, 5, 0.0)


def test_calibration_lines_and_when_a_task_cannot_show_an_effect():
    assert _ok().ok and _ok().line() == "calibration: human 2 ≥ 1 — random 0"
    shaped = Calibration("mountaincar", "shaped", 0.5, "success rate", 0.88, 8, 0.0)
    assert shaped.line() == "calibration: shaped 0.88 ≥ 0.5 (success rate) — random 0"
    missed = Calibration("pendulum", "human", -200.0, "note", -900.0, 5, float("nan"))
    assert not missed.ok and missed.reason() == "human -900 < -200"
    assert (
        missed.line()
        == "calibration: human -900 < -200 (note) — random not run: **cannot show an effect at this budget**"
    )
    unset = Calibration("hopper", "human", None, "", 300.0, 5, 10.0)
    assert not unset.ok and unset.reason() == "no calibration threshold" and "no threshold set" in unset.line()
    not_run = Calibration("reach", "human", 0.5, "", float("nan"), 0, 0.0)
    assert not not_run.ok and not_run.reason() == "its calibration arm human has not run"


def test_a_task_with_no_solved_score_is_calibrated_by_beating_the_random_policy():
    from core.report.evidence import calibrate
    from core.report.render import number
    from core.study_records import CalibrationSpec, TaskSpec

    task = TaskSpec(env="minecraft", frames=1000, calibration=CalibrationSpec(beats="random", note="no solved score"))
    random = _arm("random", [1.4, 1.5, 1.6, 1.5, 1.45])
    learned = calibrate(
        "crafter", task, {"human": _arm("human", [2.1, 2.4, 1.9, 2.2, 2.6]), "random": random}, "random", REPS
    )
    assert learned.ok and learned.reason() == ""
    assert learned.line() == (
        f"calibration: human 2.23 beats random, P(X > Y) 1 [1, 1], rank p {number(learned.rank_p)} (no solved score)"
        " — random 1.48"
    )
    assert learned.rank_p == rank_test_p([2.1, 2.4, 1.9, 2.2, 2.6], [1.4, 1.5, 1.6, 1.5, 1.45]) < 0.025
    overlap = calibrate(
        "crafter", task, {"human": _arm("human", [1.3, 2.4, 1.5, 1.4, 1.6]), "random": random}, "random", REPS
    )
    assert not overlap.ok and overlap.reason().startswith("human does not beat random: P ")
    assert overlap.line().endswith("**cannot show an effect at this budget**")
    few = calibrate("crafter", task, {"human": _arm("human", [2.0]), "random": random}, "random", REPS)
    assert not few.ok and few.reason() == "human or random has fewer than 2 scores"


def test_a_failed_search_scores_the_random_arms_iqm():
    cell = _cell("t", "eureka", [10.0, 12.0, 14.0], failed=2, search=True, random=-5.0)
    assert cell.counted == {0: 10.0, 1: 12.0, 2: 14.0, 3: -5.0, 4: -5.0}
    assert cell.itt.value == pytest.approx(iqm(np.array([10.0, 12.0, 14.0, -5.0, -5.0])))
    no_random = _cell("t", "eureka", [10.0, 12.0], failed=1, search=True, random=float("nan"))
    assert no_random.no_itt and no_random.counted == {0: 10.0, 1: 12.0}
    one_training = _cell("t", "human", [1.0, 2.0], failed=1)
    assert one_training.counted == {0: 1.0, 1: 2.0} and not np.isfinite(one_training.itt.value)


def test_beats_needs_the_interval_of_p_above_one_half():
    beats = TargetSpec(arm="x", relation="beats", other="y", tasks=["t"])
    y = _cell("t", "y", [0.0, 1.0, 2.0, 3.0])
    overlapping = {("t", "x"): _cell("t", "x", [1.0, 2.0, 3.0, 10.0]), ("t", "y"): y}
    result = check_target(beats, overlapping, {"t": _ok()}, ["t"], [], REPS)
    assert iqm(np.array([1.0, 2.0, 3.0, 10.0])) > iqm(np.array([0.0, 1.0, 2.0, 3.0]))  # a higher IQM ...
    assert result.verdict == "missed" and result.tasks[0].text.endswith(": fails")  # ... is not a win
    clear = {("t", "x"): _cell("t", "x", [10.0, 11.0, 12.0, 13.0]), ("t", "y"): y}
    result = check_target(beats, clear, {"t": _ok()}, ["t"], [], REPS)
    assert result.verdict == "met" and "P(X > Y) 1 [1, 1], rank test p 0.014" in result.tasks[0].text


def test_beats_needs_the_exact_rank_test_where_the_bootstrap_collapses():
    """3 runs against 3, fully separated: the bootstrap says 1 [1, 1], chance gives it 1 time in 20."""
    beats = TargetSpec(arm="x", relation="beats", other="y", tasks=["t"])
    cells = {("t", "x"): _cell("t", "x", [10.0, 11.0, 12.0]), ("t", "y"): _cell("t", "y", [0.0, 1.0, 2.0])}
    result = check_target(beats, cells, {"t": _ok()}, ["t"], [], REPS)
    assert "P(X > Y) 1 [1, 1], rank test p 0.05" in result.tasks[0].text
    assert result.verdict == "missed" and result.tasks[0].text.endswith(": fails")
    assert rank_test_p([10.0, 11.0, 12.0], [0.0, 1.0, 2.0]) == pytest.approx(1 / 20)
    assert rank_test_p([0.0, 1.0, 2.0], [10.0, 11.0, 12.0]) == pytest.approx(1.0)


def test_matches_states_its_intervals_and_a_single_run_scores_nothing():
    matches = TargetSpec(arm="x", relation="matches", other="y", tolerance=0.1, tasks=["t"])
    cells = {("t", "x"): _cell("t", "x", [9.0, 9.5, 10.0]), ("t", "y"): _cell("t", "y", [10.0, 10.0, 10.0])}
    result = check_target(matches, cells, {"t": _ok()}, ["t"], [], REPS)
    assert result.verdict == "met"
    assert result.tasks[0].text.startswith("t: x 9.5 [9, 10] vs y 10 [10, 10], P(X > Y) ")
    cells[("t", "x")] = _cell("t", "x", [30.0])
    result = check_target(matches, cells, {"t": _ok()}, ["t"], [], REPS)
    assert result.verdict == "not scored" and result.tasks[0].reason == "x has one run (n=1, no CI)"


def test_no_target_on_an_uncalibrated_task_an_inert_arm_or_a_task_not_planned():
    beats = TargetSpec(arm="x", relation="beats", other="y", tasks=["t", "u"])
    cells = {
        ("t", "x"): _cell("t", "x", [10.0, 11.0, 12.0, 13.0], llm=[0.0, 0.0, 0.0, 0.0]),
        ("t", "y"): _cell("t", "y", [0.0, 1.0, 2.0, 3.0]),
    }
    uncalibrated = Calibration("t", "human", 5.0, "", 1.0, 3, 0.0)
    result = check_target(beats, cells, {"t": uncalibrated}, ["t", "u"], [], REPS)
    assert [v.reason for v in result.tasks] == [
        "the task cannot show an effect at this budget (human 1 < 5)",
        "not planned in this run of the study",
    ]
    assert result.verdict == "not scored"
    result = check_target(beats, cells, {"t": _ok()}, ["t"], [], REPS)
    assert result.tasks[0].reason == "x is inert here (its LLM put nothing into any run that trained a policy)"
    cells[("t", "x")] = _cell(
        "t", "x", [10.0, 11.0, 12.0, 13.0], llm=[0.0, 2.0, 0.0, 0.0]
    )  # its LLM did something once
    assert check_target(beats, cells, {"t": _ok()}, ["t"], [], REPS).verdict == "met"


def test_a_search_that_failed_every_seed_fails_its_target():
    """Its user got the random policy from every seed: a failure, not a gap."""
    beats = TargetSpec(arm="x", relation="beats", other="y", tasks=["t"])
    cells = {
        ("t", "x"): _cell("t", "x", [], failed=3, search=True, random=-10.0),
        ("t", "y"): _cell("t", "y", [0.0, 1.0, 2.0]),
    }
    assert cells[("t", "x")].counted == {0: -10.0, 1: -10.0, 2: -10.0}
    result = check_target(beats, cells, {"t": _ok()}, ["t"], [], REPS)
    assert result.verdict == "missed"
    assert result.tasks[0].text.endswith("3 failed search(es) of x scored as the random policy: fails")


def test_a_search_without_a_random_score_for_its_failures_scores_no_target():
    beats = TargetSpec(arm="x", relation="beats", other="y", tasks=["t"])
    cells = {
        ("t", "x"): _cell("t", "x", [10.0, 11.0], failed=1, search=True, random=float("nan")),
        ("t", "y"): _cell("t", "y", [0.0, 1.0, 2.0]),
    }
    result = check_target(beats, cells, {"t": _ok()}, ["t"], [], REPS)
    assert result.verdict == "not scored" and "the random arm has not run" in result.tasks[0].reason


def test_a_target_is_judged_against_the_arms_control():
    matches = TargetSpec(arm="x", relation="matches", other="human", tasks=["t"])
    cells = {
        ("t", "x"): _cell("t", "x", [10.0, 11.0, 12.0, 11.5]),
        ("t", "human"): _cell("t", "human", [10.0, 10.5, 11.0, 11.0]),
        ("t", "x_no_llm"): _cell("t", "x_no_llm", [10.0, 11.0, 12.0, 11.5]),
    }
    result = check_target(matches, cells, {"t": _ok()}, ["t"], ["x_no_llm"], REPS)
    assert result.verdict == "missed"
    assert "against its control x_no_llm: P(X > x_no_llm) 0.5 [" in result.tasks[0].text
    cells[("t", "x_no_llm")] = _cell("t", "x_no_llm", [1.0, 2.0, 3.0, 2.5])  # without its LLM it is much worse
    assert check_target(matches, cells, {"t": _ok()}, ["t"], ["x_no_llm"], REPS).verdict == "met"
    del cells[("t", "x_no_llm")]
    result = check_target(matches, cells, {"t": _ok()}, ["t"], ["x_no_llm"], REPS)
    assert result.verdict == "not scored" and "its control x_no_llm has no scores" in result.tasks[0].reason
    # beats a control: the target is itself the control's judgement
    beats = TargetSpec(arm="x", relation="beats", other="sparse", tasks=["t"])
    cells = {
        ("t", "x"): _cell("t", "x", [10.0, 11.0, 12.0, 13.0]),
        ("t", "sparse"): _cell("t", "sparse", [0.0, 1.0, 2.0, 3.0]),
        ("t", "human"): _cell("t", "human", [20.0, 21.0, 22.0, 23.0]),
    }
    result = check_target(beats, cells, {"t": _ok()}, ["t"], ["sparse", "human"], REPS)
    assert result.verdict == "met" and result.tasks[0].text.endswith("; sparse is its control: holds")


def test_the_controls_of_an_arm():
    spec = StudySpec(
        arms={
            "sparse": ArmSpec(),
            "human": ArmSpec(),
            "eureka": ArmSpec(plugins=["eureka"], search=True),
            "progress_reward": ArmSpec(plugins=["progress_reward"]),
            "progress_no_llm": ArmSpec(plugins=["progress_reward"], control_of="progress_reward"),
        }
    )
    assert controls_of(spec, "progress_reward") == ["progress_no_llm"]
    assert controls_of(spec, "eureka") == ["sparse", "human"]
    assert controls_of(spec, "human") == [] and controls_of(spec, "progress_no_llm") == []


def test_a_target_over_a_share_of_tasks_is_met_missed_or_not_scored():
    matches = TargetSpec(arm="x", relation="matches", other="y", share=0.5)
    good, bad = [10.0, 11.0, 12.0], [0.0, 1.0, 2.0]
    cells = {}
    for task, xs in (("a", good), ("b", bad), ("c", good), ("d", bad)):
        cells[(task, "x")], cells[(task, "y")] = _cell(task, "x", xs), _cell(task, "y", [5.0, 5.0, 5.0])
    calibrations = {t: _ok(t) for t in "abcd"}
    result = check_target(matches, cells, calibrations, list("abcd"), [], REPS)
    assert result.verdict == "met" and result.reason == "holds on 2 of 4 task(s); needs 50%"
    calibrations["a"] = Calibration("a", "human", None, "", 1.0, 3, 0.0)  # 1 holds, 2 fail, 1 open: could reach 2
    result = check_target(matches, cells, calibrations, list("abcd"), [], REPS)
    assert result.verdict == "not scored" and result.reason.endswith(
        "a: the task cannot show an effect at this budget (no calibration threshold)"
    )
    cells[("c", "x")] = _cell("c", "x", bad)  # 0 hold, 3 fail, 1 open: cannot reach 2
    assert check_target(matches, cells, calibrations, list("abcd"), [], REPS).verdict == "missed"


def test_the_llms_contribution_per_run():
    def run(status: str = OK, metrics: dict | None = None, training: dict | None = None) -> StudyRun:
        return StudyRun(
            "id", "n", "crafter", "x", 0, status, 1.0, metrics=metrics or {}, training_metrics=training or {}
        )

    search = ArmSpec(plugins=["eureka"], search=True)
    c = contribution(
        search,
        [
            run(metrics={"llm_programs_trained": 3.0, "candidates": 4.0}),
            run(metrics={"llm_programs_trained": 0.0, "candidates": 4.0}),
            run(FAILED, metrics={"llm_programs_trained": 0.0, "candidates": 4.0}),  # no policy
            run(UNFINISHED, metrics={"llm_programs_trained": 0.0}),
        ],
    )  # still going
    assert c.values == [3.0, 0.0] and not c.inert
    assert c.text() == "candidates trained with an LLM's program: 1.5 of 4 per run, 0 on 1 of 2 runs"
    failed = contribution(search, [run(FAILED, metrics={"llm_programs_trained": 0.0})] * 2)
    assert not failed.inert and failed.text() == "no run with a policy"  # a failure, scored as one (ITT)
    rlaif = ArmSpec(plugins=["rlaif_preference"])
    labels = {"preference/labels": 10.0, "preference/heldout_agreement": 0.5, "llm/changed_share": 0.0}
    c = contribution(rlaif, [run(training=labels), run(training=labels)])
    assert c.values == [0.0, 0.0] and c.inert
    assert c.text().startswith("**inert** (share of steps whose reward the learned preference term changed: 0 per run")
    judge = ArmSpec(plugins=["progress_reward"])
    c = contribution(
        judge,
        [
            run(
                training={
                    "llm/changed_share": 0.5,
                    "summary/llm/changed_share": 0.9,
                    "judge/rank_correlation": 0.4,
                    "judge/llm_term_std": 0.08,
                    "summary/judge/llm_term_std": 0.25,
                }
            )
        ],
    )
    assert c.values == [0.9]  # the training's final figure, not the series' last point
    assert "rank correlation with reference progress 0.4" in c.text()
    assert "spread (std) of the LLM term 0.25" in c.text()  # the issue asks for the term's spread beside the states
    flat = {"llm/changed_share": 1.0, "preference/rm_loss": 0.693, "preference/term_spread": 0.001}
    c = contribution(rlaif, [run(training=flat)])
    assert not c.inert  # every step changed, by a term that hardly varies: the figures beside it say so
    assert "spread (std) of the preference term 0.001" in c.text() and "ln 2 = 0.693" in c.text()
    plan4mc = ArmSpec(plugins=["plan4mc"])
    # the LLM wrote every step of a plan that is the rules' own: it changed nothing the control does
    same_as_rules = {"plan4mc/changed_share": 0.0, "llm/changed_share": 0.0, "plan4mc/llm_written_share": 1.0}
    c = contribution(plan4mc, [run(training=same_as_rules)])
    assert c.inert and "differs from the rules' plan" in c.text()
    # an earlier commit logged the written share as llm/changed_share: not this measure
    assert contribution(plan4mc, [run(training={"llm/changed_share": 1.0})]).text() == "not measured"
    assert contribution(ArmSpec(plugins=["some_plugin"]), [run()]).text() == "not measured"
    assert contribution(ArmSpec(plugins=["eureka"], search=True), [run()]).text() == "not measured"  # an older run
    for arm in (ArmSpec(), ArmSpec(plugins=["progress_reward"], control_of="progress_reward")):
        assert contribution(arm, [run()]).text() == "-" and not contribution(arm, [run()]).inert


def test_the_aggregate_is_the_iqm_of_normalised_scores_over_tasks():
    cells = {
        ("a", "random"): _cell("a", "random", [0.0, 0.0]),
        ("a", "human"): _cell("a", "human", [10.0, 10.0]),
        ("b", "random"): _cell("b", "random", [-100.0, -100.0]),
        ("b", "human"): _cell("b", "human", [-50.0, -50.0]),
        ("c", "random"): _cell("c", "random", [1.0, 1.0]),
        ("c", "human"): _cell("c", "human", [1.0, 1.0]),
        ("a", "x"): _cell("a", "x", [5.0, 10.0, 20.0]),
        ("b", "x"): _cell("b", "x", [-75.0, -50.0]),
        ("c", "x"): _cell("c", "x", [9.0, 9.0]),
    }
    scale = bounds(cells, ["a", "b", "c"], "random")
    assert scale == {"a": (0.0, 10.0), "b": (-100.0, -50.0)}  # c: human = random, nothing to normalise by
    (row,) = [r for r in aggregate(["random", "human", "x"], cells, scale, REPS) if r.arm == "x"]
    assert row.tasks == ["a", "b"] and row.runs == 5
    assert row.iqm.value == pytest.approx(iqm(np.array([0.5, 1.0, 2.0, 0.5, 1.0])))


def test_the_stratified_bootstrap_over_lists_is_rliables_on_equal_runs():
    from rliable import metrics

    from core.report.stats import _intervals

    rng = np.random.default_rng(0)
    matrix = rng.normal(size=(10, 3))  # 10 runs on each of 3 tasks
    ours = stratified_iqm([list(matrix[:, j]) for j in range(3)], reps=2000)
    point, bounds_ = _intervals(lambda s: np.array([metrics.aggregate_iqm(s)]), matrix, reps=2000, seed=0)
    assert ours.value == pytest.approx(point[0])
    assert ours.low == pytest.approx(bounds_[0, 0], abs=0.06) and ours.high == pytest.approx(bounds_[1, 0], abs=0.06)
    assert stratified_iqm([[1.0], [2.0]]) == Interval(1.5, 1.5, 1.5)  # one run per task: nothing to resample
    ragged = stratified_iqm([[0.0, 1.0, 2.0, 3.0], [10.0]], reps=500)
    assert ragged.low <= ragged.value <= ragged.high


def test_the_variants_of_one_method_are_the_arms_with_the_same_plugins():
    spec = StudySpec(
        arms={
            "human": ArmSpec(),
            "sparse": ArmSpec(overrides=["env.reward=sparse"]),
            "eureka": ArmSpec(plugins=["eureka"], search=True),
            "eureka_1x8": ArmSpec(plugins=["eureka"], search=True),
            "text2reward": ArmSpec(plugins=["text2reward"], search=True),
            "progress_reward": ArmSpec(plugins=["progress_reward"]),
            "progress_no_llm": ArmSpec(plugins=["progress_reward"], control_of="progress_reward"),
        }
    )
    assert variant_pairs(spec) == [("eureka", "eureka_1x8"), ("progress_reward", "progress_no_llm")]


def test_variants_are_compared_both_ways_and_over_tasks():
    cal = {"a": _ok("a"), "b": _ok("b"), "c": Calibration("c", "human", 1.0, "", 0.0, 5, 0.0)}
    better = [10.0, 11.0, 12.0, 13.0]
    worse = [0.0, 1.0, 2.0, 3.0]
    cells = {
        ("a", "x"): _cell("a", "x", better),
        ("a", "y"): _cell("a", "y", worse),
        ("b", "x"): _cell("b", "x", better),
        ("b", "y"): _cell("b", "y", worse),
        ("c", "x"): _cell("c", "x", worse),  # c cannot show an effect: left out
        ("c", "y"): _cell("c", "y", better),
    }
    c = compare_variants("x", "y", cells, cal, ["a", "b", "c"], REPS)
    assert c.tasks == ["a", "b"] and c.answer == "x better" and c.overall.value == 1.0
    assert c.lines[0].endswith(": x better") and "rank test p 0.014 (X > Y) and 1 (Y > X)" in c.lines[0]
    assert "c: not compared: the task cannot show an effect" in c.lines[2]
    reverse = compare_variants("y", "x", cells, cal, ["a", "b"], REPS)
    assert reverse.answer == "x better" and reverse.lines[0].endswith(": x better")  # read the other way round
    three = {("a", "x"): _cell("a", "x", better[:3]), ("a", "y"): _cell("a", "y", worse[:3])}
    assert compare_variants("x", "y", three, cal, ["a"], REPS).lines[0].endswith("no difference shown")  # p 0.05
    mixed = {("a", "x"): _cell("a", "x", [1.0, 4.0, 2.0, 6.0]), ("a", "y"): _cell("a", "y", [3.0, 5.0, 0.0, 7.0])}
    held = compare_variants("x", "y", mixed, cal, ["a"], REPS)
    assert held.answer.startswith("no difference shown") and held.overall.low < 0.5 < held.overall.high
    one = {("a", "x"): _cell("a", "x", [1.0]), ("a", "y"): _cell("a", "y", worse)}
    assert compare_variants("x", "y", one, cal, ["a"], REPS).answer.startswith("not compared")


def test_the_average_probability_of_improvement_is_rliables():
    from rliable import metrics

    rng = np.random.default_rng(1)
    x, y = rng.normal(0.3, 1, size=(6, 3)), rng.normal(0, 1, size=(6, 3))
    ours = average_improvement([(list(x[:, j]), list(y[:, j])) for j in range(3)], reps=500)
    assert ours.value == pytest.approx(metrics.probability_of_improvement(x, y))
    assert ours.low < ours.value < ours.high
    assert average_improvement([([1.0, 2.0], [])]).value != average_improvement([([1.0, 2.0], [])]).value  # NaN
