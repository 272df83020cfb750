"""What each plugin's LLM put into one run, in words, for the end-of-run summary.

A run can end with a fitness while a method's LLM contributed nothing (every sampled
program failed and the env's own reward trained; a judge's term never changed a step);
the summary says so per plugin, so that such a run is never mistaken for the method's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

#: the per-training measure the in-training plugins log (core.report.contribution reads it for studies)
CHANGED_SHARE = "llm/changed_share"


@dataclass
class Contribution:
    """One plugin's part in a run."""

    plugin: str
    role: str  # reward, state, macros, environment, in training
    text: str  # what it put in, in words
    nothing: bool  # its LLM put nothing into any trained candidate


def contributions(
    plugins: list[str], pairs: list[tuple[Any, Any]], best: Any | None, env_writers: frozenset[str] = frozenset()
) -> list[Contribution]:
    """Per enabled plugin: what its LLM-written parts did in the run's candidates ``pairs``
    (candidate, result), or what it changed inside the best training (``llm/changed_share``).
    ``best`` is the (candidate, result) the run chose, or None; ``env_writers`` the plugins
    that implement ``generate_envs`` (a candidate's worlds carry no origin of their own)."""
    out = []
    for plugin in plugins:
        programs: dict[str, list[tuple[Any, Any]]] = {}
        for candidate, result in pairs:
            for role, program in candidate.programs:
                if program.origin == plugin and program.reply:
                    programs.setdefault(role, []).append((program, result))
        for role, found in programs.items():
            usable = [(p, r) for p, r in found if not p.rejected]
            trained = sum(r.ok for _, r in usable)
            in_best = best is not None and any(p.origin == plugin and p.reply for _, p in best[0].programs)
            if trained == 0:
                fallback = (
                    f"the chosen candidate trained on the task's own {role}"
                    if best is not None
                    else "no candidate trained"
                )
                text = (
                    f"{len(found)} LLM program(s), {len(usable)} usable, none trained: the LLM contributed "
                    f"nothing; {fallback}"
                )
            else:
                text = (
                    f"{len(found)} LLM program(s), {len(usable)} usable, {trained} trained; the chosen candidate "
                    + ("uses one" if in_best else "does not (the task's own, or another plugin's)")
                )
            out.append(Contribution(plugin, role, text, trained == 0))
        if programs:
            continue
        if plugin in env_writers:
            generated = [r for c, r in pairs if c.envs]
            trained = sum(r.ok for r in generated)
            out.append(
                Contribution(
                    plugin,
                    "environment",
                    f"{len(generated)} candidate(s) with LLM-written worlds, {trained} trained",
                    trained == 0,
                )
            )
            continue
        share = best[1].metrics.get(CHANGED_SHARE) if best is not None else None
        if share is not None:
            out.append(
                Contribution(
                    plugin, "in training", f"LLM output changed {share:.1%} of the chosen training's steps", share == 0
                )
            )
        else:
            out.append(Contribution(plugin, "", "logged no measure of its LLM's part", False))
    return out
