"""The runs a study's report counted, archived beside it (``<report folder>/runs.jsonl.gz``): the
file's round trip."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from core.errors import UserError
from core.report.archive import TRAIN_POINTS, archive_path, from_record, read_runs, to_record, write_runs
from core.report.data import FAILED, OK, StudyRun

STUDY = "arch"


def _run(**kw) -> StudyRun:
    base = dict(run_id="r1", name="human-cartpole-s0", env="cartpole", plugins="none", seed=0, status=OK)
    return StudyRun(**{**base, **kw})


# -- the file --------------------------------------------------------------------------------


def test_a_run_survives_the_round_trip_with_what_the_report_reads(tmp_path):
    train = [(i * 100, 1.0 / 3 + i) for i in range(1000)]  # one point per update of a long training
    run = _run(
        fitness=123.456789012345,
        fitness_name="return",
        metrics={"fitness": 123.456789012345, "llm/latency_s": 0.1 + 0.2, "study/seconds": float("nan")},
        training_metrics={"llm/changed_share": 0.8},
        params={"trainer.lr": "0.001"},
        tags={"study.cell": "k", "study.commit": "abc", "mlflow.user": "someone", "mlflow.note.content": "x" * 5000},
        curve=[(0, 9.87654321), (500, 187.123456)],
        train_curve=train,
        start_time=1234,
        arm="human",
        mlflow_status="FINISHED",
    )
    failed = _run(run_id="r2", seed=1, status=FAILED, fitness=None, note="all 2 candidate(s) failed")
    path = tmp_path / "report" / "runs.jsonl.gz"
    assert write_runs(path, STUDY, [run, failed]) == 2
    back, again = read_runs(path, STUDY)
    # what the statistics and tables read is exact
    assert back.fitness == run.fitness and back.metrics["llm/latency_s"] == 0.1 + 0.2
    assert back.metrics["study/seconds"] != back.metrics["study/seconds"]  # NaN stays NaN
    assert back.training_metrics == run.training_metrics
    assert (back.status, back.mlflow_status, back.arm, back.start_time, back.fitness_name) == (
        OK,
        "FINISHED",
        "human",
        1234,
        "return",
    )
    assert (again.status, again.fitness, again.note) == (FAILED, None, "all 2 candidate(s) failed")
    # MLflow's own tags (the user, the run page) and the config params are not kept
    assert back.tags == {"study.cell": "k", "study.commit": "abc"} and back.params == {}
    # curves are drawn: values to 4 significant digits, a long training-return curve thinned
    assert back.curve == [(0, 9.877), (500, 187.1)]
    assert len(back.train_curve) == TRAIN_POINTS
    assert back.train_curve[0] == (0, 0.3333) and back.train_curve[-1] == (99_900, 999.3)
    assert from_record(to_record(back)) == back  # a second round trip changes nothing
    first = path.read_bytes()
    write_runs(path, STUDY, [back, again])
    assert path.read_bytes() == first  # the same runs, the same bytes: no churn in the committed file
    assert path.stat().st_size < 6000
    with gzip.open(path, "rt") as f:
        assert json.loads(f.readline()) == {"format": "llm4rl.study-runs", "version": 1, "study": STUDY}


def test_an_archive_of_another_study_or_not_an_archive_is_refused(tmp_path):
    path = tmp_path / "runs.jsonl.gz"
    assert read_runs(path, STUDY) == []  # none yet
    write_runs(path, "other", [_run()])
    with pytest.raises(UserError, match="holds runs of the study 'other', not 'arch'.*--no-archive"):
        read_runs(path, STUDY)
    path.write_bytes(gzip.compress(b'{"key": 1}\n'))
    with pytest.raises(UserError, match="Cannot read the study's archive"):
        read_runs(path, STUDY)
    assert archive_path(Path("docs/results.md")) == Path("docs/results/runs.jsonl.gz")
