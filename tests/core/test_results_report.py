"""The results document of a study, on a synthetic study written to MLflow: calibration,
intent-to-treat scores, the LLM's contribution, controls, targets judged with intervals,
the aggregate over tasks, and which run counts for a cell."""

from __future__ import annotations

import subprocess
from pathlib import Path

import mlflow
import numpy as np
import pytest
from mlflow.utils.mlflow_tags import MLFLOW_PARENT_RUN_ID
from omegaconf import OmegaConf

from core.report.data import REPORT_TAG
from core.report.results import study_runs, write_results
from core.report.stats import iqm
from core.study import (
    FRESH_SCORE,
    ArmSpec,
    CalibrationSpec,
    Cell,
    Invocation,
    PlannedCell,
    StudySpec,
    TargetSpec,
    TaskSpec,
)

HEAD = subprocess.run(
    ["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True
).stdout.strip()
EXPERIMENT = "synth"
RANDOM = {"cartpole": [10.0, 12.0, 9.0, 11.0], "mountaincar": [0.0, 0.0, 0.0], "pendulum": [-1200.0]}
HUMAN = {"cartpole": [190.0, 200.0, 205.0, 210.0], "mountaincar": [0.0, 0.0, 0.0], "pendulum": [-200.0]}
SPARSE = {"cartpole": [20.0, 25.0, 30.0], "mountaincar": [0.0, 0.0, 0.0]}  # cartpole seed 3: its latest attempt failed
SHAPED = [0.2, 0.4, 0.0]  # mountaincar: below its threshold 0.5
EUREKA = {0: 300.0, 1: 310.0, 3: 290.0}  # cartpole; seed 2 failed (every candidate)
PROGRESS = [220.0, 230.0, 215.0, 225.0]
NO_LLM = [221.0, 229.0, 216.0, 224.0]  # progress_reward's control: as good without the LLM
INERT = [100.0, 110.0, 120.0, 130.0]  # a search whose candidates never trained an LLM's program


def _spec() -> StudySpec:
    one = [0]
    return StudySpec(
        name=EXPERIMENT,
        title="Synthetic",
        store="s",
        out="o.md",
        seeds=[0, 1, 2, 3],
        final_seeds=1,
        tasks={
            "cartpole": TaskSpec(
                env="cartpole", frames=1000, calibration=CalibrationSpec(threshold=100.0, note="solved")
            ),
            "mountaincar": TaskSpec(
                env="mountaincar",
                frames=1000,
                seeds=[0, 1, 2],
                calibration=CalibrationSpec(arm="shaped", threshold=0.5, note="success rate"),
            ),
            "pendulum": TaskSpec(env="pendulum", frames=1000, seeds=one, calibration=CalibrationSpec(threshold=-500.0)),
        },
        arms={
            "random": ArmSpec(trainer="random"),
            "sparse": ArmSpec(overrides=["env.reward=sparse"], tasks=["cartpole", "mountaincar"]),
            "human": ArmSpec(overrides=["env.reward=human"]),
            "shaped": ArmSpec(tasks=["mountaincar"]),
            "eureka": ArmSpec(plugins=["eureka"], search=True, tasks=["cartpole", "mountaincar"]),
            "progress_reward": ArmSpec(plugins=["progress_reward"], tasks=["cartpole"]),
            "progress_no_llm": ArmSpec(plugins=["progress_reward"], tasks=["cartpole"], control_of="progress_reward"),
            "text2reward": ArmSpec(plugins=["text2reward"], search=True, tasks=["cartpole"]),
        },
        targets=[
            TargetSpec(arm="eureka", relation="beats", other="sparse", tasks=["cartpole", "mountaincar"]),
            TargetSpec(arm="progress_reward", relation="matches", other="human", tasks=["cartpole"]),
            TargetSpec(arm="text2reward", relation="beats", other="sparse"),
            TargetSpec(arm="human", relation="beats", other="sparse", tasks=["cartpole"]),
            TargetSpec(arm="human", relation="beats", other="random", tasks=["pendulum"]),
        ],
    )


def _planned(spec: StudySpec) -> list[PlannedCell]:
    cells = []
    for task, t in spec.tasks.items():
        for arm, a in spec.arms.items():
            if a.tasks is not None and task not in a.tasks:
                continue
            for seed in t.seeds or spec.seeds:
                cell = Cell(
                    arm, task, seed, tuple(a.plugins), (), a.search, spec.final_seeds if a.search else 0, t.frames
                )
                cells.append(PlannedCell(cell, OmegaConf.create({}), f"cfg-{cell.name}", f"key-{cell.name}"))
    return cells


class _Store:
    def __init__(self, root: Path) -> None:
        self.uri = f"sqlite:///{root / 'mlflow.db'}"
        self.client = mlflow.MlflowClient(tracking_uri=self.uri)
        self.exp = self.client.create_experiment(EXPERIMENT, artifact_location=(root / "art").as_uri())
        self.clock = 1_000_000

    def log(
        self,
        task: str,
        arm: str,
        seed: int,
        value: float | None,
        *,
        search: bool = False,
        code: str = "",
        status: str = "FINISHED",
        metrics: dict[str, float] | None = None,
        training: dict[str, float] | None = None,
    ) -> None:
        """One cell's run (``code``: another code key of the same config); ``value`` None: no policy."""
        name = f"{arm}-{task}-s{seed}"
        self.clock += 1000
        tags = {
            "env": task,
            "seed": str(seed),
            "plugins": "none",
            "study": EXPERIMENT,
            "study.arm": arm,
            "study.task": task,
            "study.config": f"cfg-{name}",
            "study.cell": code or f"key-{name}",
            "study.score": FRESH_SCORE if search else "fitness",
            "study.commit": HEAD,
            "study.machine": "m",
            "fitness_name": "return",
        }
        pid = self.client.create_run(self.exp, start_time=self.clock, tags=tags, run_name=name).info.run_id
        child = self.client.create_run(
            self.exp,
            start_time=self.clock,
            run_name="it0-c0",
            tags={MLFLOW_PARENT_RUN_ID: pid, "candidate": "it0-c0", "seed": str(seed), "ok": str(value is not None)},
        ).info.run_id
        for key, v in (training or {}).items():
            self.client.log_metric(child, key, v)
        self.client.set_terminated(child, "FINISHED")
        logged = {
            "frames": 1000.0 * (1 + search) if value is not None else 0.0,
            "candidates": 2.0 if search else 1.0,
            "study/seconds": 5.0,
            **(metrics or {}),
        }
        if value is not None:
            logged["fitness"] = value
            if search:
                logged.update({FRESH_SCORE: value, "final/frames": 1000.0, "final/seeds": 2.0})
            self.client.set_tag(pid, "best_candidate", "it0-c0")
        for key, v in logged.items():
            self.client.log_metric(pid, key, v)
        self.client.set_terminated(pid, status)


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> tuple[_Store, Path]:
    root = tmp_path_factory.mktemp("results")
    store = _Store(root)
    for task in RANDOM:
        for seed, (r, h) in enumerate(zip(RANDOM[task], HUMAN[task])):
            store.log(task, "random", seed, r)
            store.log(task, "human", seed, h)
    for task, values in SPARSE.items():
        for seed, v in enumerate(values):
            store.log(task, "sparse", seed, v)
    store.log("cartpole", "sparse", 0, 5000.0, code="older-code")  # the same config at other code: set aside
    store.log("cartpole", "sparse", 3, 999.0)  # finished, then tried again with the same key and failed:
    store.log("cartpole", "sparse", 3, None, status="FAILED")  # the latest attempt counts
    for seed, v in enumerate(SHAPED):
        store.log("mountaincar", "shaped", seed, v)
    for seed in range(4):
        value = EUREKA.get(seed)
        store.log(
            "cartpole", "eureka", seed, value, search=True, metrics={"llm_programs_trained": 2.0 if value else 0.0}
        )
        store.log("cartpole", "progress_reward", seed, PROGRESS[seed], training={"llm/changed_share": 0.8})
        store.log("cartpole", "progress_no_llm", seed, NO_LLM[seed], training={"llm/changed_share": 0.0})
        store.log("cartpole", "text2reward", seed, INERT[seed], search=True, metrics={"llm_programs_trained": 0.0})
    for seed in range(3):
        store.log("mountaincar", "eureka", seed, 0.0, search=True, metrics={"llm_programs_trained": 1.0})
    out = root / "docs" / "synth.md"
    spec = _spec()
    invocation = Invocation("python -m core.study synth", HEAD, "m", 0.0, report_only=True)
    write_results(spec, _planned(spec), store.uri, out, invocation, reps=300)
    return store, out


def _line(text: str, start: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(start))


def _row(text: str, task: str, arm: str) -> list[str]:
    """A per-task table's row of ``arm`` as cells."""
    section = text.split(f"\n## {task}: ")[1].split("\n## ")[0]
    return [c.strip() for c in _line(section, f"| {arm} |").split("|")[1:-1]]


def test_the_latest_run_of_the_cells_code_counts_and_others_are_set_aside(study):
    store, _ = study
    spec = _spec()
    counted = study_runs(_planned(spec), store.uri, EXPERIMENT)
    sparse3 = counted.chosen[("cartpole", "sparse", 3)]
    assert sparse3.status == "failed"  # not the earlier finished 999: no best of attempts
    assert counted.chosen[("cartpole", "sparse", 0)].fitness == 20.0  # not the older code's 5000
    assert counted.other_code == 1 and counted.retried == 1
    assert len(counted.runs) == len(counted.chosen) == len({(r.env, r.arm, r.seed) for r in counted.runs})


def test_the_summary_states_each_tasks_calibration_and_the_random_score(study):
    _, out = study
    text = out.read_text()
    summary = text.split("## Summary")[1].split("## Scores")[0]
    assert "- **cartpole**: calibration: human 202 ≥ 100 (solved) — random 10.5" in summary
    assert (
        "- **mountaincar**: calibration: shaped 0.2 < 0.5 (success rate) — random 0: "
        "**cannot show an effect at this budget**"
    ) in summary
    assert "- **pendulum**: calibration: human -200, n=1 ≥ -500 — random -1,200" in summary
    assert _line(text.split("\n## mountaincar: ")[1], "calibration:").endswith(
        "**cannot show an effect at this budget**"
    )


def test_one_run_has_no_interval(study):
    _, out = study
    text = out.read_text()
    assert "| pendulum (return) | -1,200 (n=1, no CI) | n/a | -200 (n=1, no CI) |" in text
    assert _row(text, "pendulum", "human")[2] == "-200 (n=1, no CI)"
    assert "  - pendulum: not scored: human has one run (n=1, no CI)" in text


def test_a_search_arm_shows_its_intent_to_treat_iqm_beside_the_conditional_one(study):
    _, out = study
    text = out.read_text()
    itt = iqm(np.array([*EUREKA.values(), iqm(np.array(RANDOM["cartpole"]))]))  # the failed search scores random's IQM
    conditional = iqm(np.array(list(EUREKA.values())))
    row = _row(text, "cartpole", "eureka")
    assert row[1] == "3/4" and row[2].startswith(f"{conditional:.3g} [")
    assert row[3].startswith(f"{itt:.3g} [") and row[3].endswith("(1)")
    assert _row(text, "cartpole", "human")[3] == "-"  # one training: no intent-to-treat column
    grid = _line(text, "| cartpole (return) |")
    assert f"(n=3/4, 1 failed); ITT {itt:.3g} [" in grid


def test_final_policy_frames_are_the_frames_as_trained(study):
    _, out = study
    assert _row(out.read_text(), "cartpole", "eureka")[9] == "1,000"  # not (3 x 1000 + 0) / 4 with the failed search


def test_the_llms_contribution_is_printed_and_an_inert_arm_is_marked(study):
    _, out = study
    text = out.read_text()
    # of the runs with a policy: the failed search is a failure (its ITT score), not an inert LLM
    assert _row(text, "cartpole", "eureka")[6] == "candidates trained with an LLM's program: 2 of 2 per run"
    assert (
        _row(text, "cartpole", "progress_reward")[6] == "share of steps whose reward the LLM term changed: 0.8 per run"
    )
    assert _row(text, "cartpole", "text2reward")[6].startswith("**inert** (")
    for arm in ("random", "sparse", "human", "progress_no_llm"):  # no LLM, or a control
        assert _row(text, "cartpole", arm)[6] == "-"
    assert "**inert**" in _line(text, "| cartpole (return) |").split("|")[-2]  # text2reward, the last column
    assert (
        "- **text2reward** beats **sparse** (95 % CI of P(X > Y) above 0.5, rank test p < 0.025) "
        "on the tasks both run: **not scored**" in text
    )
    assert (
        "  - cartpole: not scored: text2reward is inert here (its LLM put nothing into any run that trained a policy)"
        in text
    )


def test_targets_need_intervals_calibrated_tasks_and_the_controls(study):
    _, out = study
    targets = out.read_text().split("\n## Targets")[1].split("\n## ")[0]
    # eureka's higher IQM is not enough: with its failed search as random, P(X > Y)'s CI reaches below 0.5
    assert (
        "- **eureka** beats **sparse** (95 % CI of P(X > Y) above 0.5, rank test p < 0.025) "
        "on cartpole, mountaincar: **missed**" in targets
    )
    cartpole = _line(targets, "  - cartpole: eureka ")
    assert "P(X > Y) 0.75 [" in cartpole and "1 failed search(es) of eureka scored as the random policy" in cartpole
    assert cartpole.endswith(": fails")
    assert "  - mountaincar: not scored: the task cannot show an effect at this budget (shaped 0.2 < 0.5)" in targets
    # progress_reward reaches human, but not beyond its control without the LLM
    line = _line(targets, "  - cartpole: progress_reward ")
    assert "against its control progress_no_llm: P(X > progress_no_llm) " in line and line.endswith(": fails")
    assert "judged against its control(s) progress_no_llm" in _line(targets, "- **progress_reward**")
    # every human run beats every sparse one, but 4 runs against 3 separate so 1 time in 35 by chance
    assert (
        "- **human** beats **sparse** (95 % CI of P(X > Y) above 0.5, rank test p < 0.025) on cartpole: **missed**"
        in targets
    )
    assert "P(X > Y) 1 [1, 1], rank test p 0.029" in _line(targets, "  - cartpole: human ")


def test_variants_of_one_method_are_compared_both_ways(study):
    _, out = study
    text = out.read_text()
    section = text.split("\n## Variants of one method")[1].split("\n## ")[0]
    head = _line(section, "- **progress_reward** against **progress_no_llm**: mean P(X > Y) over 1 task(s) (cartpole) ")
    assert head.endswith(": no difference shown (the interval holds 0.5)")  # as good without the LLM
    assert _line(section, "  - cartpole: progress_reward ").endswith(": no difference shown")
    assert "- **progress_reward** against **progress_no_llm**" in text.split("\n## Summary")[1].split("\n## ")[0]


def test_the_aggregate_normalises_by_random_and_human(study):
    store, out = study
    text = out.read_text()
    summary = text.split("## Summary")[1].split("## Scores")[0]
    assert "over the tasks where both ran and differ (cartpole, pendulum)" in summary  # mountaincar: human = random
    low, high = iqm(np.array(RANDOM["cartpole"])), iqm(np.array(HUMAN["cartpole"]))
    itt = [*EUREKA.values(), low]
    expected = iqm(np.array([(v - low) / (high - low) for v in itt]))
    assert f"| eureka | 1 | 4 | {expected:.3g} [" in summary
    assert "| text2reward | 1 | 4 |" in summary and "(**inert** on cartpole)" in summary
    assert "![aggregate](synth/aggregate.png)" in summary
    assert (out.parent / "synth" / "aggregate.png").read_bytes()[:4] == b"\x89PNG"
    client = store.client
    (report,) = client.search_runs([store.exp], f"tags.`{REPORT_TAG}` = 'true'")
    logged = {f.path for f in client.list_artifacts(report.info.run_id, "report")}
    assert {"report/synth.md", "report/synth"} <= logged
    figures = {f.path for f in client.list_artifacts(report.info.run_id, "report/synth")}
    assert "report/synth/aggregate.png" in figures and "report/synth/cartpole_final.png" in figures
    assert report.data.metrics["aggregate/eureka"] == pytest.approx(expected)


def test_the_provenance_counts_the_runs_set_aside(study):
    _, out = study
    line = _line(out.read_text(), "- Cells planned: ")
    assert "earlier runs of the same cells, not counted: 1" in line
    assert "runs of the same configs at other code, set aside: 1" in line


def test_each_task_states_its_wall_time(study):
    store, out = study
    counted = study_runs(_planned(_spec()), store.uri, EXPERIMENT)
    runs = [r for (task, _, _), r in counted.chosen.items() if task == "cartpole"]
    line = _line(out.read_text().split("## The tasks")[1].strip(), "- **cartpole**")
    # every synthetic run took 5 s, failed ones included: they cost their time too
    assert line.endswith(f"wall time {5 * len(runs) / 60:.1f} min summed over its {len(runs)} run(s)")
