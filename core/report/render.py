"""Rendering a study report: Markdown tables, an HTML page, and the PNG figures.

The Markdown is the source of truth; the HTML page is made from it by a converter for
the small subset the report uses (headings, paragraphs, bullet lists, pipe tables,
images), so the two never disagree and no Markdown package is needed.
"""

from __future__ import annotations

import html
import re
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import matplotlib

matplotlib.use("Agg")  # headless
import matplotlib.pyplot as plt
import numpy as np

from core.report.data import COST_METRICS, FAILED, OK, TRAIN_RETURN, UNFINISHED, StudyRun, TaskResult

if TYPE_CHECKING:
    from core.report.stats import Interval


def number(v: float) -> str:
    if v != v:
        return "—"
    return f"{v:,.0f}" if abs(v) >= 100 or float(v).is_integer() else f"{v:.3g}"


def estimate(interval: Interval, n: int) -> str:
    """An estimate over ``n`` runs with its CI; one run has no interval to show, so it says so."""
    if n == 1 and np.isfinite(interval.value):
        return f"{number(interval.value)} (n=1, no CI)"
    return interval.fmt()


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    cells = [[c.replace("|", "\\|") for c in row] for row in rows]
    return ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"] + [
        "| " + " | ".join(r) + " |" for r in cells
    ]


def best_of_note(t: TaskResult) -> str:
    """A caveat where an arm's score is the best of several candidates and another arm's is one training."""
    if t.metric != "fitness":
        return ""
    many = [a for a in t.arms if a.candidates > 1 and a.scores]
    single = [a for a in t.arms if a.candidates <= 1 and a.scores]
    if not (many and single):
        return ""
    which = ", ".join(f"{a.arm} (best of {number(a.candidates)})" for a in many)
    return (
        f"**Best of N**: the score of {which} is the best of that many candidates per run, each trained on "
        f"the run's seed and picked by the same {t.fitness_name} it is scored on, against one training per run "
        f"of {', '.join(a.arm for a in single)}. Selection lifts a best-of-N score even when no candidate is "
        "better (the more candidates, the more), so P(X > Y) favours the searching arm. Retrain the winner on "
        "fresh seeds (`final_seeds=N`) and report `--metric final/fresh_mean` for a comparison free of it."
    )


def curve_note(t: TaskResult) -> str:
    """What the curves show when the evaluations were too few to draw them."""
    if t.curve_metric == "fitness":
        return ""
    return (
        f"**Curves from training returns**: a run of this task has {t.eval_points} evaluation(s) of its best "
        f"candidate (`trainer.eval_every` at or above `trainer.frames`?), too few for a curve, so the curves show "
        f"`{t.curve_metric}`, the mean return of the training episodes in the task env's own reward, not the "
        f"{t.fitness_name} of evaluation episodes."
    )


def render_markdown(
    tasks: list[TaskResult], runs: list[StudyRun], experiment: str, reps: int, figures: dict[str, list[str]]
) -> str:
    """The whole report as Markdown."""
    count = {s: sum(r.status == s for r in runs) for s in (OK, FAILED, UNFINISHED)}
    lines = [
        f"# Study report: `{experiment}`",
        "",
        f"{len(runs)} runs: {count[OK]} finished, {count[FAILED]} failed, {count[UNFINISHED]} unfinished; "
        f"{len(tasks)} task(s). Final fitness per run is the best candidate's fitness (metric `fitness` of the run).",
        "",
        f"Statistics over seeds (runs): interquartile mean (IQM) and mean with 95 % stratified-bootstrap "
        f"confidence intervals ({reps} replications, percentile method), and the probability of improvement "
        "P(X > Y) (Agarwal et al., NeurIPS 2021, computed with `rliable`). Only finished runs enter the "
        "statistics; an arm with failed or missing seeds is marked **PARTIAL** and its `n` says how many runs it has.",
    ]
    for t in tasks:
        lines += ["", f"## {t.env}: {t.fitness_name}", ""]
        rows = []
        for a in t.arms:
            per_seed = ", ".join(f"{s}: {number(v)}" for s, v in a.scores.items()) or "—"
            status = a.status()  # as the console says it
            rows.append(
                [
                    a.arm,
                    f"{len(a.scores)}/{len(t.seeds)}",
                    a.iqm.fmt(),
                    a.mean.fmt(),
                    per_seed,
                    number(a.candidates),
                    status,
                ]
            )
        lines += table(["arm", "n", "IQM [95% CI]", "mean [95% CI]", "per seed", "candidates / run", "status"], rows)
        if note := best_of_note(t):
            lines += ["", note]
        partial = [a.arm for a in t.arms if not a.complete]
        if partial:
            lines += [
                "",
                f"**Partial study**: {', '.join(partial)} lack finished runs for some seeds; "
                "their statistics cover fewer runs than the other arms.",
            ]
        if t.improvement:
            lines += ["", "### Probability of improvement", ""]
            rows = [[x, y, p.fmt()] for x, y, p in t.improvement]
            lines += table(["X", "Y", "P(X > Y) [95% CI]"], rows)
        if note := curve_note(t):
            lines += ["", note]
        for name in figures.get(t.env, []):
            lines += ["", f"![{name}]({name})"]
        lines += ["", "### LLM cost and compute (totals over the arm's runs)", ""]
        rows = [[a.arm] + [number(a.cost[k]) for k, _ in COST_METRICS] for a in t.arms]
        lines += table(["arm"] + [title for _, title in COST_METRICS], rows)
    problems = [r for r in runs if r.status != OK]
    if problems:
        lines += ["", "## Runs left out of the statistics", ""]
        lines += [f"- `{r.name}` ({r.env}, {r.arm}, seed {r.seed}): {r.status}, {r.note}" for r in problems]
    return "\n".join(lines) + "\n"


def render_html(markdown: str, title: str) -> str:
    """An HTML page of the report's Markdown subset."""
    body: list[str] = []
    pending: list[str] = []  # the rows of the pipe table being read
    in_list = False

    def inline(text: str) -> str:
        text = html.escape(text).replace("\\|", "|")
        text = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", text)
        return re.sub(r"`(.+?)`", r"<code>\1</code>", text)

    def flush_table() -> None:
        if pending:
            rows = [[c.strip() for c in re.split(r"(?<!\\)\|", row.strip()[1:-1])] for row in pending]
            head, data = rows[0], rows[2:]
            body.append("<table><tr>" + "".join(f"<th>{inline(c)}</th>" for c in head) + "</tr>")
            body.extend("<tr>" + "".join(f"<td>{inline(c)}</td>" for c in r) + "</tr>" for r in data)
            body.append("</table>")
            pending.clear()

    for line in markdown.splitlines():
        if line.startswith("|"):
            pending.append(line)
            continue
        flush_table()
        if in_list and not line.startswith("- "):
            body.append("</ul>")
            in_list = False
        if m := re.match(r"^(#{1,6}) (.*)$", line):
            level = len(m.group(1))
            body.append(f"<h{level}>{inline(m.group(2))}</h{level}>")
        elif m := re.match(r"^!\[(.*?)\]\((.*?)\)$", line):
            body.append(f'<p><img src="{html.escape(m.group(2))}" alt="{html.escape(m.group(1))}"></p>')
        elif line.startswith("- "):
            if not in_list:
                body.append("<ul>")
                in_list = True
            body.append(f"<li>{inline(line[2:])}</li>")
        elif line.strip():
            body.append(f"<p>{inline(line)}</p>")
    flush_table()
    if in_list:
        body.append("</ul>")
    style = (
        "body{font-family:sans-serif;max-width:70em;margin:2em auto}table{border-collapse:collapse}"
        "td,th{border:1px solid #ccc;padding:.3em .6em}img{max-width:100%}"
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{style}</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n"
    )


# -- figures ------------------------------------------------------------------------------


FIGURES = ("final", "improvement", "curves")  # the kinds of figure per task


def render_figures(tasks: list[TaskResult], out: Path, kinds: tuple[str, ...] = FIGURES) -> dict[str, list[str]]:
    """PNG files per task (final scores, improvement, curves: those in ``kinds``); env -> file names."""
    draws = {"final": _final_figure, "improvement": _improvement_figure, "curves": _curve_figure}
    files: dict[str, list[str]] = {}
    for t in tasks:
        names = []
        for suffix in kinds:
            fig = draws[suffix](t)
            if fig is None:
                continue
            name = f"{_safe(t.env)}_{suffix}.png"
            fig.savefig(out / name, bbox_inches="tight")  # long labels are kept whole
            plt.close(fig)
            names.append(name)
        files[t.env] = names
    return files


def _safe(name: str) -> str:
    return re.sub(r"[^\w\-]+", "_", name)


#: characters per line of an arm's label in figures, and lines at most
LABEL_WIDTH, LABEL_LINES = 28, 3


def abbreviate(arm: str) -> str:
    """``count_bonus plugins.count_bonus.beta=1.0`` -> ``count_bonus beta=1.0``: the arm's own
    plugins' knobs without their ``plugins.<name>.`` prefix."""
    head = arm.split(" ", 1)[0]
    for name in head.split("+"):
        arm = arm.replace(f" plugins.{name}.", " ")
    return arm


def short_label(arm: str, width: int = LABEL_WIDTH, lines: int = LABEL_LINES) -> str:
    """An arm's label for a figure: a knob of the arm's own plugin without its ``plugins.<name>.``
    prefix (``count_bonus plugins.count_bonus.beta=1.0`` -> ``count_bonus beta=1.0``), wrapped
    at spaces to ``width`` and cut with an ellipsis after ``lines`` lines."""
    arm = abbreviate(arm)
    wrapped = textwrap.wrap(arm, width, break_on_hyphens=False) or [arm]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][: width - 1].rstrip() + "…"
    return "\n".join(wrapped)


def _rows_height(labels: list[str]) -> float:
    return 0.6 + sum(0.3 + 0.17 * label.count("\n") for label in labels) + 0.25 * len(labels)


def _final_figure(t: TaskResult):
    arms = t.arms
    labels = [short_label(f"{a.arm} (n={len(a.scores)})") for a in arms]
    fig, ax = plt.subplots(figsize=(6.4, _rows_height(labels)), dpi=110)
    for i, a in enumerate(arms):
        if np.isfinite(a.iqm.value):
            ax.plot([a.iqm.low, a.iqm.high], [i, i], lw=6, alpha=0.35, color=f"C{i}", solid_capstyle="butt")
            ax.plot([a.iqm.value], [i], "|", ms=16, mew=2, color=f"C{i}")
        ax.scatter(list(a.scores.values()), [i] * len(a.scores), s=14, color="k", zorder=3)
    ax.set_yticks(range(len(arms)), labels)
    ax.invert_yaxis()  # the first arm (the reference) on top
    ax.set_xlabel(f"final {t.fitness_name}: IQM, 95% CI, runs")
    ax.set_title(t.env)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _improvement_figure(t: TaskResult):
    rank = {a.arm: i for i, a in enumerate(t.arms)}  # one direction per pair: a later arm X against an earlier Y
    pairs = [(x, y, p) for x, y, p in t.improvement if np.isfinite(p.value) and rank.get(x, 0) > rank.get(y, 0)]
    if not pairs:
        return None
    labels = [
        short_label(f"P({abbreviate(x)} > {abbreviate(y)})", width=LABEL_WIDTH + 8, lines=2 * LABEL_LINES)
        for x, y, _ in pairs
    ]
    fig, ax = plt.subplots(figsize=(6.4, _rows_height(labels)), dpi=110)
    for i, (_, _, p) in enumerate(pairs):
        ax.plot([p.low, p.high], [i, i], lw=6, alpha=0.35, color="C0", solid_capstyle="butt")
        ax.plot([p.value], [i], "|", ms=16, mew=2, color="C0")
    ax.axvline(0.5, color="grey", ls="--", lw=1)
    ax.set_xlim(0, 1)
    ax.set_yticks(range(len(pairs)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("probability of improvement (95% CI)")
    ax.set_title(t.env)
    fig.tight_layout()
    return fig


def _curve_figure(t: TaskResult):
    arms = [(i, a) for i, a in enumerate(t.arms) if a.curve]  # an arm's colour as in the final-score figure
    if not arms:
        return None
    fig, ax = plt.subplots(figsize=(6.4, 3.8), dpi=110)
    for i, a in arms:
        c = a.curve
        ax.plot(
            c["frames"],
            c["iqm"],
            marker="o",
            ms=3,
            color=f"C{i}",
            label=short_label(f"{a.arm} (n={int(c['runs'][0])})", width=2 * LABEL_WIDTH),
        )
        ax.fill_between(c["frames"], c["low"], c["high"], color=f"C{i}", alpha=0.2)
    ax.set_xlabel("frames (best candidate's training)")
    train = t.curve_metric == TRAIN_RETURN
    ax.set_ylabel(f"{'training return' if train else t.fitness_name} (IQM, 95% CI)")
    ax.set_title(f"{t.env}: sample efficiency" + (" (training returns: too few evaluations)" if train else ""))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.24))  # below the axes, never over a curve
    fig.tight_layout()
    return fig


def aggregate_figure(rows: list[tuple[str, Interval]], xlabel: str):
    """Per arm a point with its 95 % CI (the interval-estimate figure of rliable's papers); None if none is finite."""
    rows = [(arm, iv) for arm, iv in rows if np.isfinite(iv.value)]
    if not rows:
        return None
    labels = [short_label(arm) for arm, _ in rows]
    fig, ax = plt.subplots(figsize=(6.4, _rows_height(labels)), dpi=110)
    for i, (_, iv) in enumerate(rows):
        ax.plot([iv.low, iv.high], [i, i], lw=6, alpha=0.35, color=f"C{i}", solid_capstyle="butt")
        ax.plot([iv.value], [i], "o", ms=6, color=f"C{i}")
    for x in (0.0, 1.0):  # the random policy and the designers' reward
        ax.axvline(x, color="grey", ls="--", lw=1)
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig
