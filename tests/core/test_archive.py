"""The runs a study's report counted, archived beside it (``<report folder>/runs.jsonl.gz``): the
file's round trip, how archived runs merge with a store's, and a report written from the
archive alone on a machine without the store."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import mlflow
import pytest
import yaml
from mlflow.entities import Metric
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf

import core.config
import core.loop
from core.errors import UserError
from core.report.archive import TRAIN_POINTS, archive_path, from_record, read_runs, to_record, write_runs
from core.report.data import FAILED, OK, StudyRun
from core.report.results import study_runs, write_results
from core.study import (
    FRESH_SCORE,
    ArmSpec,
    Cell,
    Invocation,
    PlannedCell,
    StudySpec,
    TaskSpec,
    expand,
    load_spec,
    main,
    plan,
)

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


# -- merging with a store --------------------------------------------------------------------


def _spec() -> StudySpec:
    return StudySpec(
        name=STUDY,
        store="s",
        out="o.md",
        seeds=[0, 1, 2],
        final_seeds=1,
        tasks={"cartpole": TaskSpec(env="cartpole", frames=1000), "pendulum": TaskSpec(env="pendulum", frames=1000)},
        arms={
            "human": ArmSpec(overrides=["env.reward=human"]),
            "picked": ArmSpec(search=True, tasks=["cartpole"]),
        },
    )


def _planned(spec: StudySpec, tasks: tuple[str, ...]) -> list[PlannedCell]:
    cells = []
    for task in tasks:
        for arm, a in spec.arms.items():
            if a.tasks is None or task in a.tasks:
                for seed in spec.seeds:
                    cell = Cell(arm, task, seed, (), (), a.search, spec.final_seeds if a.search else 0, 1000)
                    cells.append(PlannedCell(cell, OmegaConf.create({}), f"cfg-{cell.name}", f"key-{cell.name}"))
    return cells


class _Store:
    """A study's MLflow store with runs written as ``python -m core.study`` writes them (curves included)."""

    def __init__(self, root: Path, commit: str) -> None:
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        self.exp = self.client.create_experiment(STUDY, artifact_location=(root / "art").as_uri())
        self.commit = commit

    def log(
        self,
        task: str,
        arm: str,
        seed: int,
        value: float | None,
        start: int,
        *,
        tags: dict[str, str] | None = None,
        status: str = "FINISHED",
    ) -> str:
        """One cell's run at ``start`` (ms); a search arm's best candidate and its fresh-seed retraining."""
        name, search = f"{arm}-{task}-s{seed}", arm == "picked"
        base = {"env": task, "seed": str(seed), "plugins": "none", "fitness_name": "return", "study": STUDY}
        base |= {"study.arm": arm, "study.task": task, "study.config": f"cfg-{name}", "study.cell": f"key-{name}"}
        base |= {"study.score": FRESH_SCORE if search else "fitness", "study.commit": self.commit}
        base |= {"study.machine": f"machine {self.commit}", **(tags or {})}
        pid = self.client.create_run(self.exp, start_time=start, tags=base, run_name=name).info.run_id
        metrics = {"frames": 1000.0, "candidates": 1.0, "study/seconds": 5.0}
        for child, scale in [("it0-c0", 1.0)] + ([("it0-c0-seed" + str(seed + 1), 2.0)] if search else []):
            kid = self.client.create_run(
                self.exp,
                start_time=start,
                run_name=child,
                tags={MLFLOW_PARENT_RUN_ID: pid, "candidate": child, "seed": str(seed), "ok": "True"},
            ).info.run_id
            curve = [Metric("fitness", scale * (value or 0.0) * f / 1000, 0, f) for f in (250, 500, 1000)]
            self.client.log_batch(kid, metrics=curve)
            self.client.set_terminated(kid, "FINISHED")
        if value is not None:
            metrics |= {"fitness": value, **({FRESH_SCORE: 2 * value, "final/seeds": 2.0} if search else {})}
            self.client.set_tag(pid, "best_candidate", "it0-c0")
        self.client.log_batch(pid, metrics=[Metric(k, v, 0, 0) for k, v in metrics.items()])
        self.client.set_terminated(pid, status)
        return pid


@pytest.fixture(scope="module")
def sessions(tmp_path_factory) -> tuple[Path, _Store]:
    """Session 1 on one machine wrote its report and archive; session 2 on another has a fresh store."""
    root = tmp_path_factory.mktemp("archive")
    spec, out = _spec(), root / "docs" / "arch.md"
    first = _Store(root / "one", "c1")
    first.log("cartpole", "human", 0, 100.0, 1_000)
    first.log("cartpole", "human", 1, 110.0, 5_000)
    first.log("cartpole", "picked", 0, 50.0, 1_100)
    first.log("pendulum", "human", 0, -200.0, 1_200)
    invocation = Invocation("python -m core.study arch", "c1", "machine c1", 0.0, report_only=True)
    write_results(spec, _planned(spec, ("cartpole", "pendulum")), first.uri, out, invocation, reps=100, archived=[])
    archive = archive_path(out)
    runs = read_runs(archive, STUDY)
    stale = _run(run_id="old", name="human-cartpole-s2", seed=2, start_time=900, mlflow_status="FINISHED")
    stale.tags = {"study.config": "cfg-human-cartpole-s2", "study.cell": "older-code", "study.task": "cartpole"}
    stale.tags |= {"study.arm": "human"}
    gone = _run(run_id="gone", name="gone-cartpole-s0", start_time=800, mlflow_status="FINISHED")
    gone.tags = {"study.config": "cfg-gone", "study.cell": "key-gone", "study.task": "cartpole", "study.arm": "gone"}
    write_runs(archive, STUDY, runs + [stale, gone])

    second = _Store(root / "two", "c2")
    second.log("cartpole", "human", 0, 150.0, 9_000)  # a later attempt of a cell the archive has
    second.log("cartpole", "human", 1, None, 3_000, status="FAILED")  # an older attempt than the archive's
    second.log("cartpole", "picked", 1, 60.0, 9_100)
    return out, second


def test_the_store_and_the_archive_merge_one_run_per_cell_the_latest_attempt_counting(sessions):
    out, store = sessions
    spec = _spec()
    archived = read_runs(archive_path(out), STUDY)
    counted = study_runs(_planned(spec, ("cartpole",)), store.uri, STUDY, archived)
    chosen = {key: (r.fitness, r.tags["study.commit"]) for key, r in counted.chosen.items()}
    assert chosen == {
        ("cartpole", "human", 0): (150.0, "c2"),  # the store's later attempt replaces the archived one
        ("cartpole", "human", 1): (110.0, "c1"),  # archived, later than the store's failed attempt
        ("cartpole", "picked", 0): (100.0, "c1"),  # only in the archive: kept, scored as it was
        ("cartpole", "picked", 1): (120.0, "c2"),  # only in the store
    }
    a = counted.archive
    assert a.used and a.read == 6 and a.replaced == 1 and counted.retried == 1
    assert a.set_aside == 1  # a planned cell's run at older code
    assert sorted(r.name for r in a.unplanned) == ["gone-cartpole-s0", "human-pendulum-s0"]
    assert {counted.chosen[("cartpole", arm, s)].run_id for arm, s in (("human", 1), ("picked", 0))} == a.counted
    # the archived search run's curve is its fresh-seed retraining (2x), the one that scored
    assert counted.chosen[("cartpole", "picked", 0)].curve == [(250, 25.0), (500, 50.0), (1000, 100.0)]

    without = study_runs(_planned(spec, ("cartpole",)), store.uri, STUDY)
    assert set(without.chosen) == {("cartpole", "human", 0), ("cartpole", "human", 1), ("cartpole", "picked", 1)}
    assert without.chosen[("cartpole", "human", 1)].status == FAILED and not without.archive.used


def test_the_archive_is_rewritten_with_the_counted_runs_and_the_specs_other_cells(sessions):
    out, store = sessions
    spec, archive = _spec(), archive_path(out)
    before = archive.read_bytes()
    curves = out.parent / "arch" / "cartpole_curves.png"
    curves.unlink(missing_ok=True)
    try:
        invocation = Invocation("python -m core.study arch --tasks cartpole", "c2", "machine c2", 0.0)
        files = write_results(
            spec,
            _planned(spec, ("cartpole",)),
            store.uri,
            out,
            invocation,
            reps=100,
            archived=read_runs(archive, STUDY),
        )
        assert archive in files
        runs = read_runs(archive, STUDY)
        text = out.read_text()
    finally:
        archive.write_bytes(before)
    assert [(r.name, r.tags["study.commit"]) for r in runs] == [
        ("human-cartpole-s0", "c2"),
        ("human-cartpole-s1", "c1"),
        ("picked-cartpole-s0", "c1"),
        ("picked-cartpole-s1", "c2"),
        ("human-pendulum-s0", "c1"),  # a task this invocation did not plan: kept for the report that does
    ]  # the spec's order; the older code's run and the arm the spec no longer has are gone
    line = next(line for line in text.splitlines() if line.startswith("- Archive: "))
    assert line.startswith("- Archive: 2 of the 4 counted runs read from [arch/runs.jsonl.gz](arch/runs.jsonl.gz)")
    assert "recorded at `c1` (2 run(s))" in line
    assert "archived runs replaced by a later attempt in the store: 1" in line
    assert "archived runs of planned cells at other config or code, dropped: 1" in line
    assert "archived runs of no cell of the spec, dropped: 1" in line
    assert "it now holds 5 run(s), 1 of them of cells not planned in this invocation" in line
    assert "`c1` (2 run(s))" in next(line for line in text.splitlines() if line.startswith("- Commit: "))
    assert curves.exists()  # drawn from archived and stored curves alike


# -- the study command -------------------------------------------------------------------------


def _spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "arch.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "name": STUDY,
                "store": str(tmp_path / "store"),
                "out": str(tmp_path / "docs" / "arch.md"),
                "seeds": [0, 1, 2],
                "final_seeds": 1,
                "overrides": ["executor=inprocess", f"cache_dir={tmp_path / 'cache'}"],
                "tasks": {"cartpole": {"env": "cartpole", "frames": 512}},
                "arms": {
                    "random": {"trainer": "random"},
                    "sparse": {"overrides": ["env.reward=sparse"]},
                    "human": {"overrides": ["env.reward=human"]},
                },
            }
        )
    )
    return path


def test_a_report_from_the_archive_alone_is_the_report_from_the_store(tmp_path, monkeypatch):
    """Session 1's store wrote the report and its archive; on a machine without the store,
    ``--report-only`` writes the same report from the archive, and the study runs only the
    cells the archive has no finished run of."""
    monkeypatch.setattr(core.config, "framework_hash", lambda: "code")
    path = _spec_file(tmp_path)
    spec = load_spec(str(path))
    (tmp_path / "store").mkdir()
    store = _Store(tmp_path / "store", "c1")  # what session 1 ran, tagged with the keys the study plans
    scores = {"random": [9.0, 11.0, 10.0], "sparse": [20.0, 35.0, 25.0], "human": [180.0, 200.0, 195.0]}
    for i, p in enumerate(plan(expand(spec), STUDY, tmp_path / "store")):
        tags = p.tags(STUDY, "c1", "machine c1")
        crashed = p.cell.name == "human-cartpole-s2"
        value = None if crashed else scores[p.cell.arm][p.cell.seed]
        store.log(
            "cartpole", p.cell.arm, p.cell.seed, value, 10 * i, tags=tags, status="FAILED" if crashed else "FINISHED"
        )
    out = tmp_path / "docs" / "arch.md"
    common = [str(path), "--reps", "200", "--report-only"]
    assert main(common) == 0
    first = out.read_text()
    assert (
        "- Archive: none beside this document before; [arch/runs.jsonl.gz](arch/runs.jsonl.gz) now holds its 9" in first
    )

    elsewhere = tmp_path / "elsewhere" / "arch.md"  # another machine: a fresh store, the committed archive
    archive_path(elsewhere).parent.mkdir(parents=True)
    shutil.copy(archive_path(out), archive_path(elsewhere))
    fresh = ["--store", str(tmp_path / "fresh"), "--out", str(elsewhere)]
    assert main([*common, *fresh]) == 0
    second = elsewhere.read_text()
    assert second.split("## Summary")[1] == first.split("## Summary")[1]  # the same scores, tables, failures
    assert "| human | 2/3 |" in second and "`human-cartpole-s2`: failed" in second
    assert "- Archive: 9 of the 9 counted runs read from [arch/runs.jsonl.gz]" in second
    assert archive_path(elsewhere).read_bytes() == archive_path(out).read_bytes()  # rewritten unchanged
    for figure in ("cartpole_final.png", "cartpole_curves.png"):
        assert (elsewhere.parent / "arch" / figure).exists() and f"(arch/{figure})" in second

    calls: list[str] = []

    def crash(config, extra_plugins=(), tags=None):
        calls.append(str(config.run_name))
        raise RuntimeError("not trained in this test")

    monkeypatch.setattr(core.loop, "run_experiment", crash)
    assert main([str(path), "--reps", "200", *fresh]) == 1  # the crashed cell crashes again
    assert calls == ["human-cartpole-s2"]  # the archive's finished cells are not run again

    assert main([*common, *fresh, "--no-archive"]) == 0
    clean = elsewhere.read_text()
    assert "- Archive: not read (`--no-archive`); [arch/runs.jsonl.gz](arch/runs.jsonl.gz) now holds" in clean
    assert "| random | 3/3 |" not in clean and read_runs(archive_path(elsewhere), STUDY) == []
