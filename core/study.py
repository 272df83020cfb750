"""``python -m core.study <spec>``: a study of arms x tasks x seeds, run cell by cell, then its report.

A study spec (``conf/study/<name>.yaml``, schema :class:`StudySpec`) names the tasks (an env
config, the frames of every training, task overrides), the arms (plugins and overrides, the
tasks each applies to, whether it searches over candidates), the seeds and the targets. A
*cell* is one arm on one task with one seed: one run of the normal entry point
(:func:`core.loop.run_experiment` on the composed Hydra config, in this process), every
cell in the one MLflow experiment of the study. :mod:`core.report.results` then writes
the report (``docs/results.md`` for the ``results`` study).

- **Equal frames for the final policy.** Every training of a cell gets the task's frames.
  An arm that searches (picks the best of several candidates) retrains its best candidate
  on ``final_seeds`` fresh seeds and is scored by their mean (``final/fresh_mean``), a
  number free of the selection; the frames and LLM time its search spent are reported
  beside it. Any other arm is scored by the fitness of its one training.
- **Resumable.** A cell's key hashes its composed config (bookkeeping left out) and the code
  that decides its result (:func:`core.config.framework_hash` and the arm's plugin sources).
  A cell with a finished MLflow run of that key (tag ``study.cell``) is skipped, so an
  interrupted study continues where it stopped; trainings a cut-short cell had finished
  are reused from the results store beside the tracking store.
- **Kept beside its report.** The runs the report counted are archived in the report's
  folder (``docs/results/runs.jsonl.gz``, :mod:`core.report.archive`), a file committed with
  the report. A study run task by task over sessions whose stores are lost reads it back: a
  cell with a finished archived run of its key is skipped, and the report merges the
  archived runs with the store's (per cell the latest attempt counts). ``--no-archive``
  leaves it out (its cells run again, and the report and the archive come from the store).
- **Its own caches.** LLM replies and the plugins' libraries live in ``<store>/cache``, so a
  reply cached by another run never passes for free LLM time.
- **Shrinkable.** ``--tasks``, ``--arms``, ``--seeds`` and ``--frames-scale`` select and
  shrink cells for a check (a different frames scale makes different cells).
- **Reported by later code.** A study runs from a fixed commit for days while the report code
  moves on. ``--report-only --code-of <commit>`` keys the cells as the code of that commit
  does (its own planning, run in a temporary export of it) and writes the report with the code
  of this checkout; the report names both commits.

    python -m core.study results                      # every cell not finished yet, then docs/results.md
    python -m core.study results --list               # the cells, finished or not
    python -m core.study results --report-only        # docs/results.md from the store and docs/results/runs.jsonl.gz
    python -m core.study results --report-only --code-of 633656a   # the cells that ran at 633656a, reported by HEAD
    python -m core.study results --tasks cartpole --arms sparse,human --seeds 0,1 --frames-scale 0.02
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from core.config import config_key, digest
from core.errors import UserError, did_you_mean
from core.resources import conf_dir

# the study's records, read here by callers: "X as X" re-exports them
from core.study_records import (
    FRESH_SCORE as FRESH_SCORE,
    RELATIONS as RELATIONS,
    ArmSpec as ArmSpec,
    CalibrationSpec as CalibrationSpec,
    Cell,
    Invocation,
    PlannedCell,
    StudySpec,
    TargetSpec as TargetSpec,
    TaskSpec as TaskSpec,
    load_average,
)

# -- the spec ---------------------------------------------------------------------------


def spec_names() -> list[str]:
    """The study specs shipped in ``conf/study/``."""
    return sorted(p.stem for p in (conf_dir() / "study").glob("*.yaml"))


def load_spec(name: str) -> StudySpec:
    """The spec ``conf/study/<name>.yaml``, or the YAML file at path ``name``, typed and checked."""
    from omegaconf.errors import OmegaConfBaseException

    path = Path(name)
    if not path.is_file():
        path = conf_dir() / "study" / f"{name}.yaml"
    if not path.is_file():
        names = spec_names()
        raise UserError(
            f"No study spec '{name}'.{did_you_mean(name, names)} Specs in conf/study/: {', '.join(names) or 'none'}; "
            "or give the path of a YAML file."
        )
    try:
        spec = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(StudySpec), OmegaConf.load(path)))
    except OmegaConfBaseException as err:
        raise UserError(f"The study spec {path} does not fit its schema (core.study.StudySpec): {err}") from None
    assert isinstance(spec, StudySpec)
    spec.check(str(path))
    return spec


# -- cells -------------------------------------------------------------------------------


def scaled(value: int, scale: float) -> int:
    return max(1, int(round(value * scale)))


def _select(kind: str, wanted: list[str] | None, known: list[str]) -> list[str]:
    if wanted is None:
        return known
    for name in wanted:
        if name not in known:
            raise UserError(
                f"Unknown {kind} '{name}'.{did_you_mean(name, known)} The study's {kind}s: {', '.join(known)}."
            )
    return [name for name in known if name in wanted]  # the spec's order


def expand(
    spec: StudySpec,
    tasks: list[str] | None = None,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    frames_scale: float | None = None,
    extra: tuple[str, ...] = (),
) -> list[Cell]:
    """The study's cells: every arm on every task it applies to, for every seed.

    Seeds vary slowest, so an interrupted study has whole seeds of every arm; a task with
    its own ``seeds`` runs those (``--seeds`` gives every task the same). An arm with its own
    ``trainer`` (the random policy) drops the task's trainer settings. ``tasks``,
    ``arms`` and ``seeds`` select; ``frames_scale`` replaces the spec's; ``extra`` are
    overrides added to every cell, except that a plugin's knob (``plugins.<name>.<key>=...``)
    goes only to the cells of arms that run the plugin; the other cells record it as
    ignored (as ``python -m core -m '+plugins=[name],[]' plugins.<name>.<key>=v`` does).
    A knob of a plugin no selected arm runs, or one written ``+plugins.<name>.<key>``, is
    refused.
    """
    task_names = _select("task", tasks, list(spec.tasks))
    arm_names = _select("arm", arms, list(spec.arms))
    scale = spec.frames_scale if frames_scale is None else frames_scale
    if scale <= 0:
        raise UserError(f"--frames-scale must be > 0, got {scale}.")
    _check_knobs(extra, {p for a in arm_names for p in spec.arms[a].plugins})
    cells = []
    all_seeds = sorted({int(x) for t in task_names for x in (spec.tasks[t].seeds or spec.seeds)})
    for seed in all_seeds if seeds is None else seeds:
        for t in task_names:
            task = spec.tasks[t]
            if seeds is None and seed not in (task.seeds or spec.seeds):
                continue
            frames = scaled(task.frames, scale)
            budget = [
                f"trainer.frames={frames}",
                f"trainer.eval_every={frames // spec.evaluations if spec.evaluations else 0}",
            ]
            budget += [f"{key}={scaled(value, scale)}" for key, value in task.scaled.items()]
            for a in arm_names:
                arm = spec.arms[a]
                if arm.tasks is not None and t not in arm.tasks:
                    continue
                final = spec.final_seeds if arm.search else 0
                plugins = [f"+plugins=[{','.join(arm.plugins)}]"] if arm.plugins else []
                mine = [o for o in extra if _plugin_of(o) in (None, *arm.plugins)]
                task_overrides, task_budget = list(task.overrides), budget
                if arm.trainer:  # its own trainer: none of the task's trainer settings apply
                    task_overrides = [o for o in task_overrides if not _sets_trainer(o)] + [f"trainer={arm.trainer}"]
                    task_budget = [o for o in budget if not o.startswith(tuple(task.scaled))]
                overrides = (
                    f"env={task.env}",
                    *spec.overrides,
                    *task_overrides,
                    *plugins,
                    *arm.overrides,
                    *task_budget,
                    f"seed={seed}",
                    f"final_seeds={final}",
                    *mine,
                )
                ignored = tuple(o for o in extra if o not in mine)
                cells.append(
                    Cell(
                        a, t, int(seed), tuple(arm.plugins), overrides, arm.search, final, frames, tuple(mine), ignored
                    )
                )
    return cells


def _sets_trainer(override: str) -> bool:
    """Whether an override picks or sets the trainer (``trainer=sac``, ``trainer.gamma=0.99``)."""
    return re.match(r"^\+{0,2}trainer[.=]", override) is not None


def _check_knobs(extra: tuple[str, ...], running: set[str]) -> None:
    """Refuse a ``--set`` plugin knob no selected arm can take (see :func:`expand`)."""
    for o in extra:
        name = _plugin_of(o)
        if name is None:
            continue
        if o.startswith("+"):
            raise UserError(
                f"--set '{o}': a plugin's knob is set without '+' ('{o.lstrip('+')}'); it reaches the "
                "arms that run the plugin and is recorded as ignored by the others "
                "(docs/ablations.md, 'Sweeping a plugin's knob')."
            )
        if name not in running:
            raise UserError(
                f"--set '{o}' sets a knob of plugin '{name}', which no selected arm runs "
                f"(they run: {', '.join(sorted(running)) or 'no plugin'})."
            )


def _plugin_of(override: str) -> str | None:
    """The plugin whose knob an override sets (``plugins.<name>.<key>=...`` -> ``<name>``), else None."""
    match = re.match(r"^\+{0,2}plugins\.([\w\-]+)\.", override)
    return match.group(1) if match else None


def compose_cell(cell: Cell, experiment: str, store: Path) -> DictConfig:
    """The cell's run config: the shipped config with its overrides, recorded in the study's store.

    The caches (LLM replies, the libraries plugins keep under ``cache_dir``) are the study's
    own, ``<store>/cache``, unless an override sets ``cache_dir``: replies cached by earlier
    runs would cost no LLM time, and libraries grown elsewhere would leak into the arms.
    """
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=list(cell.overrides))
    with open_dict(cfg):
        if not any(o.startswith("cache_dir=") for o in cell.overrides):
            cfg.cache_dir = str(store.resolve() / "cache")
        cfg.experiment = experiment
        cfg.run_name = cell.name
        cfg.progress = False
        cfg.tracking.uri = tracking_uri(store)
        cfg.tracking.artifact_location = str(store.resolve() / "mlartifacts")
    return cfg


def tracking_uri(store: Path) -> str:
    return f"sqlite:///{store.resolve() / 'mlflow.db'}"


class CodeHashes:
    """The code that decides a cell's result: the framework's training code and each plugin's source."""

    def __init__(self) -> None:
        from core.config import framework_hash

        self.framework = framework_hash()
        self._plugins: dict[str, str] = {}

    def of(self, plugins: tuple[str, ...]) -> dict[str, str]:
        from core.config import source_hash
        from core.registry import catalogue, load_module

        for name in plugins:
            if name not in self._plugins:
                self._plugins[name] = source_hash(load_module(catalogue()[name]))
        return {"framework": self.framework, **{f"plugin:{n}": self._plugins[n] for n in plugins}}


def plan(cells: list[Cell], experiment: str, store: Path) -> list[PlannedCell]:
    """Compose every cell's config (a bad override fails here, before any work) and key it.

    Cells that differ only in the seed share one composition (the seed is a top-level
    value, so interpolations of it follow the copy's).
    """
    import copy

    from core.app import check_argv, register_third_party_configs

    register_third_party_configs()
    check_argv(sorted({o for cell in cells for o in cell.overrides}))
    code = CodeHashes()
    composed: dict[tuple[str, ...], DictConfig] = {}
    planned = []
    for cell in cells:
        shared = tuple(o for o in cell.overrides if o != f"seed={cell.seed}")
        if shared not in composed:
            composed[shared] = compose_cell(cell, experiment, store)
        cfg = copy.deepcopy(composed[shared])
        with open_dict(cfg):
            cfg.seed = cell.seed
            cfg.run_name = cell.name
        ckey = config_key(cfg)
        planned.append(PlannedCell(cell, cfg, ckey, digest({"config": ckey, "code": code.of(cell.plugins)})))
    return planned


#: the repository of this checkout, where --code-of finds its commit (a test points it at a copy)
REPO = Path(__file__).resolve().parents[1]
#: what decides a cell's key: the framework, the plugins, their configs and the catalogue
KEYED_PATHS = ("core", "plugins", "conf", "registry.yaml")

#: run inside an export of another commit: that commit's own planning prints its cells' keys
_KEYS_AT = """
import json, sys
from pathlib import Path
import core
assert Path(core.__file__).resolve().is_relative_to(Path.cwd().resolve()), core.__file__
from core.study import expand, load_spec, plan
a = json.loads(sys.argv[1])
spec = load_spec(a["spec"])
cells = expand(spec, a["tasks"], a["arms"], a["seeds"], a["frames_scale"], tuple(a["extra"]))
print(json.dumps({p.cell.name: [p.config_key, p.key] for p in plan(cells, spec.name, Path(a["store"]))}))
"""


def resolve_commit(name: str, repo: Path | None = None) -> str:
    """The full hash of a commit name (``633656a``, a tag, ``HEAD~2``) in the checkout's repository."""
    repo = repo or REPO
    try:
        found = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}"],
            cwd=repo,
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise UserError(f"--code-of {name}: git could not read the repository ({err}).") from err
    if found.returncode != 0:
        raise UserError(f"--code-of {name}: no such commit in {repo} (git log --oneline lists them).")
    return found.stdout.strip()


def rekeyed(planned: list[PlannedCell], keys: dict[str, tuple[str, str]]) -> list[PlannedCell]:
    """The cells with the keys another commit's code gave them; a cell that commit does not
    plan (a task or arm added since) keeps this checkout's keys."""
    return [
        dataclasses.replace(p, config_key=keys[p.cell.name][0], key=keys[p.cell.name][1]) if p.cell.name in keys else p
        for p in planned
    ]


def keys_at(commit: str, selection: dict[str, Any], repo: Path | None = None) -> dict[str, tuple[str, str]]:
    """Cell name -> (config key, resume key), as the code of ``commit`` computes them.

    ``selection`` holds what :func:`expand` takes (``spec``, ``tasks``, ``arms``, ``seeds``,
    ``frames_scale``, ``extra``) and the ``store``. The commit's ``core/``, ``plugins/``,
    ``conf/`` and ``registry.yaml`` are exported to a temporary folder and its own
    ``core.study`` plans the cells there, in a child process: the keys are that commit's,
    whatever has changed in this checkout since.
    """
    repo = repo or REPO
    try:
        exported = subprocess.run(
            ["git", "archive", "--format=tar", commit, *KEYED_PATHS], cwd=repo, capture_output=True, timeout=120
        )
    except (OSError, subprocess.SubprocessError) as err:
        raise UserError(f"--code-of {commit}: git could not export it ({err}).") from err
    if exported.returncode != 0:
        raise UserError(
            f"--code-of {commit}: not a commit of {repo} with {', '.join(KEYED_PATHS)} "
            f"(git: {exported.stderr.decode(errors='replace').strip()})."
        )
    with tempfile.TemporaryDirectory(prefix="llm4rl-code-of-") as tmp:
        with tarfile.open(fileobj=io.BytesIO(exported.stdout)) as tar:
            tar.extractall(tmp, filter="data")
        done = subprocess.run(
            [sys.executable, "-c", _KEYS_AT, json.dumps(selection, default=str)],
            cwd=tmp,
            env={**os.environ, "PYTHONPATH": tmp},
            capture_output=True,
            text=True,
            timeout=600,
        )
    if done.returncode != 0:
        raise UserError(
            f"--code-of {commit}: its code could not plan the cells (it needs core.study's load_spec, "
            f"expand and plan): {error_line(done.stderr)}"
        )
    keys = json.loads(done.stdout.strip().splitlines()[-1])
    return {name: (ckey, key) for name, (ckey, key) in keys.items()}


def reply_caches(planned: list[PlannedCell]) -> list[Path]:
    """The LLM reply caches (sqlite files) the cells use: ``<store>/cache`` unless an override moved it."""
    from core.llm.client import cache_file

    found: list[Path] = []
    for p in planned:
        llm = p.config.get("llm") or {}
        if llm.get("cache", True):
            path = cache_file(llm.get("cache_path"))
            if path not in found:
                found.append(path)
    return found


def finished_cells(uri: str, experiment: str) -> dict[str, str]:
    """Cell key -> run id of the study's finished runs (the latest of each key)."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        return {}
    done: dict[str, tuple[int, str]] = {}
    token = None
    while True:
        page = client.search_runs(
            [exp.experiment_id], filter_string="attributes.status = 'FINISHED'", max_results=1000, page_token=token
        )
        for run in page:
            key = run.data.tags.get("study.cell")
            if key and (key not in done or run.info.start_time > done[key][0]):
                done[key] = (run.info.start_time, run.info.run_id)
        token = page.token
        if not token:
            return {key: run_id for key, (_, run_id) in done.items()}


# -- the machine and the code --------------------------------------------------------------


def commit() -> str:
    """``git rev-parse HEAD`` of the checkout the code runs from, '+ uncommitted changes' when
    tracked files differ from it; 'unknown' outside a git checkout."""
    root = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, timeout=10, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + (" + uncommitted changes" if dirty else "")


def machine() -> str:
    """The machine in words: OS, CPU, usable cores, memory."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    memory = ""
    try:
        kib = next(
            int(line.split()[1])
            for line in Path("/proc/meminfo").read_text().splitlines()
            if line.startswith("MemTotal")
        )
        memory = f", {kib / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    return f"{platform.system()} {platform.machine()}, {cpu}, {cores} cores{memory}"


# -- running -------------------------------------------------------------------------------


def run_cells(
    planned: list[PlannedCell],
    study: str,
    uri: str,
    invocation: Invocation,
    console: Any,
    archived: dict[str, str] | None = None,
) -> None:
    """Run every planned cell that has no finished run of its key, one after another.

    ``archived``: cell key -> where, of the cells that finished in earlier sessions (the
    archive beside the report): skipped as the store's finished cells are.
    """
    import traceback

    from core.llm.errors import ReplayMiss
    from core.loop import run_experiment

    done = {**(archived or {}), **finished_cells(uri, study)}
    start = time.perf_counter()
    try:
        for i, p in enumerate(planned, 1):
            where = f"[{i}/{len(planned)}] {p.cell.name}"
            if p.key in done:
                invocation.skipped += 1
                console.print(f"{where}: finished before (run {done[p.key]}), skipped", highlight=False)
                continue
            began = time.perf_counter()
            try:
                summary = run_experiment(p.config, tags=p.tags(study, invocation.commit, invocation.machine))
            except ReplayMiss as err:  # this cell asked what the replies file never recorded; the others may not
                invocation.crashed.append(p.cell.name)
                console.print(f"{where}: [red]not replayable[/red]: {err}", highlight=False)
                continue
            except UserError:
                raise
            except Exception:  # one crashed cell does not end the study; its run is FAILED
                invocation.crashed.append(p.cell.name)
                console.print(
                    f"{where}: [red]crashed[/red] (run again to retry)\n{traceback.format_exc(limit=3)}",
                    highlight=False,
                )
                continue
            invocation.ran += 1
            _record_cell(uri, summary, time.perf_counter() - began)
            final = (
                f", fresh seeds {', '.join(f'{v:.4g}' for v in summary.final_fitness[1:])}"
                if summary.final_fitness
                else ""
            )
            console.print(
                f"{where}: {summary.fitness_name} {summary.fitness:.4g}{final}; {summary.candidates} candidate(s), "
                f"{time.perf_counter() - began:.0f} s",
                highlight=False,
            )
    finally:
        invocation.seconds += time.perf_counter() - start
        invocation.load_end = load_average()


def _record_cell(uri: str, summary: Any, seconds: float) -> None:
    """Add to the cell's run its wall time (setup and recording included), its failed
    candidates and the last line of the first failure, for the report."""
    import mlflow

    if not summary.run_id:
        return
    client = mlflow.MlflowClient(tracking_uri=uri)
    client.log_metric(summary.run_id, "study/seconds", seconds)
    client.log_metric(summary.run_id, "study/failed_candidates", summary.failed)
    if summary.first_error:
        client.set_tag(summary.run_id, "study.first_error", error_line(summary.first_error)[:300])


def error_line(text: str) -> str:
    """The line of an error text that names the error (``NameError: ...``), else its last line."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", line)]
    return (named or lines or [""])[-1]


def _running_command(argv: list[str]) -> list[str]:
    """The arguments of the command that runs the cells: these without the ones that only read."""
    shown: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--report-only", "--list"):
            pass
        elif a == "--code-of":
            skip = True
        elif not a.startswith("--code-of="):
            shown.append(a)
    return shown


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m core.study", description=__doc__.split("\n\n")[0])
    parser.add_argument("spec", help=f"a spec in conf/study/ ({', '.join(spec_names())}) or a YAML file")
    parser.add_argument("--tasks", help="comma-separated tasks of the spec (default: all)")
    parser.add_argument("--arms", help="comma-separated arms of the spec (default: all)")
    parser.add_argument("--seeds", help="comma-separated seeds (default: the spec's)")
    parser.add_argument(
        "--frames-scale", type=float, default=None, help="multiply every task's frames (default: the spec's)"
    )
    parser.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="Hydra overrides added to every cell; plugins.<name>.<key>=... only to the arms running <name>",
    )
    parser.add_argument("--store", help="folder of the study's MLflow store (default: the spec's)")
    parser.add_argument("--out", help="the report file (default: the spec's)")
    parser.add_argument(
        "--replies",
        help="a replies file a study wrote (<report folder>/replies.jsonl.gz): run the cells "
        "from it with no LLM (llm.replay_only), in a fresh --store",
    )
    parser.add_argument("--list", action="store_true", help="list the cells, finished or not, and stop")
    parser.add_argument(
        "--report-only", action="store_true", help="run nothing; write the report from the finished cells"
    )
    parser.add_argument(
        "--code-of",
        metavar="COMMIT",
        help="with --report-only or --list: key the cells as the code of COMMIT does (the commit the cells ran at), "
        "and write the report with this checkout's code",
    )
    parser.add_argument(
        "--no-archive",
        action="store_true",
        help="leave out the runs of earlier sessions archived beside the report (<report folder>/runs.jsonl.gz): "
        "run their cells again and write the report and the archive from the store alone",
    )
    parser.add_argument("--reps", type=int, default=2000, help="bootstrap replications of the intervals")
    args = parser.parse_args(argv)
    began = time.perf_counter()

    from rich.console import Console

    from core.quiet import quiet_third_party

    quiet_third_party()
    from core import interrupts

    interrupts.install()
    console = Console(soft_wrap=True)
    try:
        spec = load_spec(args.spec)
        split = lambda text: [s.strip() for s in text.split(",") if s.strip()] if text else None  # noqa: E731
        seeds = [int(s) for s in split(args.seeds)] if args.seeds else None  # type: ignore[union-attr]
        extra = tuple(args.set) + (("llm.replay_only=true",) if args.replies else ())
        cells = expand(spec, split(args.tasks), split(args.arms), seeds, args.frames_scale, extra)
        if not cells:
            raise UserError("The selection leaves no cell: no selected arm applies to a selected task.")
        if args.code_of and (args.replies or not (args.report_only or args.list)):
            raise UserError(
                "--code-of only reads: it keys finished cells by another commit's code. Use it with --report-only "
                "or --list; to run cells at that commit, run the study from a checkout of it (git worktree add)."
            )
        store = Path(args.store or spec.store)
        out = Path(args.out or spec.out)
        uri = tracking_uri(store)
        shown = _running_command(argv)
        invocation = Invocation(
            "python -m core.study " + " ".join(shlex.quote(a) for a in shown),
            commit(),
            machine(),
            load_average(),
            overrides=tuple(args.set),
            report_only=args.report_only,
        )
        planned = plan(cells, spec.name, store)
        if args.code_of:
            invocation.code_of = resolve_commit(args.code_of)
            selection = {
                "spec": args.spec if args.spec in spec_names() else str(Path(args.spec).resolve()),
                "tasks": split(args.tasks),
                "arms": split(args.arms),
                "seeds": seeds,
                "frames_scale": args.frames_scale,
                "extra": list(extra),
                "store": str(store.resolve()),
            }
            console.print(f"keying the cells by the code of {invocation.code_of} ...", highlight=False)
            planned = rekeyed(planned, keys_at(invocation.code_of, selection))
        from core.report.archive import archive_path, finished, read_runs

        archive = archive_path(out)
        archived = None if args.no_archive else read_runs(archive, spec.name)
        earlier = finished(archived or [], archive.name)
        if archived:
            console.print(f"{len(archived)} run(s) of earlier sessions in {archive}", highlight=False)
        if args.list:
            done = {**earlier, **finished_cells(uri, spec.name)}
            for p in planned:
                state = f"finished (run {done[p.key]})" if p.key in done else "to run"
                console.print(f"{p.cell.name:40} frames {p.cell.frames:>9,}  {state}", highlight=False)
            console.print(
                f"{len(planned)} cells, {sum(p.key in done for p in planned)} finished; store {store}", highlight=False
            )
            return 0
        invocation.seconds = time.perf_counter() - began  # planning; the cells add theirs
        caches = reply_caches(planned)
        if args.replies:
            from core.llm.cache import ResponseCache, load_replies

            loaded = sum(load_replies(args.replies, ResponseCache(c)) for c in caches)
            console.print(f"{loaded} recorded replies from {args.replies}; the cells run with no LLM", highlight=False)
        if not args.report_only:
            console.print(
                f"{len(planned)} cells; store {store}; {invocation.machine}; commit {invocation.commit}",
                highlight=False,
            )
            run_cells(planned, spec.name, uri, invocation, console, earlier)
        used = [c for c in caches if c.exists()]
        if used and not args.replies:
            from core.llm.cache import dump_replies

            kept = out.parent / out.stem / "replies.jsonl.gz"
            console.print(f"{dump_replies(used[0], kept)} LLM replies the cells used: {kept}", highlight=False)
        else:
            invocation.load_end = load_average()
        from core.report.results import write_results

        written = write_results(spec, planned, uri, out, invocation, reps=args.reps, archived=archived)
    except UserError as err:
        console.print(f"[bold red]error:[/bold red] {err}")
        return 2
    except KeyboardInterrupt:
        console.print("interrupted: the finished cells are kept; the same command continues the study")
        return 130
    from core.progress import next_steps

    console.print(f"report: {written[0]}; its runs: {written[1]}", highlight=False)
    console.print(next_steps(uri, spec.name)[1], highlight=False)
    return 1 if invocation.crashed else 0


if __name__ == "__main__":
    status = main()
    if status == 130:  # interrupted: leave without waiting on a generation llama.cpp cannot stop
        from core import interrupts

        interrupts.leave(status)
    sys.exit(status)
