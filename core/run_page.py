"""The MLflow pages that explain a run: Markdown for the parent run and its candidates.

MLflow shows a run's ``mlflow.note.content`` tag as its description, rendered as Markdown
at the top of the run page. The parent run's page says what was tried (one table row per
candidate, linked to its run), which candidate won and by which rule, the winning code,
and what the run cost (LLM calls and tokens, frames, time, money). Each candidate's page
says where it belongs, how it scored or why it failed, and its code.

Everything here is a pure function from records to text; :class:`core.tracking.Tracker`
writes the result. MLflow keeps at most :data:`TAG_LIMIT` characters of a tag, so a page
shortens its code blocks, then its table, to fit (the full code stays an artifact).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Iterable, TypeGuard

#: MLflow's limit on a run tag's value (``mlflow.utils.validation.MAX_TAG_VAL_LENGTH``)
TAG_LIMIT = 8000
#: the run tag MLflow shows as a run's description
NOTE_TAG = "mlflow.note.content"
#: the tag that marks the winning candidate's run
WINNER_TAG = "llm4rl.winner"


def fence(text: str, info: str = "") -> str:
    """``text`` as a fenced code block whose fence no backtick run inside can close.

    CommonMark closes a fence only with a run of backticks at least as long as the
    opening one, so the fence is one backtick longer than the longest run in ``text``.
    """
    longest = max((len(m) for m in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{info}\n{text.rstrip()}\n{ticks}"


def cell(text: Any) -> str:
    """A value made safe for one Markdown table cell (no pipes, no line breaks)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def number(value: float | None, digits: int = 4) -> str:
    """A score as people read it: ``487.3``, ``0.125``, ``-`` for none, ``NaN``."""
    if value is None:
        return "-"
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    if isinstance(value, float) and math.isinf(value):
        return "-"
    return f"{value:.{digits}g}"


#: MLflow 3's UI opens in its GenAI mode unless told: this query keeps it in model training
ML_VIEW = "workflowType=machine_learning"


def run_link(experiment_id: str, run_id: str) -> str:
    """A link to a run that works inside the MLflow UI (its hash routes), in the model-training view."""
    return f"#/experiments/{experiment_id}/runs/{run_id}?{ML_VIEW}"


def winner_rule(fitness_name: str) -> str:
    """The rule :attr:`core.context.RunContext.best` applies, in words."""
    return (
        f"the highest `{fitness_name}` in the final evaluation among the candidates that trained "
        "without error; a candidate whose policy a later candidate continued counts through that successor"
    )


@dataclass
class Row:
    """One candidate in the parent run's table."""

    iteration: int
    sample: str  # the reply's index in its LLM call, or the candidate's index in its iteration
    candidate: str  # the candidate id (``it1-c0``)
    name: str  # its MLflow run name (``eureka-s0/it1-c0``)
    fitness: float | None
    status: str  # ``ok``, or the error kind (``timeout``, ``rejected``, ...)
    run_id: str = ""
    winner: bool = False
    reason: str = ""  # why it failed, one line (:func:`reason`)


def status_of(result: Any) -> str:
    """``ok``, or the kind of error that stopped the candidate (with the exception's class
    when the kind is a bare ``exception``: ``exception: ZeroDivisionError``)."""
    if result.ok:
        return "ok"
    kind = result.error_kind or "failed"
    if kind in ("exception", "failed") and result.error:
        match = re.match(
            r"([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt))\b", result.error.strip().splitlines()[-1]
        )
        if match:
            return f"{kind}: {match.group(1)}"
    return kind


#: the length of a failed candidate's one-line reason (its ``error`` tag, the table's column)
REASON_CHARS = 200
#: lines an error text holds for the LLM's repair, not as its reason (the sandbox's list of the
#: state's fields, :func:`core.sandbox.functions.fields_line`)
PREAMBLES = ("The state has exactly these fields:",)


def reason(result: Any) -> str:
    """Why a candidate failed, in one line of at most :data:`REASON_CHARS` characters ("" when it
    did not): a traceback's last line (the exception), else the error text's first line (after
    any :data:`PREAMBLES`; a line ending in ``:`` takes the next one along)."""
    if result.ok or not result.error:
        return ""
    lines = [
        line.strip()
        for line in result.error.strip().splitlines()
        if line.strip() and not line.strip().startswith(PREAMBLES)
    ]
    if not lines:
        return ""
    if any(line.startswith("Traceback") for line in lines):
        line = lines[-1]
    else:  # a heading that introduces what follows ("The code reads names that do not exist:") takes its next line
        line = lines[0].lstrip("#").strip()
        if line.endswith(":") and len(lines) > 1:
            line = f"{line} {lines[1].lstrip('-* ').strip()}"
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 3].rstrip() + "..."


def sample_of(candidate: Any) -> str:
    """The LLM reply a candidate came from (``meta["sample"]`` of its programs), else its index."""
    samples = []
    for part in (candidate.reward, candidate.state, *[m.program for m in candidate.macros]):
        if part is not None and "sample" in getattr(part, "meta", {}):
            samples.append(str(part.meta["sample"]))
    if samples:
        return ",".join(samples)
    match = re.search(r"-c(\d+)$", candidate.id)
    return match.group(1) if match else "-"


def rows(history: Iterable[Any], parent_name: str, winner_id: str = "") -> list[Row]:
    """The table rows of every candidate in ``history`` (``IterationResult`` records)."""
    out = []
    for it in history:
        for c, r in zip(it.candidates, it.results):
            fitness = r.fitness.value if r.fitness is not None else None
            out.append(
                Row(
                    c.iteration,
                    sample_of(c),
                    c.id,
                    candidate_run_name(parent_name, c.id),
                    fitness,
                    status_of(r),
                    r.run_id,
                    c.id == winner_id,
                    reason(r),
                )
            )
    return out


def candidate_run_name(parent_name: str, candidate_id: str) -> str:
    """A candidate's run name carries its parent's, so names stay unique across runs."""
    return f"{parent_name}/{candidate_id}" if parent_name else candidate_id


def programs(candidate: Any) -> list[tuple[str, Any]]:
    """``(heading, program)`` for each program the candidate holds."""
    out = []
    if candidate.reward is not None:
        out.append(("reward", candidate.reward))
    if candidate.state is not None:
        out.append(("state", candidate.state))
    out += [(f"macro `{m.name}`", m.program) for m in candidate.macros]
    return out


def code_section(candidate: Any, limit: int | None = None, level: str = "##") -> str:
    """The candidate's programs as fenced Python, each cut to ``limit`` characters if given."""
    parts = []
    for heading, program in programs(candidate):
        source = program.source or "(no code)"
        if limit is not None and len(source) > limit:
            source = source[:limit].rstrip() + "\n# ... (cut here; the whole program is this run's artifact)"
        origin = f" from `{program.origin}`" if program.origin else ""
        parts.append(f"{level} {heading}: `{program.entry}`{origin}\n\n{fence(source, 'python')}")
    if candidate.envs:
        lines = [f"- `{cell(e.name)}`: {cell(e.params)}" for e in candidate.envs]
        parts.append(f"{level} training envs\n\n" + "\n".join(lines))
    if not parts:
        parts.append(f"{level} code\n\nNone: the env's own reward and observation (the baseline).")
    return "\n\n".join(parts)


def table(table_rows: list[Row], experiment_id: str, fitness_name: str) -> str:
    """The candidate table, one row per candidate, the winner in bold."""
    head = (
        f"| iteration | sample | candidate | {cell(fitness_name)} | status | why it failed | run |\n"
        "|---:|---:|---|---:|---|---|---|"
    )
    lines = [head]
    for r in table_rows:
        name = f"**`{cell(r.name)}`** (winner)" if r.winner else f"`{cell(r.name)}`"
        link = f"[open]({run_link(experiment_id, r.run_id)})" if r.run_id else "-"
        why = cell(r.reason[:80] + ("..." if len(r.reason) > 80 else "")) if r.reason else ""
        lines.append(
            f"| {r.iteration} | {cell(r.sample)} | {name} | {number(r.fitness)} | {cell(r.status)} | {why} | {link} |"
        )
    return "\n".join(lines)


def cost_section(llm: dict[str, float], frames: int, seconds: float, candidates: int, failed: int) -> str:
    """What the run spent: LLM calls, tokens, LLM time and money; frames and wall time."""
    calls = int(llm.get("llm/calls", 0))
    lines = ["| what | amount |", "|---|---:|"]
    if calls:
        lines += [
            f"| LLM calls | {calls} ({int(llm.get('llm/cache_hits', 0))} replies from the cache) |",
            f"| LLM tokens | {int(llm.get('llm/prompt_tokens', 0))} prompt + "
            f"{int(llm.get('llm/completion_tokens', 0))} completion |",
            f"| waiting on the LLM | {llm.get('llm/wait_s', 0.0):.1f} s |",
            f"| LLM cost | ${llm.get('llm/cost', 0.0):.4f} |",
        ]
    else:
        lines.append("| LLM calls | none |")
    lines += [
        f"| candidates | {candidates} ({failed} failed) |",
        f"| training frames | {frames} |",
        f"| wall time | {seconds:.1f} s |",
    ]
    return "\n".join(lines)


def outcome_line(*, task: str, fitness_name: str, history: list[Any], best: tuple[Any, Any] | None) -> str:
    """The run's result in one line, for the top of its page, its ``llm4rl.result`` tag and the runs
    table: the winner and its score, then how many candidates trained and why the others failed."""
    results = [r for it in history for r in it.results]
    failed = [r for r in results if not r.ok]
    kinds: dict[str, int] = {}
    for r in failed:
        kinds[status_of(r)] = kinds.get(status_of(r), 0) + 1
    why = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    counts = f"{len(results)} candidate(s): {len(results) - len(failed)} trained" + (
        f", {len(failed)} failed ({why})" if failed else ""
    )
    if best is None:
        return f"{task}: no winner. {counts}"
    c, r = best
    made = [(role, getattr(part, "origin", "")) for role, part in (getattr(c, "parts", None) or {}).items()]
    parts = ", ".join(f"{role} by {origin}" if origin else role for role, origin in made) or "the baseline"
    return f"{task}: winner {c.id} ({parts}), {fitness_name} {number(r.score)}. {counts}"


def parent_page(
    *,
    name: str,
    task: str,
    fitness_name: str,
    experiment_id: str,
    history: list[Any],
    best: tuple[Any, Any] | None,
    llm: dict[str, float],
    seconds: float,
    final: list[float] | None = None,
    limit: int = TAG_LIMIT,
) -> str:
    """The parent run's description (Markdown, at most ``limit`` characters).

    :param history: the run's ``IterationResult`` records (candidates with their results,
        each result's ``run_id`` set by the tracker).
    :param best: the winning ``(candidate, result)``, None when no candidate trained.
    :param llm: the LLM client's ``llm/*`` metrics; ``final``: the final-seed scores.
    """
    winner_id = best[0].id if best else ""
    table_rows = rows(history, name, winner_id)
    results = [r for it in history for r in it.results]
    frames = sum(r.frames for r in results)
    failed = sum(not r.ok for r in results)
    # the first line carries the result: MLflow shows a description collapsed, its first lines only
    summary = f"**{cell(outcome_line(task=task, fitness_name=fitness_name, history=history, best=best))}**"
    if best is not None:
        c, r = best
        link = run_link(experiment_id, r.run_id) if r.run_id else ""
        run_name = candidate_run_name(name, c.id)
        shown = f"[`{run_name}`]({link})" if link else f"`{run_name}`"
        head = (
            f"{summary}\n\n"
            f"**Winner:** {shown}, iteration {c.iteration}, sample {sample_of(c)}, "
            f"`{cell(fitness_name)}` = {number(r.score)}.\n\n"
            f"**Rule:** {winner_rule(fitness_name)}."
        )
        if final:
            head += (
                f"\n\n**Final seeds:** the winner scored {', '.join(number(v) for v in final)} "
                f"(mean {number(sum(final) / len(final))}) on {len(final)} seed(s), the search's own included."
            )
    else:
        first = next((reason(r) for r in results if not r.ok and reason(r)), "")
        head = (
            f"{summary}\n\nNo candidate trained without error ({len(results)} tried); the table gives each "
            "one's error kind" + (f", the first error: `{cell(first)}`." if first else ".")
        )
    costs = "## Cost\n\n" + cost_section(llm, frames, seconds, len(results), failed)

    def page(code_limit: int | None, shown_rows: list[Row]) -> str:
        hidden = len(table_rows) - len(shown_rows)
        more = f"\n\n{hidden} more candidate(s) are in the runs table below this run." if hidden else ""
        code = ("## Winning code\n\n" + code_section(best[0], code_limit, "###")) if best else ""
        sections = [
            head,
            f"## Candidates ({len(table_rows)})\n\n" + table(shown_rows, experiment_id, fitness_name) + more,
            code,
            costs,
        ]
        return "\n\n".join(s for s in sections if s) + "\n"

    text = page(None, table_rows)
    for code_limit in (3000, 1500, 600):  # shorten the code first, then the table
        if len(text) <= limit:
            return text
        text = page(code_limit, table_rows)
    kept = sorted(table_rows, key=lambda r: (not r.winner, -(r.fitness if _real(r.fitness) else -math.inf)))
    while len(text) > limit and len(kept) > 1:
        kept = kept[: max(1, len(kept) * 3 // 4)]
        text = page(600, [r for r in table_rows if r in kept])
    return text[:limit]


def candidate_page(
    *,
    candidate: Any,
    result: Any,
    parent_name: str,
    parent_id: str,
    experiment_id: str,
    fitness_name: str = "fitness",
    winner: str = "",
    limit: int = TAG_LIMIT,
) -> str:
    """A candidate run's description: its place in the run, its score or error, its code.

    :param winner: the rule that made it the run's winner, or "" when it did not win.
    """
    parent = f"[`{parent_name or parent_id}`]({run_link(experiment_id, parent_id)})" if parent_id else "-"
    where = (
        f"Candidate `{candidate.id}` of run {parent}, iteration {candidate.iteration}, sample {sample_of(candidate)}"
    )
    if result.ok:  # the first line carries the result (MLflow shows a description collapsed)
        score = number(result.fitness.value) if result.fitness is not None else "not scored"
        lines = [
            f"**`{cell(fitness_name)}` = {score}**"
            + (" (winner of the run)" if winner else "")
            + f", {result.frames} frames in {result.seconds:.1f} s.",
            f"{where}: status **ok**.",
        ]
    else:  # a failed candidate has no score: say why, not "fitness = -"
        status, why = status_of(result), reason(result) or "no error text"
        said = status.split(": ")[-1]  # "exception: NameError" is said by "NameError: name 'x' ..."
        lines = [
            f"**Failed: {cell(why)}**" if why.startswith(said) else f"**Failed ({cell(status)}): {cell(why)}**",
            f"{where}: not scored"
            + (f" ({result.frames} frames in {result.seconds:.1f} s)" if result.frames else "")
            + "; the whole error is below and in this run's `error.txt`.",
        ]
    if winner:
        lines.append(f"**Winner of the run.** Rule: {winner}.")
    if not result.ok and result.error:
        error = "\n".join(result.error.strip().splitlines()[-30:])
        lines.append(f"## Error ({cell(status_of(result))})\n\n{fence(error[-2500:])}")
    head = "\n\n".join(lines)
    for code_limit in (None, 3000, 1200, 400):
        text = head + "\n\n" + code_section(candidate, code_limit) + "\n"
        if len(text) <= limit:
            return text
    return text[:limit]


def _real(value: float | None) -> TypeGuard[float]:
    return value is not None and math.isfinite(value)
