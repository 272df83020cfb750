"""Usable LLM code: how many sampled reward programs reach training, per task, for each code interface.

For every task, ``--samples`` reward functions are sampled by the eureka plugin's first
request (the same prompt a run sends) from the configured LLM (the embedded model by
default), then taken through the real pipeline a run uses before training: extraction
and the static checks (:func:`core.codegen.program_from_reply`), the sandbox probe on
real states, vetting on reference episodes and up to ``vetting.repair`` repairs
(:func:`core.preflight.preflight`). A program is *usable* when it passes all of them
and would train. Each task is measured with both interfaces in one run:

- ``dict``: the earlier prompt (state read by string keys, a worked example of a made-up
  task, repair by re-sending the whole conversation);
- ``fields``: the prompt built from the task (a skeleton binding its fields, the sign
  rule, names checked before anything runs, the core's short repair request).

Prints one JSON object per task as it finishes, then the whole result: per task and
interface the usable share with a 95 % Wilson interval, the failure kinds, the run-time
errors that came from unknown fields or names, completion tokens and LLM seconds per
usable program. ``--out`` keeps the result on disk; a re-run with the same file skips
the (task, interface) cells already measured, so the benchmark resumes after a stop.
LLM seconds are what the requests took when they were made (a reply served from the
cache costs 0): measure with a fresh ``--cache`` for figures, reuse it to replay.

    python benchmarks/usable_rate.py --out docs/scaling/usable_rate.json --cache /tmp/usable-cache
    python benchmarks/usable_rate.py --tasks cartpole mountaincar --samples 4
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
import os
import re
import time
from collections import Counter
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

#: the tasks the targets name, and one they do not (the interface must follow from any task's definition)
TASKS = [
    "cartpole",
    "mountaincar",
    "acrobot",
    "pendulum",
    "lunarlander",
    "hopper",
    "reach",
    "kuka_grasp",
    "mountaincar_continuous",
]
INTERFACES = ["dict", "fields"]
#: a failure at run time that an unknown field or name caused
NAME_ERROR = re.compile(r"\b(KeyError|NameError|AttributeError)\b.*(field|not defined|has no attribute|is not)", re.S)


def wilson(successes: int, n: int, z: float = 1.96) -> list[float]:
    """The 95 % Wilson score interval of a share ``successes / n``."""
    if n == 0:
        return [0.0, 1.0]
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [round(max(0.0, centre - half), 3), round(min(1.0, centre + half), 3)]


class Records:
    """Where the run's texts and metrics go (the benchmark keeps them in memory, no MLflow run)."""

    def __init__(self) -> None:
        self.texts: dict[str, str] = {}
        self.metrics: dict[str, float] = {}

    def log_text(self, text: str, path: str) -> None:
        self.texts[path] = text

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.update(metrics)


def compose(overrides: list[str]) -> Any:
    from hydra import compose as hydra_compose, initialize_config_dir

    from core.resources import conf_dir

    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return hydra_compose(config_name="config", overrides=overrides)


def measure(task_name: str, interface: str, args: argparse.Namespace) -> dict[str, Any]:
    """Sample, check, probe, vet and repair ``args.samples`` reward programs for one task and interface."""
    from core.config import validate
    from core.context import RunContext
    from core.envs import make_task
    from core.llm.client import make_client
    from core.preflight import preflight
    from core.records import Candidate
    from core.registry import make_plugin_manager
    from plugins import eureka_reward as eureka

    config = compose(
        [
            f"env={task_name}",
            "+plugins=[eureka]",
            "plugins.eureka.iterations=1",
            f"plugins.eureka.samples={args.samples}",
            f"code.interface={interface}",
            f"seed={args.seed}",
            f"llm.cache_path={args.cache}",
            f"cache_dir={args.cache}",
            *args.override,
        ]
    )
    settings = validate(config, {"eureka": eureka})
    task = make_task(config.env)
    llm = make_client(config.llm)
    pm = make_plugin_manager(settings, modules={"eureka": eureka})
    run = RunContext(
        settings=settings,
        task=task,
        seed=args.seed,
        llm_factory=lambda: llm,
        pluginmanager=pm,  # the dict interface repairs through the plugin's own hook
        tracker=Records(),
    )
    plugin = pm.get_plugin("eureka")
    start = time.time()
    candidates: list[Candidate] = []
    for group in plugin.propose_rewards(run=run, iteration=0):
        candidates += [Candidate(id=f"it0-c{len(candidates) + i}", iteration=0, reward=p) for i, p in enumerate(group)]
    sampled = {"completion_tokens": llm.stats.completion_tokens, "llm_s": llm.stats.latency_s}
    rejected_first = sum(bool(c.reward.rejected) for c in candidates)
    failed = preflight(run, candidates)
    kinds: Counter[str] = Counter()
    name_errors: list[str] = []
    usable = 0
    fixes = repaired = 0
    for c in candidates:
        program = c.reward
        fixes += bool(program.meta.get("fixes"))
        repaired += int(program.meta.get("repairs", 0) or 0) > 0
        if program.rejected:
            kinds[str(program.meta.get("rejected_kind", "rejected"))] += 1
            continue
        if c.id in failed:
            result = failed[c.id]
            kinds[result.error_kind or "failed"] += 1
            if result.error_kind in ("exception", "invalid_value", "vetting") and NAME_ERROR.search(result.error or ""):
                name_errors.append(result.error.strip().splitlines()[-1][:200])
            continue
        usable += 1
    n = len(candidates)
    stats = llm.stats
    return {
        "task": task_name,
        "interface": interface,
        "samples": n,
        "usable": usable,
        "usable_share": round(usable / n, 3) if n else 0.0,
        "usable_ci95": wilson(usable, n),
        "unusable_replies_before_repair": rejected_first,
        "programs_repaired": repaired,
        "programs_with_name_fixes": fixes,
        "failure_kinds": dict(sorted(kinds.items())),
        "runtime_name_errors": len(name_errors),
        "runtime_name_error_examples": name_errors[:3],
        "completion_tokens": stats.completion_tokens,
        "completion_tokens_sampling": sampled["completion_tokens"],
        "llm_s": round(stats.latency_s, 1),
        "llm_s_sampling": round(sampled["llm_s"], 1),
        "llm_calls": stats.calls,
        "cache_hits": stats.cache_hits,
        "llm_s_per_usable": round(stats.latency_s / usable, 1) if usable else None,
        "completion_tokens_per_usable": round(stats.completion_tokens / usable) if usable else None,
        "wall_s": round(time.time() - start, 1),
        "commit": commit(),
        "load": round(os.getloadavg()[0], 2),
    }


def commit() -> str:
    """The checkout's commit (short), so cells measured at different commits say so."""
    from core.study import commit as full

    return full()[:7] + (" + changes" if "uncommitted" in full() else "")


def summary(cells: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals per interface and the ratio of LLM seconds per usable program (fields / dict)."""
    out: dict[str, Any] = {}
    for interface in INTERFACES:
        mine = [c for c in cells if c["interface"] == interface]
        n, usable = sum(c["samples"] for c in mine), sum(c["usable"] for c in mine)
        llm_s = sum(c["llm_s"] for c in mine)
        out[interface] = {
            "tasks": len(mine),
            "samples": n,
            "usable": usable,
            "usable_share": round(usable / n, 3) if n else 0.0,
            "usable_ci95": wilson(usable, n),
            "runtime_name_errors": sum(c["runtime_name_errors"] for c in mine),
            "llm_s": round(llm_s, 1),
            "llm_s_per_usable": round(llm_s / usable, 1) if usable else None,
        }
    both = {c["task"] for c in cells if c["interface"] == "fields"} & {
        c["task"] for c in cells if c["interface"] == "dict"
    }
    ratios = {}
    for task in sorted(both):
        d, f = (next(c for c in cells if c["task"] == task and c["interface"] == i) for i in ("dict", "fields"))
        if d["llm_s_per_usable"] and f["llm_s_per_usable"]:
            ratios[task] = round(f["llm_s_per_usable"] / d["llm_s_per_usable"], 3)
    out["llm_s_per_usable_ratio"] = ratios
    paired = [c for c in cells if c["task"] in both]
    dict_s = sum(c["llm_s"] for c in paired if c["interface"] == "dict")
    dict_u = sum(c["usable"] for c in paired if c["interface"] == "dict")
    fields_s = sum(c["llm_s"] for c in paired if c["interface"] == "fields")
    fields_u = sum(c["usable"] for c in paired if c["interface"] == "fields")
    out["llm_s_per_usable_ratio_overall"] = (
        round((fields_s / fields_u) / (dict_s / dict_u), 3) if dict_u and fields_u and dict_s else None
    )
    return out


def table(result: dict[str, Any]) -> str:
    """The result as a markdown table: a row per task, the two interfaces side by side."""
    rows = [
        (
            "| task | interface | usable (95 % CI) | failures | run-time name errors "
            "| completion tokens / usable | LLM s / usable |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in result["cells"]:
        lo, hi = c["usable_ci95"]
        kinds = ", ".join(f"{k} {v}" for k, v in c["failure_kinds"].items()) or "none"
        rows.append(
            f"| {c['task']} | {c['interface']} | {c['usable']}/{c['samples']} = {c['usable_share']:.2f} "
            f"[{lo:.2f}, {hi:.2f}] | {kinds} | {c['runtime_name_errors']} | "
            f"{c['completion_tokens_per_usable'] or '-'} | {c['llm_s_per_usable'] or '-'} |"
        )
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--interfaces", nargs="+", default=INTERFACES, choices=INTERFACES)
    parser.add_argument("--samples", type=int, default=16, help="reward functions sampled per task and interface")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--cache",
        default=str(Path.home() / ".cache" / "llm4rl" / "usable_rate"),
        help="LLM reply cache and reference episodes (fresh for timing figures)",
    )
    parser.add_argument("--out", default="", help="JSON file of the result; cells already in it are skipped")
    parser.add_argument(
        "--table", action="store_true", help="print the --out file's result as a markdown table and stop"
    )
    parser.add_argument("override", nargs="*", help="further Hydra overrides (llm=..., vetting.repair=...)")
    args = parser.parse_args()
    if args.table:
        print(table(json.loads(Path(args.out).read_text())))
        return

    import torch

    torch.set_num_threads(1)
    out = Path(args.out) if args.out else None
    done: dict[str, Any] = json.loads(out.read_text()) if out is not None and out.exists() else {}
    cells: list[dict[str, Any]] = list(done.get("cells", []))
    kept = {k: v for k, v in done.items() if k not in ("cells", "summary")}  # notes kept beside the figures
    for task in args.tasks:
        for interface in args.interfaces:
            if any(c["task"] == task and c["interface"] == interface and c["samples"] == args.samples for c in cells):
                continue
            cell = measure(task, interface, args)
            print(json.dumps(cell), file=sys.stderr, flush=True)
            cells.append(cell)
            if out is not None:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({**kept, "cells": cells, "summary": summary(cells)}, indent=1) + "\n")
    from core.llm.embedded import loaded_info

    result = {
        **kept,
        "benchmark": "usable_rate",
        "samples": args.samples,
        "seed": args.seed,
        "model": loaded_info(),
        "commits": sorted({str(c.get("commit", "")) for c in cells}),
        "cells": cells,
        "summary": summary(cells),
    }
    if out is not None:
        out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
