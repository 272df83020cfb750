"""What a study is made of, as records: its spec (tasks, arms, targets), its cells, a
planned cell and one call of the command.

:mod:`core.study` runs a study from these; :mod:`core.report` (the results document, the
evidence, the contributions) reads them. Neither imports the other's machinery for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig

from core.cpu import load_average
from core.errors import UserError

#: a search arm's score: the mean fitness of its best candidate retrained on fresh seeds
FRESH_SCORE = "final/fresh_mean"
RELATIONS = ("beats", "matches")


# -- the spec ---------------------------------------------------------------------------


@dataclass
class CalibrationSpec:
    """Whether a task can show an effect: its calibration arm must clear ``threshold`` (IQM over seeds),
    or, on a task with no score that means "solved", beat the arm ``beats`` (as a target's ``beats``)."""

    arm: str = "human"  # the arm that must learn at the task's budget (the designers' reward, or a positive control)
    threshold: float | None = None  # the score it must reach; null: the task is not calibrated (cannot score targets)
    beats: str | None = None  # instead of a threshold: the arm it must beat (the random policy: it learned something)
    note: str = ""  # where the threshold comes from


@dataclass
class TaskSpec:
    """One task of a study."""

    env: str = ""  # the env config (conf/env/<env>.yaml)
    frames: int = 0  # trainer.frames of every training of the task: each search candidate and each final policy
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of every cell of the task (trainer=sac, ...)
    scaled: dict[str, int] = field(
        default_factory=dict
    )  # other budgets scaled with the frames, key -> value at scale 1
    seeds: list[int] | None = None  # the task's seeds; null: the study's
    calibration: CalibrationSpec = field(default_factory=CalibrationSpec)


@dataclass
class ArmSpec:
    """One arm: a method or a baseline."""

    plugins: list[str] = field(default_factory=list)  # +plugins=[...]; none: plain RL on the env's reward
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of the arm (env.reward=sparse, plugin knobs)
    tasks: list[str] | None = None  # the tasks it applies to; null: every task
    search: bool = False  # picks the best of several candidates: its best is retrained on fresh seeds and scored there
    trainer: str = ""  # a trainer in place of the task's (trainer=<name>; the task's trainer.* settings do not apply)
    control_of: str = ""  # the arm this one is the control of: the same method with the LLM's contribution removed
    note: str = ""  # what the arm is and why it applies where it does (shown in the report)


@dataclass
class TargetSpec:
    """A target: ``arm`` beats or matches ``other`` (judged by :mod:`core.report.evidence`).

    ``beats`` holds on a task where the lower bound of the 95 % CI of P(arm > other) over
    seeds is above 0.5; ``matches`` where the arm's IQM is at least ``other - tolerance *
    |other|`` (both intervals printed). Never from a single run, an inert arm or a task
    whose calibration arm missed its threshold; an LLM arm must also beat its controls.
    """

    arm: str = ""  # the arm under test
    relation: str = "beats"  # beats | matches
    other: str = ""  # the arm it is compared with
    tolerance: float = 0.0  # matches: the share of |other| the arm may fall short by
    tasks: list[str] | None = None  # where it must hold; null: every task both arms ran
    share: float = 1.0  # the share of those tasks on which it must hold


@dataclass
class StudySpec:
    """A study: tasks x arms x seeds, and where its store and report go."""

    name: str = ""  # the MLflow experiment of the study
    title: str = ""  # the report's title
    store: str = ""  # folder of the study's MLflow store (mlflow.db, artifacts, finished trainings)
    out: str = ""  # the report (Markdown); its figures go to a folder of the same name
    seeds: list[int] = field(default_factory=list)  # one cell per seed
    final_seeds: int = 1  # fresh-seed retrainings of a search arm's best candidate; their mean is the cell's score
    frames_scale: float = 1.0  # multiplies every task's frames (and its `scaled` values)
    evaluations: int = 4  # periodic evaluations per training (trainer.eval_every = frames / evaluations)
    overrides: list[str] = field(default_factory=list)  # Hydra overrides of every cell
    tasks: dict[str, TaskSpec] = field(default_factory=dict)
    arms: dict[str, ArmSpec] = field(default_factory=dict)
    targets: list[TargetSpec] = field(default_factory=list)

    def check(self, where: str) -> None:
        problems = [f"'{key}' is empty" for key in ("name", "store", "out") if not getattr(self, key)]
        problems += [] if self.seeds else ["no seeds"]
        problems += (
            []
            if self.final_seeds >= 0 and self.evaluations >= 0 and self.frames_scale > 0
            else ["final_seeds and evaluations must be >= 0 and frames_scale > 0"]
        )
        for name, task in self.tasks.items():
            if not task.env or task.frames < 1:
                problems.append(f"task '{name}' needs an env and frames >= 1")
        for name, task in self.tasks.items():
            cal = task.calibration
            if (cal.threshold is not None or cal.beats) and cal.arm not in self.arms:
                problems.append(f"task '{name}' is calibrated on arm '{cal.arm}', which is not an arm")
            if cal.beats and cal.beats not in self.arms:
                problems.append(f"task '{name}' is calibrated against arm '{cal.beats}', which is not an arm")
            if cal.beats and cal.threshold is not None:
                problems.append(f"task '{name}': a calibration has a threshold or an arm to beat, not both")
        for name, arm in self.arms.items():
            unknown = sorted(set(arm.tasks or []) - set(self.tasks))
            if unknown:
                problems.append(f"arm '{name}' names unknown task(s) {', '.join(unknown)}")
            if arm.control_of and arm.control_of not in self.arms:
                problems.append(f"arm '{name}' is the control of '{arm.control_of}', which is not an arm")
        for target in self.targets:
            if target.arm not in self.arms or target.other not in self.arms or target.relation not in RELATIONS:
                problems.append(
                    f"target {target.arm} {target.relation} {target.other}: arms must exist, "
                    f"relation one of {', '.join(RELATIONS)}"
                )
        if problems:
            raise UserError(f"The study spec {where} is not valid: {'; '.join(problems)}.")


# -- cells ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Cell:
    """One arm on one task with one seed: one run."""

    arm: str
    task: str
    seed: int
    plugins: tuple[str, ...]
    overrides: tuple[str, ...]  # the run's Hydra overrides, in order
    search: bool
    final_seeds: int  # fresh-seed retrainings of the best candidate (0 for an arm that does not search)
    frames: int  # trainer.frames of every training
    extra: tuple[str, ...] = ()  # the overrides given on the command line (--set) that reach this cell
    ignored: tuple[str, ...] = ()  # --set knobs of plugins this arm does not run (recorded, not applied)

    @property
    def name(self) -> str:
        return f"{self.arm}-{self.task}-s{self.seed}"

    @property
    def score_metric(self) -> str:
        """The run metric that scores the cell."""
        return FRESH_SCORE if self.final_seeds > 0 else "fitness"


@dataclass
class PlannedCell:
    """A cell with its composed config and keys."""

    cell: Cell
    config: DictConfig
    config_key: str  # what it computes
    key: str  # what it computes and the code that computes it: the resume key

    def tags(self, study: str, commit: str, machine: str) -> dict[str, str]:
        """The tags of the cell's run: what it is, and what it ran on (with the load as it started)."""
        from core.app import IGNORED_TAG

        c = self.cell
        return {
            "study": study,
            "study.arm": c.arm,
            "study.task": c.task,
            "study.config": self.config_key,
            "study.cell": self.key,
            "study.score": c.score_metric,
            "study.search": str(c.search),
            "study.commit": commit,
            "study.machine": machine,
            "study.load": f"{load_average():.2f}",
            **({IGNORED_TAG: " ".join(c.ignored)} if c.ignored else {}),
        }


@dataclass
class Invocation:
    """One call of the study command: what it ran and on what (stated in the report)."""

    command: str
    commit: str
    machine: str
    load_start: float
    load_end: float = float("nan")
    seconds: float = 0.0
    ran: int = 0
    skipped: int = 0
    crashed: list[str] = field(default_factory=list)  # cells whose run raised (the run is FAILED in MLflow)
    overrides: tuple[str, ...] = ()  # what --set added to the cells
    report_only: bool = False  # --report-only: no cell was run
    code_of: str | None = None  # --code-of: the commit whose code keyed the cells (this one wrote the report)
