"""envgen: the LLM writes training-environment configs adapted to the agent (EnvGen, COLM 2024).

Method (Zala et al., "EnvGen: Generating and Adapting Environments via LLMs for Training
Embodied Agents"):

1. The LLM sees the task's goal, its achievements, the controllable world parameters
   with their allowed values, and the game's constraints, and writes N environment
   configs as JSON, each with a short purpose (which skills it helps the agent learn).
2. Each config is validated against the parameter schema; what the game implies is
   repaired (a starting item that needs a tool also gets the tool); invalid output is
   sent back to the LLM, which tries again.
3. Training cycles, one agent throughout (``continue_training``, the paper's way): each
   cycle continues the previous cycle's agent (actor, critic and Adam state) for its
   share of the frames, first in the generated envs (``generated_share`` of the cycle),
   then in the original env. The agent is evaluated on the original env and the
   per-achievement success rates (mean +- std over evaluation episodes) go back to the
   LLM, which updates the envs. ``trainer.frames`` is split over the cycles, so the final
   agent has trained exactly as many frames as one plain PPO training. The conversation
   history is kept; the run makes only a few LLM calls.

   ``continue_training: false`` keeps the from-scratch variant: every cycle trains a
   fresh agent for ``trainer.frames`` on a mix of the original env
   (``original_share`` of the vector envs) and the generated ones.

The hook is generic: any task that declares ``params`` (:class:`core.envs.task.ParamSpec`)
can use it. Repair rules come from the config (``rules``) and from the task's optional
``param_rules`` attribute. Config: ``conf/plugins/envgen.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.plugin import (
    Candidate,
    EnvConfig,
    IterationResult,
    PluginConfig,
    StartPolicy,
    TrainResult,
    UserError,
    hookimpl,
)

NAME = "envgen"
ORIGINAL = "original"


@dataclass
class Rule:
    """A constraint the game implies: when ``when`` is set (> 0), ``then`` needs at least ``min``."""

    when: str  # the parameter that, when set, requires another
    then: str  # the parameter it requires (raised when below ``min``)
    min: float = 1.0  # the least value ``then`` must have


#: the default constraints and repair rules: Crafter's (rules naming params a task lacks are skipped)
CRAFTER_CONSTRAINTS = ("Starting tools (pickaxes, swords) only help if the agent can also find what they collect.",)
CRAFTER_RULES = (
    ("start_stone_pickaxe", "start_wood_pickaxe", 1.0),
    ("start_iron_pickaxe", "start_stone_pickaxe", 1.0),
    ("start_stone_sword", "start_wood_sword", 1.0),
    ("start_iron_sword", "start_stone_sword", 1.0),
    ("start_stone", "start_wood_pickaxe", 1.0),
    ("start_coal", "start_wood_pickaxe", 1.0),
    ("start_iron", "start_stone_pickaxe", 1.0),
    ("start_diamond", "start_iron_pickaxe", 1.0),
)


def reply_budget(configs: int, params: int) -> int:
    """Tokens for a reply of ``configs`` JSON configs of ``params`` values each, with a name and
    a purpose: about 14 tokens a value, 50 a config, 150 around them (Crafter's 17 values x 4
    configs: 1,302; the fixed 800 cut every such reply off)."""
    return 150 + configs * (50 + 14 * params)


@dataclass
class Config(PluginConfig):
    """``plugins.envgen``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 4  # training cycles: generate envs, train, evaluate on the original env, feed back (paper: 4)
    num_envs: int = 4  # environment configs the LLM writes per cycle (paper: 4)
    # one agent across cycles, trainer.frames split over them (paper); false: a fresh agent per cycle
    continue_training: bool = True
    # continue_training: share of each cycle's frames in the generated envs, the rest in the original
    # env after them (paper: 0.96M of 1.96M steps)
    generated_share: float = 0.5
    # from scratch: share of the training envs that run the original env (the rest split among the
    # generated ones)
    original_share: float = 0.5
    retries: int = 1  # extra LLM calls per cycle when configs are invalid (the errors are fed back)
    history: int = 3  # earlier exchanges kept in the conversation (besides the first prompt)
    temperature: float = 0.7  # sampling temperature
    # cap on each reply; 0: sized to what is asked (num_envs configs of the task's params, reply_budget)
    max_tokens: int = 0
    # a reply cut off at the cap is continued where it stopped, this many times, before any retry
    continuations: int = 1
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop
    constraints: list[str] = field(
        default_factory=lambda: list(CRAFTER_CONSTRAINTS)
    )  # extra constraints stated in the prompt (the game's rules)
    rules: list[Rule] = field(
        default_factory=lambda: [Rule(*r) for r in CRAFTER_RULES]
    )  # repairs: when `when` is set (> 0), `then` is raised to at least `min` (a tool an item requires)

    def check(self) -> None:
        super().check()
        for name in ("num_envs", "history"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_tokens", "continuations"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        for name in ("original_share", "generated_share"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        for i, rule in enumerate(self.rules):
            if not rule.when or not rule.then:
                raise ValueError(f"rules[{i}] needs both `when` and `then` parameter names, got {rule}")
            if not math.isfinite(rule.min):
                raise ValueError(f"rules[{i}].min must be a finite number, got {rule.min}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You design training environments for a reinforcement learning agent. Each
environment is a JSON object of world parameters. Design environments in which the agent
can practise the skills it is missing, so that it does better in the original game.
Reply with one ```json code block holding a list of objects."""

TASK = """Game goal: {goal}

Achievements the agent is scored on:
{achievements}

World parameters you control (any parameter you leave out keeps its default):
{params}

Constraints:
{constraints}

Write {n} different environment configs as a JSON list. Each item is an object
{{"name": "...", "purpose": "<the skills it trains, one sentence>", "params": {{...}}}}.
Example item: {example}"""

FEEDBACK = """We trained the agent {how} and evaluated it in the original game.
Success rate of each achievement over the evaluation episodes (percent, mean +- std):
{rates}
Overall {fitness_name}: {fitness:.3g}.

Write {n} updated environment configs (same JSON format) that help the agent improve at the
achievements it rarely or never unlocks, while keeping the skills it has."""

#: how a cycle trained, for FEEDBACK (continue_training true / false)
HOW = {
    True: "in your environments, then in the original game (the same agent as before, trained further)",
    False: "from scratch on your environments mixed with the original one",
}

INVALID = """Your configs could not be used:
{errors}
Reply again with {n} configs as a ```json list, using only the parameters and values listed."""

CONSTRAINTS = """- Use only the parameter names listed; categorical values must be one of the listed values.
- Numeric values must lie in their range.
- List only the parameters you change from their defaults (keep each config short).
- The original game is always part of the training mix; do not copy it."""


# -- schema validation and repair ----------------------------------------------------------


@dataclass
class Checked:
    """The result of validating one config: usable params, repairs made, and errors."""

    params: dict[str, Any]
    repairs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


def describe_params(specs: list[Any]) -> str:
    """One line per controllable parameter: name, allowed values or range, default."""
    lines = []
    for p in specs:
        if p.choices is not None:
            allowed = "one of " + ", ".join(json.dumps(c) for c in p.choices)
        else:
            allowed = (
                f"a number from {p.low:g} to {p.high:g}" if p.low is not None and p.high is not None else "a number"
            )
        lines.append(f"- {p.name}: {p.description}; {allowed} (default {json.dumps(p.default)})")
    return "\n".join(lines)


def parse_configs(reply: str) -> tuple[list[dict[str, Any]], str]:
    """The list of config objects in a reply (fenced or bare JSON), or an error text."""
    text = reply or ""
    blocks = re.findall(r"```(?:json|JSON)?\s*\n(.*?)(?:```|$)", text, re.DOTALL)
    candidates = blocks + [text]
    for chunk in candidates:
        start = min((i for i in (chunk.find("["), chunk.find("{")) if i >= 0), default=-1)
        if start < 0:
            continue
        decoder = json.JSONDecoder()
        try:
            value, _ = decoder.raw_decode(chunk[start:].strip())
        except json.JSONDecodeError:
            # small models add trailing commas and comments: strip them and retry once
            cleaned = re.sub(r"//[^\n]*", "", chunk[start:])
            cleaned = re.sub(r",\s*([\]}])", r"\1", cleaned)
            try:
                value, _ = decoder.raw_decode(cleaned.strip())
            except json.JSONDecodeError as e:
                value = complete_objects(cleaned.strip())  # a reply cut off at max_tokens
                if not value:
                    error = f"the JSON does not parse ({e.msg} at line {e.lineno})"
                    continue
        if isinstance(value, dict):
            value = value.get("configs", value.get("environments", [value]))
        if isinstance(value, list):
            items = [v for v in value if isinstance(v, dict)]
            if items:
                return items, ""
        error = "the JSON is not a list of objects"
    return [], locals().get("error", "the reply holds no JSON list of configs")


def complete_objects(text: str) -> list[dict[str, Any]]:
    """The complete objects at the start of a JSON list that breaks off (or is malformed) later."""
    if not text.startswith("["):
        return []
    decoder, pos = json.JSONDecoder(), 1
    items: list[Any] = []
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return items
        if isinstance(value, dict):
            items.append(value)


def _coerce(spec: Any, value: Any) -> tuple[Any, str]:
    """``value`` in the spec's type and range, or an error text."""
    if spec.choices is not None:
        by_text = {str(c).lower(): c for c in spec.choices}
        key = str(value).strip().lower()
        if key in by_text:
            return by_text[key], ""
        close = difflib.get_close_matches(key, list(by_text), n=1, cutoff=0.8)  # "mountains" -> "mountain"
        if close:
            return by_text[close[0]], ""
        return None, f"{spec.name}={json.dumps(value)} is not one of {', '.join(map(str, spec.choices))}"
    try:
        number = float(value)
    except (TypeError, ValueError):
        return None, f"{spec.name}={json.dumps(value)} is not a number"
    if not math.isfinite(number):
        return None, f"{spec.name} is not finite"
    if spec.low is not None:
        number = max(float(spec.low), number)
    if spec.high is not None:
        number = min(float(spec.high), number)
    return (int(round(number)) if isinstance(spec.default, int) else number), ""


def check_config(raw: dict[str, Any], specs: list[Any], rules: list[Rule]) -> Checked:
    """Validate one config's params against the schema, then apply the repair rules.

    Unknown names and disallowed values are errors; out-of-range numbers are clamped and
    implied requirements are added (both listed as repairs).
    """
    by_name = {p.name: p for p in specs}
    given = raw.get("params", raw)
    if not isinstance(given, dict):
        return Checked({}, errors=["`params` must be an object"])
    out = Checked({})
    for key, value in given.items():
        if key in ("name", "purpose", "weight"):
            continue
        spec = by_name.get(key)
        if spec is None:
            out.errors.append(f"unknown parameter {key!r}")
            continue
        coerced, error = _coerce(spec, value)
        if error:
            out.errors.append(error)
            continue
        if coerced != value and not (isinstance(value, str) and str(coerced).lower() == value.strip().lower()):
            out.repairs.append(f"{key}: {value!r} -> {coerced!r} (allowed range)")
        out.params[key] = coerced
    changed = True
    while changed:  # rules may chain (iron pickaxe -> stone pickaxe -> wood pickaxe)
        changed = False
        for rule in rules:
            if rule.then not in by_name or not _truthy(out.params.get(rule.when)):
                continue
            current = out.params.get(rule.then, by_name[rule.then].default)
            if float(current or 0) < rule.min:
                out.params[rule.then] = int(rule.min) if isinstance(by_name[rule.then].default, int) else rule.min
                out.repairs.append(f"{rule.then} set to {rule.min:g} because {rule.when} requires it")
                changed = True
    return out


def _truthy(value: Any) -> bool:
    if isinstance(value, (int, float)):
        return value > 0
    return bool(value)


@dataclass
class Parsed:
    """What one reply yields: usable configs, repairs made, errors to send back, and the
    salvaged configs (invalid ones with their bad parameters dropped, used only when the
    retries leave too few valid configs)."""

    configs: list[EnvConfig] = field(default_factory=list)
    repairs: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    salvaged: list[EnvConfig] = field(default_factory=list)


def configs_from_reply(reply: str, specs: list[Any], rules: list[Rule], n: int) -> Parsed:
    """Validate and repair the configs of one reply (at most ``n``)."""
    items, error = parse_configs(reply)
    if not items:
        return Parsed(errors=[error])
    out = Parsed()
    for i, item in enumerate(items[:n]):
        checked = check_config(item, specs, rules)
        name = str(item.get("name") or f"env{i}")[:40]
        config = EnvConfig(name=name, params=checked.params, purpose=str(item.get("purpose", ""))[:200])
        if not checked.ok:
            out.errors += [f"{name}: {e}" for e in checked.errors]
            if checked.params:
                out.salvaged.append(config)
            continue
        out.repairs += [f"{name}: {r}" for r in checked.repairs]
        out.configs.append(config)
    return out


def training_mix(configs: list[EnvConfig], original_share: float) -> list[EnvConfig]:
    """The original env (default params) with ``original_share`` of the weight, the rest split
    (the original env alone when there are no configs)."""
    share = min(max(original_share, 0.0), 1.0) if configs else 1.0
    rest = (1.0 - share) / max(1, len(configs))
    mix = [EnvConfig(ORIGINAL, {}, "the original environment", share)] if share > 0 else []
    return mix + [EnvConfig(c.name, dict(c.params), c.purpose, rest) for c in configs]


def achievement_rates(result: TrainResult) -> dict[str, tuple[float, float]]:
    """Per-achievement success (percent): mean and std over the evaluation episodes."""
    per_episode = [a for e in result.episodes if isinstance(a := e.info.get("achievements"), dict)]
    if per_episode:
        names = sorted(per_episode[0])
        return {
            a: (
                100 * float(np.mean([bool(ep.get(a)) for ep in per_episode])),
                100 * float(np.std([bool(ep.get(a)) for ep in per_episode])),
            )
            for a in names
        }
    details = result.fitness.details if result.fitness else {}
    return {
        k[len("success_") :]: (float(v), float("nan")) for k, v in sorted(details.items()) if k.startswith("success_")
    }


def format_rates(rates: dict[str, tuple[float, float]]) -> str:
    return (
        "\n".join(f"- {a}: {m:.1f} +- {s:.1f}" if s == s else f"- {a}: {m:.1f}" for a, (m, s) in rates.items())
        or "- (none recorded)"
    )


def task_achievements(task: Any) -> list[str]:
    """The task's achievements: fields named ``achievement_*`` of its state, else its goal."""
    names = [f.name[len("achievement_") :] for f in task.state_fields if f.name.startswith("achievement_")]
    return names or [task.goal]


# -- prompts -----------------------------------------------------------------------------------


def rules_of(cfg: Config, task: Any) -> list[Rule]:
    """Repair rules from the config and the task's optional ``param_rules`` (Rules or mappings)."""
    task_rules = [
        r if isinstance(r, Rule) else Rule(str(r["when"]), str(r["then"]), float(r.get("min", 1)))
        for r in getattr(task, "param_rules", None) or []
    ]
    names = {p.name for p in task.params}
    return [r for r in list(cfg.rules) + task_rules if r.when in names and r.then in names]


def first_prompt(cfg: Config, task: Any, n: int, example: dict[str, Any]) -> str:
    constraints = CONSTRAINTS + "".join(f"\n- {c}" for c in cfg.constraints)
    constraints += "".join(f"\n- if {r.when} is set, {r.then} must be at least {r.min:g}" for r in rules_of(cfg, task))
    return TASK.format(
        goal=task.goal,
        achievements=", ".join(task_achievements(task)),
        params=describe_params(task.params),
        constraints=constraints,
        n=n,
        example=json.dumps(example),
    )


def _example(specs: list[Any]) -> dict[str, Any]:
    params = {p.name: (p.choices[-1] if p.choices else p.default) for p in specs[:2]}
    return {"name": "example", "purpose": "practise one skill", "params": params}


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """One EnvGen run: the conversation kept across training cycles, and what was generated."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.messages: list[dict[str, str]] = []  # system + first prompt + the latest exchanges
        self.configs: list[EnvConfig] = []  # the latest cycle's generated envs
        self.mixes: list[list[EnvConfig]] = []  # every training mix proposed (to know this plugin's candidates)
        self.agent: StartPolicy | None = None  # continue_training: the agent the next cycle continues
        self.log: list[str] = []  # repairs and rejections so far

    @hookimpl
    def on_run_start(self, run) -> None:
        if not run.task.params:
            raise UserError(f"envgen needs a task with controllable params; '{run.task.name}' declares none.")
        trainer = str((run.config.get("trainer") or {}).get("name", "ppo"))
        if self.cfg.continue_training and trainer != "ppo":
            raise UserError(
                f"plugins.envgen.continue_training continues one PPO agent across cycles; trainer={trainer} "
                "cannot. Use trainer=ppo, or plugins.envgen.continue_training=false (a fresh agent per cycle)."
            )

    @hookimpl
    def generate_envs(self, run, iteration: int) -> list[list[EnvConfig]] | None:
        cfg = self.cfg
        n = cfg.num_envs
        if not self.messages:
            self.messages = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": first_prompt(cfg, run.task, n, _example(run.task.params))},
            ]
        specs, rules = run.task.params, rules_of(cfg, run.task)
        configs: list[EnvConfig] = []
        salvaged: list[EnvConfig] = []
        for attempt in range(1 + cfg.retries):
            ask = {
                "temperature": cfg.temperature,
                "max_tokens": cfg.max_tokens or reply_budget(n, len(specs)),
                "seed": run.seed * 1000 + iteration * 10 + attempt,
            }
            (reply,) = run.llm.chat(self.messages, n=1, tag=f"{NAME}-it{iteration}-try{attempt}", **ask)
            if reply.cut_off and cfg.continuations:  # finish it rather than ask again from scratch
                reply = run.llm.continue_reply(
                    self.messages, reply, rounds=cfg.continuations, tag=f"{NAME}-it{iteration}-try{attempt}", **ask
                )
            self.messages.append({"role": "assistant", "content": reply.text})
            parsed = configs_from_reply(reply.text, specs, rules, n)
            configs += parsed.configs[: n - len(configs)]
            salvaged += parsed.salvaged
            self.log += [f"it{iteration}: repaired {r}" for r in parsed.repairs] + [
                f"it{iteration}: invalid {e}" for e in parsed.errors
            ]
            if len(configs) >= n or attempt == cfg.retries:
                break
            errors = "\n".join(f"- {e}" for e in parsed.errors) or "- too few configs"
            self.messages.append({"role": "user", "content": INVALID.format(errors=errors, n=n - len(configs))})
        if len(configs) < n and salvaged:  # retries spent: train on what survives of the invalid ones
            extra = salvaged[: n - len(configs)]
            configs += extra
            self.log += [f"it{iteration}: used {c.name} without its invalid parameters" for c in extra]
        if not configs:  # nothing usable: keep the last cycle's envs rather than stop
            configs = self.configs
        self.configs = configs
        mix = training_mix(configs, 0.0 if cfg.continue_training else cfg.original_share)
        self.mixes.append(mix)
        run.log_text(f"{NAME}/it{iteration}-envs.json", json.dumps([c.__dict__ for c in mix], indent=2))
        original = (
            1.0 - cfg.generated_share
            if cfg.continue_training  # of the cycle's frames, after the generated envs
            else mix[0].weight
            if mix and mix[0].name == ORIGINAL
            else 0.0
        )  # of the vector envs
        run.log_metrics({f"{NAME}/generated_envs": len(configs), f"{NAME}/original_share": original}, step=iteration)
        return [mix]

    @hookimpl
    def prepare_candidates(self, run, candidates: list[Candidate]) -> None:
        """continue_training: this cycle's candidates continue the agent, for the cycle's frames.

        Cycle ``k`` of ``K`` (the run's iterations) ends where ``(k + 1) / K`` of
        ``trainer.frames`` is reached, counted over the agent's whole life, so the final
        agent has trained exactly what one plain training does (the trainer rounds each
        cycle down to whole batches; the next cycle makes up for it).
        """
        cfg = self.cfg
        mine = [c for c in candidates if self._is_mine(c)]
        if not cfg.continue_training or not mine:
            return
        total = int(run.config.trainer.frames)
        target = total * (mine[0].iteration + 1) // max(1, run.iterations)
        before = self.agent.frames if self.agent is not None else 0
        for c in mine:
            c.start = self.agent
            c.frames = max(1, target - before)
            c.original_after = 1.0 - cfg.generated_share
            c.keep_policy = True

    @hookimpl
    def on_iteration_end(self, run, result: IterationResult) -> None:
        """continue_training: the best of this cycle's trained agents is the one the next cycle continues."""
        kept = [
            (c, r) for c, r in zip(result.candidates, result.results) if self._is_mine(c) and r.ok and r.final_policy
        ]
        if not self.cfg.continue_training or not kept:
            return  # (a cycle that failed leaves the agent as it was: its frames are lost)
        self.agent = StartPolicy.of(*max(kept, key=lambda cr: cr[1].score))
        run.log_metrics({f"{NAME}/agent_frames": self.agent.frames}, step=result.iteration)

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        cfg = self.cfg
        mine = [(c, r) for c, r in zip(result.candidates, result.results) if self._is_mine(c)]
        if not mine:
            return None
        ok = [(c, r) for c, r in mine if r.ok and r.fitness is not None]
        if not ok:
            text = (
                "Training failed: "
                + (mine[0][1].error.strip()[-500:] or "unknown error")
                + f"\nWrite {cfg.num_envs} configs again."
            )
        else:
            _, best = max(ok, key=lambda cr: cr[1].score)
            rates = achievement_rates(best)
            run.log_metrics({f"{NAME}/success_{a}": m for a, (m, _) in rates.items()}, step=result.iteration)
            text = FEEDBACK.format(
                how=HOW[cfg.continue_training],
                rates=format_rates(rates),
                fitness_name=best.fitness.name,  # type: ignore[union-attr]
                fitness=best.score,
                n=cfg.num_envs,
            )
        self.messages.append({"role": "user", "content": text})
        keep = 2 + 2 * cfg.history  # system + first prompt + the last `history` exchanges
        if len(self.messages) > keep:
            self.messages = self.messages[:2] + self.messages[-(keep - 2) :]
        return text + ("\n\nRepairs and rejections so far:\n" + "\n".join(self.log) if self.log else "")

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        if self.log:
            run.log_text(f"{NAME}/repairs.txt", "\n".join(self.log))

    def _is_mine(self, candidate: Candidate) -> bool:
        return bool(candidate.envs) and candidate.envs in self.mixes
