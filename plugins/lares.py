"""lares: evolutionary RL over a population of LLM reward functions (LaRes, NeurIPS 2025).

Method ("LaRes: Evolutionary Reinforcement Learning with LLM-based Adaptive Reward
Search"):

1. A population of reward functions written by the LLM (``population``, default 5), each
   with its own off-policy (SAC) agent. One shared replay buffer stores, for every
   transition, the value of every reward function, so a new function relabels all past
   data and every agent learns from everything any agent collected.
2. Thompson sampling over the agents' recent success decides which agent collects the
   next episode.
3. Every ``llm_freq`` env steps: evaluate every agent, keep the elites (top
   ``elites``, or tournament selection), describe the best agent's behaviour in a short
   bounded text, let the LLM name its defects and propose improvements, then show the
   best code, its component feedback and that analysis to the LLM (temperature ~0.4)
   to rewrite the non-elite functions. New functions relabel the buffer and are
   rescaled to the best elite's reward mean/std (or squashed by a sigmoid); their agent
   starts from the best elite's weights. Selection penalises reward complexity (AST
   size); population diversity (1 - mean |correlation| of the reward columns) is logged.
4. Optional retrieval: a case base of earlier successful reward functions; the most
   similar ones are shown as examples before generating.

The joint training runs in ``train_candidates`` through the core's population seam
(:class:`core.plugin.Population`): each member is one candidate with its own env (the
candidate's env configs, its state program, the ``compute_reward`` / ``represent_state``
hooks), its own ``TrainContext`` and a core SAC agent (settings from ``trainer=sac``),
all learning from one shared replay that holds every member's reward. What is LaRes's
is :class:`Evolution`: which agent acts, when the LLM rewrites which reward, and how
a new reward is rescaled and inherits an elite's weights. Config:
``conf/plugins/lares.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import ast
import json
import math
import random
import re
from collections import Counter, deque
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.plugin import (
    Candidate,
    IterationResult,
    PluginConfig,
    Population,
    RewardProgram,
    SandboxError,
    Shapes,
    TrainResult,
    UserError,
    batch_shapes,
    candidate_line,
    code_options,
    fence,
    hookimpl,
    interface_of,
    population_settings,
    prepare_reward,
    program_from_reply,
    repair_messages,
    reply_counts,
    reward_interface,
    sample_evenly,
    summarize_series,
    task_description,
)

NAME = "lares"
ENTRY = "compute_reward"
ARGS = ["state", "action", "next_state"]
SELECTIONS = ("top", "tournament")
RESCALES = ("affine", "sigmoid", "none")


@dataclass
class Config(PluginConfig):
    """``plugins.lares``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`.

    The agents' settings are ``trainer=sac``'s (``conf/trainer/sac.yaml``).
    """

    iterations: int = 1  # outer rounds; LaRes evolves inside one long training (keep 1)
    population: int = 5  # reward functions, each with its own SAC agent (paper: 5)
    elites: int = 3  # members kept at each LLM update; the others are regenerated (paper: 3)
    selection: str = "top"  # top | tournament: how the elites are chosen
    tournament_size: int = 2  # entrants per tournament when selection=tournament
    llm_freq: int = 5000  # env steps (all members together) between LLM updates
    frames: int | None = None  # env steps for the whole population (all agents together); null = trainer.frames
    # sampling temperature of the initial population; None: by its size (core.prompting.sampling_temperature)
    init_temperature: float | None = None
    temperature: float = 0.4  # temperature of the analysis and regeneration calls (paper: 0.3-0.5)
    max_tokens: int = 768  # cap on each reward-function reply
    retries: int = 2  # re-asks with the error when an initial or repaired function fails the sandbox
    analysis_tokens: int = 256  # cap on the behaviour-analysis reply
    rescale: str = "affine"  # affine (to the best elite's reward mean/std) | sigmoid (squash) | none
    complexity_penalty: float = 0.0005  # selection penalty per AST node of a reward function
    retrieval: bool = False  # show the most similar reward functions of the case base as examples
    retrieve_k: int = 2  # how many to show
    # JSON file of earlier successful reward functions; null = <cache_dir>/lares_cases.json
    case_base: str | None = None
    case_min_fitness: float = 0.5  # a run's best reward joins the case base when its fitness reaches this
    final_seeds: int = 0  # retrain the best reward on this many more seeds after the loop (a population of one)

    def check(self) -> None:
        super().check()
        for name in ("population", "tournament_size", "llm_freq", "max_tokens", "analysis_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("elites", "retries", "retrieve_k", "init_temperature", "temperature", "complexity_penalty"):
            if getattr(self, name) is not None and getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.frames is not None and self.frames < 1:
            raise ValueError(f"frames must be >= 1 or null, got {self.frames}")
        if self.selection not in SELECTIONS:
            raise ValueError(f"selection must be one of {', '.join(SELECTIONS)}, got {self.selection!r}")
        if self.rescale not in RESCALES:
            raise ValueError(f"rescale must be one of {', '.join(RESCALES)}, got {self.rescale!r}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are a rigorous robot coach and reward engineer. You write reward functions
for reinforcement learning agents in Python. Keep reward expressions simple: a few
smooth, bounded terms. Reply with one ```python code block."""

TASK = """The environment:

{description}

{interface}

Task goal: {goal}"""

EXAMPLES = """Reward functions that worked on similar tasks before:

{examples}"""

ANALYSE = """An RL agent is learning this task: {goal}

Its current behaviour, from a recent evaluation episode:

{behaviour}

In at most five short bullet points, name the defects of this behaviour (for example
abrupt stops, jitter, oscillation, wasted effort, never reaching the goal) and propose
how the reward function should change to fix each one."""

EVOLVE = """This is the best reward function of the population so far:

```python
{code}
```

Its agent's results, sampled over training (max/mean/min):

{feedback}

Analysis of the agent's behaviour:

{analysis}

Write a new, improved reward function that fixes these defects. Reply with the complete
function in a ```python block."""

FAILURE = """Running the reward function above failed ({kind}):

{error}

The only keys of `state` and `next_state` are: {fields}.
Fix the problem and reply with the complete corrected reward function in a ```python block."""

WORD = re.compile(r"[a-z0-9_]+")
BEHAVIOUR_CHARS = 2000  # ~512 tokens: the paper bounds the trajectory description


# -- pure pieces: selection, sampling, rescaling, complexity, diversity, text --------------


def complexity(source: str) -> int:
    """Size of a reward program: its number of AST nodes (0 if it does not parse)."""
    try:
        return sum(1 for _ in ast.walk(ast.parse(source)))
    except SyntaxError:
        return 0


def selection_scores(fitness: list[float], sizes: list[int], penalty: float) -> list[float]:
    """Fitness minus ``penalty`` per AST node of the reward expression."""
    return [f - penalty * n for f, n in zip(fitness, sizes)]


def select_elites(
    scores: list[float], k: int, method: str = "top", tournament: int = 2, rng: random.Random | None = None
) -> list[int]:
    """Indices of the ``k`` elites: the best scores (``top``) or by repeated tournaments."""
    k = max(0, min(k, len(scores)))
    order = sorted(range(len(scores)), key=lambda i: scores[i], reverse=True)
    if method == "top":
        return sorted(order[:k])
    if method != "tournament":
        raise UserError(f"plugins.lares.selection must be 'top' or 'tournament', not {method!r}")
    rng = rng or random.Random(0)
    left, chosen = list(range(len(scores))), []
    for _ in range(k):
        entrants = rng.sample(left, min(tournament, len(left)))
        winner = max(entrants, key=lambda i: scores[i])
        chosen.append(winner)
        left.remove(winner)
    return sorted(chosen)


def thompson_pick(outcomes: list[deque[float]], rng: np.random.Generator) -> int:
    """The agent to act: argmax of a Beta(1 + successes, 1 + failures) draw per agent."""
    draws = [rng.beta(1.0 + sum(o), 1.0 + len(o) - sum(o)) for o in outcomes]
    return int(np.argmax(draws))


def rescale(
    values: torch.Tensor, target_mean: float, target_std: float, mode: str = "affine"
) -> tuple[float, float, str]:
    """``(a, b, mode)`` so that ``a * r + b`` has the target mean/std (``sigmoid``: squashed).

    With ``sigmoid``, the reward is ``sigmoid(a * r + b)`` where ``a * r + b`` is the
    standardised reward.
    """
    mean, std = float(values.mean()), float(values.std()) if values.numel() > 1 else 0.0
    std = std if std > 1e-8 else 1.0
    if mode == "sigmoid":
        return 1.0 / std, -mean / std, "sigmoid"
    if mode != "affine":
        raise UserError(f"plugins.lares.rescale must be 'affine', 'sigmoid' or 'none', not {mode!r}")
    a = (target_std if target_std > 1e-8 else 1.0) / std
    return a, target_mean - a * mean, "affine"


def apply_scale(values: torch.Tensor, scale: tuple[float, float, str]) -> torch.Tensor:
    a, b, mode = scale
    out = a * values + b
    return torch.sigmoid(out) if mode == "sigmoid" else out


def diversity(columns: torch.Tensor) -> float:
    """1 - mean |Pearson correlation| between the reward columns ``[T, N]`` (1 = unrelated)."""
    if columns.shape[1] < 2 or columns.shape[0] < 2:
        return 0.0
    x = columns.double() - columns.double().mean(0)
    std = x.std(0)
    keep = std > 1e-12
    n = int(columns.shape[1])
    corr = torch.zeros(n, n, dtype=torch.float64)
    if int(keep.sum()) >= 2:
        z = x[:, keep] / std[keep]
        sub = (z.T @ z) / (columns.shape[0] - 1)
        idx = torch.nonzero(keep).flatten()
        corr[idx.unsqueeze(1), idx.unsqueeze(0)] = sub
    mask = ~torch.eye(n, dtype=torch.bool)
    return float(min(1.0, max(0.0, 1.0 - float(corr.abs()[mask].mean()))))


def describe_behaviour(
    task: Any, observations: np.ndarray, actions: np.ndarray, success: bool | None, points: int = 6
) -> str:
    """A bounded natural-language account of one episode: states over time and motion stats."""
    steps = len(actions)
    outcome = (
        "reached the goal" if success else "did not reach the goal" if success is not None else "no success signal"
    )
    lines = [f"Episode of {steps} steps; {outcome}."]
    for t in sample_evenly(list(range(len(observations))), points):
        state = task.render_state(observations[t]).replace("\n", ", ")
        lines.append(f"t={t}: {state}")
    if steps > 1:
        a = actions.reshape(steps, -1)
        jitter = float(np.abs(np.diff(a, axis=0)).mean())
        lines.append(
            f"actions: mean {float(a.mean()):.2f}, std {float(a.std()):.2f}, "
            f"mean |change| per step {jitter:.2f} (high = jitter)"
        )
        delta = np.abs(np.diff(observations.reshape(len(observations), -1), axis=0)).sum(-1)
        if len(delta) > 1:
            stops = int(((delta[1:] < 0.2 * delta[:-1]) & (delta[:-1] > np.median(delta) + 1e-6)).sum())
            lines.append(f"sudden slow-downs (state change dropping by 80% in one step): {stops}")
    return "\n".join(lines)[:BEHAVIOUR_CHARS]


def member_feedback(fitness_curve: list[float], components: dict[str, list[float]], fitness_name: str) -> str:
    lines = [f"fitness ({fitness_name}): {summarize_series(sample_evenly(fitness_curve, 10))}"]
    lines += [f"{name}: {summarize_series(sample_evenly(vals, 10))}" for name, vals in sorted(components.items())]
    return "\n".join(lines)


def _fields(task: Any) -> str:
    return ", ".join(f'"{name}"' for name in task.field_names())


# -- case base -----------------------------------------------------------------------------


def _bag(text: str) -> Counter[str]:
    return Counter(WORD.findall(text.lower()))


def similarity(a: str, b: str) -> float:
    x, y = _bag(a), _bag(b)
    dot = sum(x[w] * y[w] for w in x)
    norm = math.sqrt(sum(v * v for v in x.values()) * sum(v * v for v in y.values()))
    return dot / norm if norm else 0.0


def retrieve(cases: list[dict[str, Any]], query: str, k: int) -> list[dict[str, Any]]:
    """The ``k`` cases (``{"task", "goal", "code", "fitness"}``) most similar to ``query``."""
    ranked = sorted(cases, key=lambda c: (similarity(c["goal"] + " " + c["code"], query), c["fitness"]), reverse=True)
    return ranked[: max(0, k)]


def load_cases(path: Path) -> list[dict[str, Any]]:
    try:
        return list(json.loads(path.read_text())) if path.exists() else []
    except ValueError:
        return []


# -- prompts -----------------------------------------------------------------------------------


def base_messages(run: Any, cases: list[dict[str, Any]], shapes: Shapes | None = None) -> list[dict[str, str]]:
    """System + (similar cases) + the task; ``shapes``: the task's
    :func:`core.prompting.batch_shapes` (made when None)."""
    interface = reward_interface(run.task, list(run.sandbox.imports), shapes, interface=interface_of(run))
    user = TASK.format(
        description=task_description(run.task, interface_of(run)), interface=interface, goal=run.task.goal
    )
    if cases:
        shown = "\n\n".join(f"Goal: {c['goal']}\n```python\n{c['code'].strip()}\n```" for c in cases)
        user = EXAMPLES.format(examples=shown) + "\n\n" + user
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]


def evolve_messages(base: list[dict[str, str]], code: str, feedback: str, analysis: str) -> list[dict[str, str]]:
    return base + [
        {"role": "user", "content": EVOLVE.format(code=code.strip(), feedback=feedback, analysis=analysis.strip())}
    ]


def every_program(
    replies: list[Any], prompt: str, generation: int, call: str = "", fields: list[str] | None = None
) -> list[RewardProgram]:
    """A program per reply: usable, or rejected with the reason (:func:`core.codegen.program_from_reply`);
    with ``fields`` (the task's field names) the names each reads are checked and mended first."""
    extra = {"call": call} if call else {}
    return [
        program_from_reply(
            RewardProgram,
            reply.text,
            ENTRY,
            ARGS,
            state_fields=fields,
            origin=NAME,
            prompt=prompt,
            meta={"sample": i, "generation": generation, **extra},
        )
        for i, reply in enumerate(replies)
    ]


def programs_from(
    replies: list[Any], prompt: str, generation: int, fields: list[str] | None = None
) -> tuple[list[RewardProgram], list[str]]:
    """The usable programs of ``replies`` and the rejected replies' reasons."""
    programs = every_program(replies, prompt, generation, fields=fields)
    return [p for p in programs if not p.rejected], [p.rejected for p in programs if p.rejected]


# -- the evolutionary loop -------------------------------------------------------------------------


def is_mine(candidate: Candidate) -> bool:
    """Whether LaRes proposed the candidate's reward (only those join its population)."""
    return candidate.reward is not None and candidate.reward.origin == NAME


class Evolution:
    """LaRes's method over the core's :class:`core.plugin.Population` (one SAC agent per reward
    function, one shared replay): which agent acts, and how the LLM rewrites the rewards."""

    def __init__(self, run: Any, seed: int, cfg: Config, plugin: Plugin) -> None:
        self.run, self.task, self.seed, self.cfg, self.plugin = run, run.task, seed, cfg, plugin
        self.rng = np.random.default_rng(seed)
        self.generation = 0
        self.diversity: list[tuple[int, float]] = []  # (frames, diversity) at each LLM update
        self.outcomes: list[deque[float]] = []  # per agent: success (or return above the median) of its last episodes
        self.pop: Any = None  # the Population, while it trains

    def __call__(self, pop: Any) -> None:
        """The population's training: first functions, then Thompson sampling and LLM updates."""
        cfg = self.cfg
        self.pop = pop
        self.outcomes = [deque(maxlen=20) for _ in pop.live]
        for m in pop.live:
            if m.program is not None:
                m.use(m.program, *self._prepare(m.program))
            m.history.append(f"generation 0: {'ok' if m.fn else f'failed ({m.error_kind}): {m.error[:200]}'}")
            if m.fn is None:
                self._repair(m)
        recent: deque = deque(maxlen=50)
        next_llm, acting = cfg.llm_freq, None
        while pop.frames < pop.budget:
            if acting is None:  # Thompson sampling picks the agent that collects the next episode
                acting = self._pick()
            for ret, success in (ended := pop.step(pop.live[acting])):
                recent.append(ret)
                self.outcomes[acting].append(float(success) if success is not None else float(ret >= np.median(recent)))
            if ended:
                acting = None
            if pop.frames >= next_llm and pop.frames < pop.budget:
                self.evolve()
                next_llm += cfg.llm_freq
                acting = None

    def record(self, result: TrainResult) -> None:
        """What the evolution adds to a member's result: the population's diversity."""
        result.metrics["lares/diversity"] = self.diversity[-1][1] if self.diversity else 0.0
        result.series["lares/diversity"] = list(self.diversity)

    def _pick(self) -> int:
        """Thompson sampling over the agents with a working function (all of them if none has one)."""
        alive = [j for j, m in enumerate(self.pop.live) if m.fn is not None] or list(range(len(self.pop.live)))
        return alive[thompson_pick([self.outcomes[j] for j in alive], self.rng)]

    # -- a function for a slot ----------------------------------------------------------------------
    def _prepare(self, program: RewardProgram) -> tuple[Any, str, str]:
        sandbox = self.run.sandbox
        try:
            return prepare_reward(program, self.task, limits=sandbox.limits(), allowed_imports=sandbox.imports), "", ""
        except SandboxError as e:
            return None, e.report.message, e.report.kind

    def _repair(self, m: Any) -> None:
        """Send a failing function's error back to the LLM until it passes (``retries`` times)."""
        run, cfg = self.run, self.cfg
        for attempt in range(cfg.retries):
            if m.fn is not None or m.program is None:
                return
            seed = run.seed * 1000 + 300 + 10 * int(m.program.meta.get("sample", 0)) + attempt
            if interface_of(run) == "fields":  # the core's short repair request: fields, function, error, rule
                code = run.settings.run.code
                msgs = repair_messages(
                    self.task,
                    m.program.source or m.program.reply,
                    m.error,
                    m.error_kind,
                    entry=ENTRY,
                    shapes=self.plugin.shapes,
                )
                replies = run.llm.chat(
                    msgs,
                    n=1,
                    temperature=code.repair_temperature,
                    max_tokens=code.repair_max_tokens,
                    seed=seed,
                    tag=f"{NAME}-repair",
                    stop=code_options(run, 1, None)["stop"],
                )
            else:
                msgs = base_messages(run, [], self.plugin.shapes) + [
                    {"role": "assistant", "content": m.program.reply or f"```python\n{m.program.source}\n```"},
                    {
                        "role": "user",
                        "content": FAILURE.format(
                            kind=m.error_kind, error=m.error.strip()[-1500:], fields=_fields(self.task)
                        ),
                    },
                ]
                replies = run.llm.chat(
                    msgs, n=1, temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=seed, tag=f"{NAME}-repair"
                )
            programs, errors = programs_from(
                replies, "\n\n".join(x["content"] for x in msgs), m.generation, self.task.field_names()
            )
            if not programs:
                m.error = errors[0] if errors else m.error
                continue
            fn, error, kind = self._prepare(programs[0])
            m.use(programs[0], fn, error, kind)
            m.history.append(f"generation {m.generation}: repair {attempt + 1} {'ok' if fn else f'failed ({kind})'}")

    # -- one LLM update ---------------------------------------------------------------------------
    def evolve(self) -> None:
        cfg, run, pop = self.cfg, self.run, self.pop
        self.generation += 1
        g = self.generation
        members = pop.live
        fitness = [pop.evaluate(m) if m.fn is not None else float("-inf") for m in members]
        sizes = [complexity(m.program.source) if m.program else 0 for m in members]
        scores = selection_scores(fitness, sizes, cfg.complexity_penalty)
        alive = [i for i, m in enumerate(members) if m.fn is not None]
        picked = select_elites(
            [scores[i] for i in alive], cfg.elites, cfg.selection, cfg.tournament_size, random.Random(self.seed + g)
        )
        elites = [alive[i] for i in picked]  # a failed function is never an elite
        best = max(alive or range(len(scores)), key=lambda i: scores[i])
        bm = members[best]
        losers = [i for i in range(len(members)) if i not in elites]
        behaviour = analysis = ""
        msgs: list[dict[str, str]] = []
        if losers and alive:
            behaviour = describe_behaviour(self.task, *pop.rollout(bm, seed=self.seed + 20_000 + g))
            analysis = run.llm.chat(
                [{"role": "user", "content": ANALYSE.format(goal=self.task.goal, behaviour=behaviour)}],
                n=1,
                temperature=cfg.temperature,
                max_tokens=cfg.analysis_tokens,
                seed=run.seed * 1000 + 500 + g,
                tag=f"{NAME}-analysis-g{g}",
            )[0].text
            feedback = member_feedback(
                [p.fitness for p in bm.result.curve],
                {k: [v for _, v in s] for k, s in bm.result.components.items()},
                self.task.fitness_name,
            )
            msgs = evolve_messages(
                base_messages(run, self.plugin.cases_for(run), self.plugin.shapes),
                bm.program.source if bm.program else "",
                feedback,
                analysis,
            )
        elif losers:  # nothing runs: the error is the feedback (as in Eureka)
            analysis = "(no working reward function: no behaviour analysis)"
            msgs = base_messages(run, self.plugin.cases_for(run), self.plugin.shapes) + [
                {"role": "assistant", "content": bm.program.reply if bm.program else ""},
                {
                    "role": "user",
                    "content": FAILURE.format(
                        kind=bm.error_kind, error=bm.error.strip()[-1500:], fields=_fields(self.task)
                    ),
                },
            ]
        replies = (
            run.llm.chat(
                msgs,
                n=len(losers),
                max_tokens=cfg.max_tokens,
                seed=run.seed * 1000 + 600 + g,
                tag=f"{NAME}-evolve-g{g}",
                **code_options(run, len(losers), cfg.temperature),
            )
            if losers
            else []
        )
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs) if losers else ""
        programs, errors = programs_from(replies, prompt, g, self.task.field_names())
        target = pop.rewards(bm) if alive else pop.env_rewards()
        replaced = [
            j for j in losers if self._replace(j, programs, errors, g, target, scores[j], best if alive else None)
        ]
        columns = [pop.rewards(m) for m in members if m.fn is not None]
        div = diversity(torch.stack(columns, 1)) if columns else 0.0
        self.diversity.append((pop.frames, div))
        run.log_metrics(
            {"lares/diversity": div, "lares/best_fitness": fitness[best], "lares/replaced": len(replaced)},
            step=pop.frames,
        )
        self.plugin.log.append(
            f"## generation {g} at {pop.frames} frames\n\n"
            f"- fitness: {[round(f, 3) for f in fitness]}; complexity: {sizes}; "
            f"elites: {elites}; best: {best}; replaced: {replaced}; diversity: {div:.3f}"
            + (f"\n- errors: {errors[:3]}" if errors else "")
            + (
                f"\n\n### behaviour of the best agent\n{behaviour}\n\n### analysis\n{analysis.strip()}\n"
                if losers
                else "\n"
            )
        )

    def _replace(
        self,
        j: int,
        programs: list[RewardProgram],
        errors: list[str],
        g: int,
        target: torch.Tensor,
        old_score: float,
        elite: int | None,
    ) -> bool:
        """Give agent ``j`` the first of ``programs`` that passes the sandbox and relabels the replay;
        rescaled to ``target``, starting from agent ``elite``'s weights."""
        pop = self.pop
        m = pop.live[j]
        while programs:
            program = programs.pop(0)
            fn, error, kind = self._prepare(program)
            if fn is None:
                errors.append(f"{kind}: {error[:200]}")
                continue
            try:
                pop.adopt(m, program, fn)  # every stored transition relabelled with the new function
            except Exception as e:  # fails on the stored data: try the next one
                errors.append(f"relabel: {str(getattr(getattr(e, 'report', None), 'message', e))[:200]}")
                continue
            m.generation = g
            if self.cfg.rescale != "none":
                scale = rescale(pop.rewards(m), float(target.mean()), float(target.std()), self.cfg.rescale)
                m.shaping = partial(apply_scale, scale=scale)
            note = ""
            if elite is not None and elite != j:
                if pop.inherit(m, pop.live[elite]):
                    self.outcomes[j] = deque(self.outcomes[elite], maxlen=20)
                else:
                    note = "; keeps its own weights (its observation differs from the elite's)"
            m.history.append(f"generation {g}: replaced (the old one scored {old_score:.3g}){note}")
            return True
        return False


# -- hooks ----------------------------------------------------------------------------------------


class Plugin:
    """One LaRes run: the case base, the log of every LLM update, the best reward found."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.cases: list[dict[str, Any]] = []
        self.case_path: Path | None = None
        self.best_source = ""
        self.best_score = float("-inf")
        self.log: list[str] = []  # what happened at each LLM update
        self.shapes: Shapes | None = None  # what the reward code receives, read off a real batch once per run

    def cases_for(self, run: Any) -> list[dict[str, Any]]:
        return retrieve(self.cases, run.task.goal, self.cfg.retrieve_k) if self.cfg.retrieval else []

    @hookimpl
    def on_run_start(self, run) -> None:
        population_settings(run, self.cfg.frames, NAME)  # trainer=sac, checked before any work
        cache = Path(run.settings.run.cache_dir or ".")
        self.case_path = Path(self.cfg.case_base) if self.cfg.case_base else cache / "lares_cases.json"
        self.cases = load_cases(self.case_path)

    @hookimpl
    def propose_rewards(self, run, iteration: int) -> list[RewardProgram] | None:
        """The initial population (iteration 0); later generations are born inside training."""
        cfg = self.cfg
        self.shapes = self.shapes or batch_shapes(run.task, run.seed)
        msgs = base_messages(run, self.cases_for(run), self.shapes)
        prompt = "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in msgs)
        tag = f"{NAME}-init-it{iteration}"
        replies = run.llm.chat(
            msgs,
            n=cfg.population,
            max_tokens=cfg.max_tokens,
            seed=run.seed * 1000 + iteration,
            tag=tag,
            **code_options(run, cfg.population, cfg.init_temperature),
        )
        # every reply is proposed: a rejected one is recorded by the loop, never joins the population
        programs = every_program(replies, prompt, 0, tag, run.task.field_names())
        errors = [p.rejected for p in programs if p.rejected]
        self.log.append(
            f"initial population: {len(programs) - len(errors)}/{len(replies)} replies held a reward function"
            + (f"; first error: {' '.join(errors[0].split())}" if errors else "")
        )
        return programs

    @hookimpl
    def train_candidates(self, run, candidates: list[Candidate], seed: int) -> list[TrainResult | None] | None:
        """Train the candidates whose reward LaRes proposed as one population.

        Others get None (the executor trains them); a LaRes candidate with a part the
        population cannot honour gets a failed ``unsupported`` result naming it.
        """
        mine = [i for i, c in enumerate(candidates) if is_mine(c)]
        if not mine:
            return None
        evolution = Evolution(run, seed, self.cfg, self)
        population = Population(run, [candidates[i] for i in mine], seed, frames=self.cfg.frames, name=NAME)
        results: list[TrainResult | None] = [None] * len(candidates)
        for i, result in zip(mine, population.train(evolution)):
            if result.error_kind != "unsupported":
                evolution.record(result)
            results[i] = result
        return results

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [(c, r) for c, r in zip(result.candidates, result.results) if is_mine(c)]
        if not mine:
            return None
        cfg = self.cfg
        population = sum(not c.rejected for c, _ in mine)
        lines = [f"### Iteration {result.iteration}: population of {population} ({reply_counts(mine)})", ""]
        lines += [candidate_line(c, r, c.reward) for c, r in mine]
        ok = [(c, r) for c, r in mine if r.ok]
        if ok:
            best_c, best_r = max(ok, key=lambda cr: cr[1].score)
            source = best_r.texts.get("lares_final_reward.py", best_c.reward.source)  # type: ignore[union-attr]
            if best_r.score > self.best_score:
                self.best_score, self.best_source = best_r.score, source
            if cfg.retrieval and best_r.score >= cfg.case_min_fitness and self.case_path is not None:
                self.cases = [c for c in self.cases if not (c["task"] == run.task.name and c["code"] == source)]
                self.cases.append(
                    {"task": run.task.name, "goal": run.task.goal, "code": source, "fitness": best_r.score}
                )
                self.case_path.parent.mkdir(parents=True, exist_ok=True)
                self.case_path.write_text(json.dumps(self.cases, indent=1))
                lines.append(f"- added the best reward to the case base ({len(self.cases)} cases)")
            lines += [
                "",
                f"### `{best_c.id}`, the best of this iteration",
                "",
                "Its reward function at the end of training (after the population's evolution):",
                "",
                fence(source, "python"),
            ]
        return "\n".join(lines + ["", *self.log])

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        if self.best_source:
            run.log_text(f"{NAME}/best_reward.py", self.best_source)
        run.log_text(f"{NAME}/evolution.md", "\n".join(self.log))
