"""Replay check: does a study re-run from its committed replies, with no LLM, reproduce it?

A study writes the LLM replies its cells used beside its report
(``<report folder>/replies.jsonl.gz``) and the runs it counted
(``<report folder>/runs.jsonl.gz``). Re-run the cells from the replies in a fresh store:

    python -m core.study results --tasks cartpole --arms eureka_1x8,text2reward \\
        --replies docs/results/replies.jsonl.gz --no-archive --store /tmp/replay \\
        --out /tmp/replay/report/results.md

then compare each replayed cell with the archived run of the same name (``--archive`` may
also be the recorded study's store):

    python benchmarks/replay_check.py --archive docs/results/runs.jsonl.gz --store /tmp/replay

Per cell it prints whether the *programs* were reproduced (the replay sent no request to
an LLM, and the candidates, rejections and trainings are the recorded ones), whether the
same candidate won (chosen by training, so ties and near-ties follow its numerics) and
whether the *scores* were (the same fitness and fresh-seed score). Scores can only repeat
where training is bit-for-bit deterministic: on one thread of the same kind of CPU. The
machine each run recorded is printed beside it. A search that found no policy is compared
too (the same failures are a reproduced result); a recording that was cut short (a killed
run) is not compared. A replayed cell that ended otherwise than
its recording (``not replayable`` in the study's log: a request the replies do not hold)
is listed apart with its note. Prints one JSON object.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import json
from typing import Any

#: what decides which programs a cell trained, and which of them won
PROGRAM_FIGURES = ("candidates", "candidates_rejected", "candidates_trained", "llm_programs_trained")
#: what the cell scored: its own training, and its winner retrained on fresh seeds
SCORE_FIGURES = ("fitness", "final/fresh_mean")


def _figures(run: Any) -> dict[str, Any]:
    metrics = run.metrics
    return {
        "status": run.status,
        **{k: metrics.get(k) for k in PROGRAM_FIGURES + SCORE_FIGURES},
        "winner": run.tags.get("best_candidate"),
        "llm_calls": metrics.get("llm/calls"),
        "machine": run.tags.get("study.machine", ""),
    }


def compare(archived: Any, replayed: Any) -> dict[str, Any]:
    """One cell: the recorded and the replayed figures, and what was reproduced."""
    was, now = _figures(archived), _figures(replayed)
    requests = replayed.metrics.get("llm/requests", 0.0)
    same_programs = requests == 0 and all(was[k] == now[k] for k in ("status", *PROGRAM_FIGURES))
    return {
        "cell": replayed.name,
        "recorded": was,
        "replayed": now,
        "llm_requests": requests,
        "by_position": replayed.metrics.get("llm/by_position", 0.0),
        "same_programs": same_programs,
        "same_winner": same_programs and was["winner"] == now["winner"],  # ties and near-ties follow training
        "same_scores": same_programs and all(was[k] == now[k] for k in SCORE_FIGURES),
        "same_machine": was["machine"] == now["machine"],
    }


def check(archive: Path, store: Path, study: str) -> dict[str, Any]:
    from core.report.archive import read_runs
    from core.report.data import load_study
    from core.study import tracking_uri

    was = read_runs(archive, study) if archive.is_file() else load_study(tracking_uri(archive), study)
    # the runs that ended by themselves: with a score, or a search that found no policy (a result too)
    recorded = {r.name: r for r in was if r.mlflow_status == "FINISHED"}
    cells, unanswered = [], []
    for run in sorted(load_study(tracking_uri(store), study), key=lambda r: r.name):
        if run.name not in recorded:
            continue  # its recording was cut short (or is not in the archive): nothing to compare with
        if run.mlflow_status != "FINISHED":
            unanswered.append({"cell": run.name, "note": run.note})
        else:
            cells.append(compare(recorded[run.name], run))
    return {
        "archive": str(archive),
        "store": str(store),
        "cells": len(cells),
        "programs_reproduced": sum(c["same_programs"] for c in cells),
        "winners_reproduced": sum(c["same_winner"] for c in cells),
        "scores_reproduced": sum(c["same_scores"] for c in cells),
        "replies_found_by_place": sum(c["by_position"] for c in cells),
        "not_replayed": unanswered,
        "per_cell": cells,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--archive", type=Path, required=True, help="the runs.jsonl.gz a study committed, or the study's own store"
    )
    parser.add_argument("--store", type=Path, required=True, help="the store of the replay (--store of the re-run)")
    parser.add_argument("--study", default="results", help="the study's name (its spec)")
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    args = parser.parse_args(argv)
    result = check(args.archive, args.store, args.study)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
