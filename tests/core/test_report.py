"""The study report: numbers checked by hand on a synthetic study written to MLflow."""

from __future__ import annotations

from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID

from core.report import analyze, main
from core.report.data import FAILED, OK, StudyRun, assign_arms, load_study, varying_keys
from core.report.stats import final_score_intervals, improvement

BASELINE = [1.0, 2.0, 3.0, 4.0]  # seeds 0..3
EUREKA = [2.0, 4.0, 6.0, 100.0]  # seeds 0..3; seed 4 failed
CURVES = {  # (frames, fitness) of the best candidate per run, before the final value
    "none": [
        [(1000, 0.0), (2000, 1.0)],
        [(1000, 1.0), (2000, 2.0)],
        [(1000, 2.0), (2000, 3.0)],
        [(1000, 3.0), (2000, 4.0)],
    ],
}


def _log_run(
    client, exp: str, plugins: str, seed: int, fitness: float | None, curve: list[tuple[int, float]], lr: str = "0.001"
) -> None:
    parent = client.create_run(
        exp, run_name=f"{plugins}-s{seed}", tags={"plugins": plugins, "env": "cartpole", "seed": str(seed)}
    )
    pid = parent.info.run_id
    client.log_param(pid, "seed", str(seed))
    client.log_param(pid, "trainer.lr", lr)
    client.log_param(pid, "cache_dir", f"/tmp/x{seed}")  # differs per run but is bookkeeping
    child = client.create_run(
        exp,
        run_name="it0-c0",
        tags={MLFLOW_PARENT_RUN_ID: pid, "candidate": "it0-c0", "seed": str(seed), "ok": str(fitness is not None)},
    )
    for frames, value in curve:
        client.log_metric(child.info.run_id, "fitness", value, step=frames)
    client.set_terminated(child.info.run_id, "FINISHED" if fitness is not None else "FAILED")
    if fitness is None:  # a crashed run: no fitness, status FAILED
        client.set_terminated(pid, "FAILED")
        return
    client.log_metric(pid, "fitness", fitness)
    client.log_metric(pid, "llm/calls", 2.0 if plugins != "none" else 0.0)
    client.log_metric(pid, "seconds", 10.0)
    client.set_tag(pid, "best_candidate", "it0-c0")
    client.set_tag(pid, "fitness_name", "return")
    client.set_terminated(pid, "FINISHED")


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[str, Path]:
    """A 2-arm study on cartpole: 4 seeds each, plus a failed eureka run on seed 4."""
    root = tmp_path_factory.mktemp("study")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("abl", artifact_location=(root / "art").as_uri())
    for seed, value in enumerate(BASELINE):
        _log_run(client, exp, "none", seed, value, CURVES["none"][seed])
    for seed, value in enumerate(EUREKA):
        _log_run(client, exp, "eureka", seed, value, [(1000, value / 2), (2000, value)])
    _log_run(client, exp, "eureka", 4, None, [])
    return uri, root


def test_load_study_reads_status_fitness_and_curves(study) -> None:
    uri, _ = study
    runs = load_study(uri, "abl")
    assert len(runs) == 9  # parents only: nested candidate runs are not study runs
    failed = [r for r in runs if r.status == FAILED]
    assert [(r.plugins, r.seed) for r in failed] == [("eureka", 4)]
    assert failed[0].fitness is None and failed[0].note
    base0 = next(r for r in runs if r.plugins == "none" and r.seed == 0)
    assert base0.status == OK and base0.fitness == 1.0
    assert base0.curve == [(1000, 0.0), (2000, 1.0)]
    assert base0.training_metrics["fitness"] == 1.0  # the best candidate's run: its metrics at their last step


def test_hand_computed_statistics(study) -> None:
    uri, _ = study
    tasks = analyze(assign_arms(load_study(uri, "abl")), reps=500)
    (task,) = tasks
    arms = {a.arm: a for a in task.arms}
    assert set(arms) == {"baseline", "eureka"}  # trainer.lr is the same everywhere, cache_dir ignored
    base, eureka = arms["baseline"], arms["eureka"]
    # IQM of 4 values = mean of the middle two; the mean is the plain mean
    assert base.iqm.value == pytest.approx((2 + 3) / 2)
    assert eureka.iqm.value == pytest.approx((4 + 6) / 2)
    assert eureka.mean.value == pytest.approx(28.0)
    # P(X > Y): over the 16 run pairs, wins count 1 and ties 1/2
    wins = sum((x > y) + 0.5 * (x == y) for x in BASELINE for y in EUREKA)
    p = {(x, y): v for x, y, v in task.improvement}
    assert wins == 3.0
    assert p[("baseline", "eureka")].value == pytest.approx(wins / 16)
    assert p[("eureka", "baseline")].value == pytest.approx(1 - wins / 16)
    # intervals bracket the point and stay within the data
    for a in (base, eureka):
        assert min(a.scores.values()) <= a.iqm.low <= a.iqm.value <= a.iqm.high <= max(a.scores.values())
    # partial study: eureka's seed 4 failed, the baseline never ran it
    assert task.seeds == [0, 1, 2, 3, 4]
    assert list(eureka.failed) == [4] and eureka.missing == []
    assert base.missing == [4] and not base.failed
    assert "PARTIAL" in eureka.status() and "PARTIAL" in base.status()
    assert len(eureka.scores) == 4  # the failed run is not averaged in
    # curve: IQM over 4 runs at each frame = mean of the middle two
    assert base.curve["frames"] == [1000.0, 2000.0]
    assert base.curve["iqm"] == pytest.approx([1.5, 2.5])
    assert eureka.cost["llm/calls"] == 8.0 and base.cost["llm/calls"] == 0.0


def test_bootstrap_interval_hand_cases() -> None:
    # two runs {0, 1}: resampled means are 0, 0.5, 1 with prob 1/4, 1/2, 1/4 -> 95% CI [0, 1]
    _, mean = final_score_intervals([0.0, 1.0], reps=1000)
    assert (mean.low, mean.high) == (0.0, 1.0)
    # many runs: the percentile CI of the mean is close to mean +- 1.96 s / sqrt(n)
    values = list(np.random.default_rng(0).normal(10.0, 2.0, size=60))
    _, mean = final_score_intervals(values, reps=2000)
    half = 1.96 * np.std(values) / np.sqrt(len(values))
    assert mean.low == pytest.approx(np.mean(values) - half, abs=0.12)
    assert mean.high == pytest.approx(np.mean(values) + half, abs=0.12)
    # one run: the interval is the point; same seed -> same interval
    iqm, _ = final_score_intervals([3.0])
    assert (iqm.low, iqm.value, iqm.high) == (3.0, 3.0, 3.0)
    assert improvement([1, 2, 3], [2, 3, 4], seed=1) == improvement([1, 2, 3], [2, 3, 4], seed=1)


def test_arms_from_varying_config() -> None:
    def run(plugins: str, seed: int, **params: str) -> StudyRun:
        return StudyRun("id", "n", "cartpole", plugins, seed, OK, 1.0, params={"seed": str(seed), **params})

    runs = [
        run("none", 0, **{"trainer.lr": "0.1"}),
        run("none", 0, **{"trainer.lr": "0.2"}),
        run("eureka", 0, **{"plugins.eureka.samples": "4"}),
        run("eureka", 1, **{"plugins.eureka.samples": "4"}),
    ]
    assert varying_keys(runs) == ["trainer.lr"]
    assigned = [r.arm for r in assign_arms(runs)]
    assert assigned == ["baseline trainer.lr=0.1", "baseline trainer.lr=0.2", "eureka", "eureka"]
    assert [r.arm for r in assign_arms(runs, by=["plugins"])] == ["baseline", "baseline", "eureka", "eureka"]


def test_cli_writes_report_and_logs_it(study, tmp_path: Path, capsys) -> None:
    uri, _ = study
    out = tmp_path / "rep"
    assert main(["--experiment", "abl", "--uri", uri, "--out", str(out), "--reps", "500"]) == 0
    assert f"MLflow UI: python -m core.ui --uri {uri} --experiment abl" in capsys.readouterr().out
    md = (out / "report.md").read_text()
    assert "| baseline | 4/5 | 2.5 [" in md
    assert "PARTIAL" in md and "Runs left out of the statistics" in md
    assert "P(X > Y)" in md and "0.188 [" in md
    for name in ("cartpole_final.png", "cartpole_improvement.png", "cartpole_curves.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    html = (out / "report.html").read_text()
    assert "<table>" in html and 'src="cartpole_curves.png"' in html
    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("abl")
    (report,) = client.search_runs([exp.experiment_id], "tags.`llm4rl.report` = 'true'")
    logged = {f.path for f in client.list_artifacts(report.info.run_id, "report")}
    assert "report/report.md" in logged and "report/cartpole_curves.png" in logged
    # a second report ignores the first report run
    assert main(["--experiment", "abl", "--uri", uri, "--out", str(out), "--reps", "200", "--no-log"]) == 0
    assert len(load_study(uri, "abl")) == 9


def test_unknown_experiment_is_a_clear_error(study, capsys) -> None:
    uri, _ = study
    assert main(["--experiment", "nope", "--uri", uri, "--no-log"]) == 2
    assert "No MLflow experiment 'nope'" in capsys.readouterr().out


def test_a_run_cut_short_is_a_seed_not_run_yet_not_a_failure() -> None:
    """A study killed mid-cell leaves a RUNNING run: that seed is missing (to run), and only a
    real failure is failed."""
    from core.report.data import UNFINISHED
    from core.report.study import _arm_result

    runs = [
        StudyRun("a", "x-s0", "cartpole", "x", 0, OK, fitness=1.0),
        StudyRun("b", "x-s1", "cartpole", "x", 1, UNFINISHED),
        StudyRun("c", "x-s2", "cartpole", "x", 2, FAILED, note="every candidate failed"),
    ]
    arm = _arm_result("x", runs, [0, 1, 2, 3], reps=100, seed=0)
    assert arm.scores == {0: 1.0} and arm.failed == {2: "every candidate failed"} and arm.missing == [1, 3]
    assert arm.status() == "PARTIAL: failed seed 2 (every candidate failed); missing seed 1, 3"


def test_a_seed_run_twice_counts_by_its_latest_run() -> None:
    """Not the best of attempts: a later failed run of a seed is what the seed got, whatever finished before."""
    from core.report.study import _arm_result

    runs = [
        StudyRun("a", "x-s0", "cartpole", "x", 0, OK, fitness=5.0, start_time=1),
        StudyRun("b", "x-s0", "cartpole", "x", 0, FAILED, note="crashed", start_time=2),
        StudyRun("c", "x-s1", "cartpole", "x", 1, FAILED, note="crashed", start_time=3),
        StudyRun("d", "x-s1", "cartpole", "x", 1, OK, fitness=7.0, start_time=4),
    ]
    arm = _arm_result("x", runs, [0, 1], reps=100, seed=0)
    assert arm.scores == {1: 7.0} and arm.failed == {0: "crashed"} and arm.duplicates == 2
    assert arm.status() == (
        "PARTIAL: failed seed 0 (crashed); 2 repeated run(s) set aside (the latest of each seed counts)"
    )


def test_repeated_runs_set_aside_leave_an_arm_complete_in_the_console_and_the_report() -> None:
    """The console said "PARTIAL: 1 repeated run(s) set aside" while report.md said "complete"."""
    from core.report.render import render_markdown
    from core.report.study import _arm_result

    runs = [
        StudyRun("a", "x-s0", "cartpole", "x", 0, OK, fitness=5.0, start_time=1, params={"seed": "0"}),
        StudyRun("b", "x-s0", "cartpole", "x", 0, OK, fitness=6.0, start_time=2, params={"seed": "0"}),
    ]
    arm = _arm_result("x", runs, [0], reps=100, seed=0)
    said = "complete; 1 repeated run(s) set aside (the latest of each seed counts)"
    assert arm.complete and arm.status() == said  # the console's line
    md = render_markdown(analyze(assign_arms(runs), reps=100), runs, "abl", 100, {})
    assert f"| {said} |" in md and "PARTIAL" not in md.split("## cartpole", 1)[1]  # report.md says the same


def test_an_interrupted_run_is_unfinished_not_failed():
    from core.report.data import FAILED, OK, UNFINISHED, run_status

    assert run_status("KILLED", 500.0) == UNFINISHED  # ended by Ctrl-C or a session's end
    assert run_status("RUNNING", None) == UNFINISHED
    assert run_status("FAILED", None) == FAILED
    assert run_status("FINISHED", float("nan")) == FAILED
    assert run_status("FINISHED", 500.0) == OK
