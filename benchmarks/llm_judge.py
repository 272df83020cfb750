"""What the in-training LLM plugins put into a Crafter training, and what it costs.

The five plugins whose LLM acts during training (progress_reward, rlaif_preference, ellm,
saycan, plan4mc) each run one 30,720-frame Crafter training through the normal entry
point, with their shipped defaults and the configured LLM (the embedded model unless
``--set llm=...``), beside plain PPO at the same settings and seed. The cells are those of
the study ``conf/study/judges.yaml`` (``python -m core.study judges``), so an interrupted
benchmark resumes where it stopped and its report (``docs/plugins/judges_study.md``) is
written too. Per plugin it prints, read back from the study's MLflow store:

- ``changed_share``: the share of training steps whose reward (or action, skill) the
  LLM's output changed (``llm/changed_share``, logged by each plugin);
- ``llm_calls``: the run's LLM calls (before and during training); ``llm_seconds``: the
  wall time the plugin spent on them (its ``llm/seconds``); ``llm_request_seconds``: the
  requests' summed time (concurrent requests overlap, so it can exceed the wall time);
- ``quality``: the plugin's own figure (progress_reward: rank correlation of its scores
  with reference progress; rlaif_preference: the reward model's agreement on held-out LLM
  labels; saycan: the share of action rows its prior covered; ellm: goals achieved that
  came from suggestions; plan4mc: plan steps the LLM wrote), with the other figures it logs;
- ``seconds`` and ``speed``: the run's wall time (LLM time before and during training
  included, process start excluded) and PPO's seconds over it (1.0: as fast as plain PPO).

Prints one JSON object::

    {"frames": 30720, "seed": 0, "commit": "...", "machine": "...", "ppo": {"seconds": ..., "fitness": ...},
     "plugins": {"progress_reward": {"changed_share": ..., "llm_calls": ..., "llm_seconds": ...,
                                     "quality": {"judge/rank_correlation": ...}, "seconds": ..., "speed": ...,
                                     "fitness": ...}, ...},
     "targets": {"changed_share>0": {...}, "changed_share>=0.5": {...}, "speed>=0.5": {...}, ...}}

Run: ``python benchmarks/llm_judge.py [--store DIR] [--out FILE] [--arms a,b] [--frames-scale X]
[--set KEY=VALUE ...]``. The store defaults to ``studies/judges`` (keep a long run's store
outside the checkout with ``--store``); its LLM cache starts empty, so every call is paid for.
"""

from __future__ import annotations

import sys
from pathlib import Path

# This checkout's core and plugins come first, also under a virtual environment that another
# checkout installed (a worktree at a fixed commit): the figures must come from this code.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
import math
from typing import Any

from core.report.contribution import MEASURES
from core.report.data import load_study
from core.study import commit, expand, load_spec, machine, main as study_main, plan, tracking_uri

SPEC = "judges"
BASELINE = "ppo"
#: per plugin, the quality figure the issue names (the first) and the others it logs
QUALITY = {
    "progress_reward": ("judge/rank_correlation", "judge/llm_calls", "judge/llm_term_std"),
    "rlaif_preference": (
        "preference/heldout_agreement",
        "preference/truth_agreement",
        "preference/labels",
        "preference/pairs",
    ),
    "ellm": ("ellm/goals_achieved_from_suggestions", "ellm/goal_reward"),
    "saycan": ("saycan/covered", "saycan/queries", "saycan/captions"),
    "plan4mc": ("plan4mc/llm_steps", "plan4mc/rule_steps", "plan4mc/replans"),
}
#: the issue's targets: share of steps changed (progress_reward and saycan at least half), speed
SHARE_AT_LEAST = {"progress_reward": 0.5, "saycan": 0.5}
SPEED_AT_LEAST = 0.5
QUALITY_AT_LEAST = {
    "progress_reward": ("judge/rank_correlation", 0.3),
    "rlaif_preference": ("preference/heldout_agreement", 0.7),
}


def _num(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and not math.isfinite(x)) else round(float(x), 4)


def _metric(run: Any, key: str) -> float | None:
    """A metric of the run's training (the best candidate's run), else of the run itself."""
    return _num(run.training_metrics.get(key, run.metrics.get(key)))


def _run_metric(run: Any, key: str) -> float | None:
    """A metric of the whole run (the parent run: the loop's LLM calls and those of its training)."""
    return _num(run.metrics.get(key))


def summarize(runs: list[Any], frames: int) -> dict[str, Any]:
    """The JSON object from the study's finished runs (the latest run of each arm)."""
    latest: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r.start_time):
        latest[run.tags.get("study.arm", run.arm)] = run
    base = latest.get(BASELINE)
    base_s = _run_metric(base, "seconds") if base else None
    out: dict[str, Any] = {
        "frames": frames,
        "ppo": {
            "seconds": base_s,
            "fitness": _num(base.fitness) if base else None,
            "status": base.status if base else "missing",
        },
    }
    plugins: dict[str, Any] = {}
    for name in QUALITY:
        run = latest.get(name)
        if run is None:
            plugins[name] = {"status": "missing"}
            continue
        seconds = _run_metric(run, "seconds")
        plugins[name] = {
            "status": run.status,
            "changed_share": _metric(run, MEASURES[name].metric),
            "llm_calls": _run_metric(run, "llm/calls"),
            "llm_seconds": _metric(run, "llm/seconds"),
            "llm_request_seconds": _run_metric(run, "llm/latency_s"),
            "quality": {key: _metric(run, key) for key in QUALITY[name]},
            "seconds": seconds,
            "speed": _num(base_s / seconds) if base_s and seconds else None,
            "fitness": _num(run.fitness),
        }
    out["plugins"] = plugins
    out["targets"] = targets(plugins)
    return out


def targets(plugins: dict[str, Any]) -> dict[str, Any]:
    """Each target of the issue, per plugin: met, missed, or not measured."""

    def judge(value: float | None, bound: float) -> str:
        return "not measured" if value is None else ("met" if value >= bound else "missed")

    result: dict[str, Any] = {}
    for name, p in plugins.items():
        share_bound = SHARE_AT_LEAST.get(name)
        share = p.get("changed_share")
        result[name] = {
            "changed_share>0": "not measured" if share is None else ("met" if share > 0 else "missed"),
            "speed>=0.5": judge(p.get("speed"), SPEED_AT_LEAST),
        }
        if share_bound is not None:
            result[name][f"changed_share>={share_bound}"] = judge(share, share_bound)
        if name in QUALITY_AT_LEAST:
            key, bound = QUALITY_AT_LEAST[name]
            result[name][f"{key}>={bound}"] = judge((p.get("quality") or {}).get(key), bound)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--store", default=None, help="the study's store (default: the spec's, studies/judges)")
    parser.add_argument("--out", default=None, help="write the JSON here as well as to stdout")
    parser.add_argument("--report", default=None, help="the study's report (default: the spec's)")
    parser.add_argument("--arms", default=None, help="comma-separated arms (default: all)")
    parser.add_argument("--frames-scale", default=None, help="shrink or grow the 30,720 frames")
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="overrides of every cell")
    parser.add_argument("--summary-only", action="store_true", help="run nothing; summarise the finished cells")
    args = parser.parse_args()

    spec = load_spec(SPEC)
    store = Path(args.store or spec.store)
    argv = [SPEC, "--store", str(store)] + (["--out", args.report] if args.report else [])
    argv += (["--arms", args.arms] if args.arms else []) + (
        ["--frames-scale", args.frames_scale] if args.frames_scale else []
    )
    argv += (["--set", *args.set] if args.set else []) + (["--report-only"] if args.summary_only else [])
    code = study_main(argv)
    if code == 2:
        sys.exit(code)

    scale = float(args.frames_scale) if args.frames_scale else None
    cells = expand(spec, frames_scale=scale, extra=tuple(args.set))
    keys = {p.key for p in plan(cells, spec.name, store)}
    runs = [r for r in load_study(tracking_uri(store), spec.name) if r.tags.get("study.cell") in keys]
    commits = sorted({r.tags.get("study.commit", "") for r in runs} - {""})
    loads = [float(r.tags["study.load"]) for r in runs if r.tags.get("study.load")]
    result = {
        **summarize(runs, cells[0].frames),
        "seed": spec.seeds[0],
        "commit": ", ".join(commits) or commit(),
        "machine": machine(),
        "load_at_cell_start": [round(x, 2) for x in loads],
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
