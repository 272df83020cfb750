"""plan4mc: an LLM-built skill graph, searched for a skill sequence that RL skills carry out (Plan4MC).

Method (Yuan et al., 2023, "Plan4MC: Skill Reinforcement Learning and Planning for
Open-World Minecraft Tasks"):

1. Skill graph (``plan``): the LLM lists the basic skills the target needs, each with the
   skills it requires first and what it yields, as JSON. Skills are the task's checkable
   goals (Crafter's achievements). The reply is checked (unknown skills, cycles, a missing
   target and, with ``check_rules``, requirements that contradict the game's rules) and its
   errors go back to the LLM for a revision, ``repair_rounds`` times. What the last
   revision still gets wrong stays: the graph is used as the LLM wrote it (a wrong graph
   trains a wrong plan, the method's own risk). ``fix_rules`` (a control variant) mends
   the last revision by the game's rules instead; ``plan_source: rules`` (the no-LLM
   control) plans from the rules alone.
2. Search: a depth-first walk from the target through the requirements gives the skills
   in an order where each one's requirements come first (a topological order of the
   target's part of the graph). It becomes the run's :class:`SkillPlan`; each step says
   whether the LLM wrote it (``source``).
3. Skills learned with RL (``compute_reward``, ``represent_state``): one goal-conditioned
   PPO policy. Each env's active skill is the first one of the sequence not yet achieved
   in its episode (read from the observation's achievement flags, so it advances as the
   agent progresses and resets with the episode); completing it pays ``skill_reward``,
   and the active skill's one-hot (over the task's goals) is appended to the observation.
4. Re-planning (``on_rollout``): when an env spends ``replan_after`` steps on its active
   skill without completing it (its prerequisites done), the LLM gets the graph and the
   failure and revises the graph (checked and repaired as in 1), at most ``replans``
   times per training; the revision runs beside training and replaces the plan when it lands.

Config: ``conf/plugins/plan4mc.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from core.plugin import (
    BackgroundCalls,
    LLMError,
    Plan,
    PlanFollower,
    PlanStep,
    PluginConfig,
    TrainResult,
    UserError,
    check_plan,
    goal_names,
    hookimpl,
    match_goal,
    warm_up,
)

NAME = "plan4mc"
SOURCES = ("llm", "rules")


@dataclass
class Config(PluginConfig):
    """``plugins.plan4mc``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 1  # outer rounds (the skill graph is built once per round; the paper plans once)
    target: str = "make_stone_pickaxe"  # the goal the skill sequence leads to (a task goal: a Crafter achievement)
    # llm: the LLM builds the skill graph; rules: the game's own tech tree, no LLM call (the no-LLM control)
    plan_source: str = "llm"
    repair_rounds: int = 2  # times a skill graph with errors goes back to the LLM for a revision
    # requirements that contradict the game's rules (Crafter) count as errors sent back to the LLM
    check_rules: bool = True
    # control variant: mend the last revision by the game's rules instead of using it as written
    fix_rules: bool = False
    replans: int = 1  # times per training a skill that keeps failing sends the graph back to the LLM (0: never)
    replan_after: int = 1000  # steps one env spends on its active skill without completing it before a re-plan
    skill_reward: float = 1.0  # reward for completing the active skill, added to the env's reward
    condition_policy: bool = True  # append the active skill's one-hot to the policy's observation
    temperature: float = 0.2  # sampling temperature of the graph builder
    max_tokens: int = 600  # cap on each reply
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        if not self.target.strip():
            raise ValueError("target must name a goal, e.g. make_stone_pickaxe")
        if self.plan_source not in ("llm", "rules"):
            raise ValueError(f"plan_source must be 'llm' or 'rules', got {self.plan_source!r}")
        for key in ("repair_rounds", "replans"):
            if getattr(self, key) < 0:
                raise ValueError(f"{key} must be >= 0, got {getattr(self, key)}")
        if self.replan_after < 1:
            raise ValueError(
                f"replan_after must be >= 1 step, got {self.replan_after} (replans=0 turns re-planning off)"
            )
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You plan for an agent in a Minecraft-like game. You describe the skills needed to
reach a target as a graph: each skill with the skills that must be done before it. Reply
with one ```json list only."""

TASK = """Game: {goal}

Skills (each one is also a goal the game can check): {skills}

Target: {target}

List every skill needed to reach the target, including the target itself, as a JSON list
of items {{"name": "<skill>", "requires": ["<skill done before>", ...], "yields": "<what it gives>"}}.
Use only the skill names above. Example for a different target:
```json
[{{"name": "collect_sapling", "requires": [], "yields": "a sapling"}},
 {{"name": "place_plant", "requires": ["collect_sapling"], "yields": "a plant on grass"}}]
```"""

REPAIR = """The skill graph has errors:
{errors}
Reply with the corrected JSON list, using only these skill names: {skills}."""

REPLAN = """The agent follows this skill graph in the order {sequence}. It has been on the skill
{skill} for {steps} steps with the skills before it ({done}) done, and has not completed it
({completions} completions of {skill} in this training so far). The skill may need something
the graph does not list first. Reply with the revised JSON list of the whole graph, using only
these skill names: {skills}."""


# -- pure pieces ---------------------------------------------------------------------------


@dataclass
class Skill:
    name: str
    requires: list[str]
    yields: str = ""


@dataclass
class SkillStep(PlanStep):
    """A plan step with where it came from: ``"llm"`` (the LLM's graph holds this skill with
    these requirements) or ``"rules"`` (the game's rules added it or rewrote its requirements)."""

    source: str = "llm"
    requires: list[str] = field(default_factory=list)  # the requirements the search followed


@dataclass
class SkillPlan(Plan):
    """The searched skill sequence. ``source`` says how it was made: ``"llm"`` (the LLM's
    graph as written), ``"fixed"`` (mended by the rules, ``fix_rules``), ``"rules"`` (no LLM).

    ``cost`` (LLM calls and wall seconds that built it) is an attribute, not a field: it
    travels with the plan to the training process, but it is not part of what decides a
    training (the results store hashes the fields), and seconds differ between runs.
    """

    source: str = "llm"
    errors: list[str] = field(default_factory=list)  # what the LLM's graph still got wrong, as written

    def __post_init__(self) -> None:
        super().__post_init__()
        self.cost = {"calls": 0, "seconds": 0.0}

    @property
    def llm_steps(self) -> int:
        return sum(getattr(s, "source", "llm") == "llm" for s in self.steps)

    def graph_json(self) -> str:
        """The plan's graph as the JSON list the prompt asks for (the LLM's previous answer in a re-plan)."""
        return json.dumps(
            [{"name": s.name, "requires": getattr(s, "requires", []), "yields": s.goal_text} for s in self.steps]
        )


def parse_graph(reply: str, goals: list[str]) -> tuple[dict[str, Skill], list[str]]:
    """The skill graph from a reply (a JSON list, fenced or bare), and its errors as text lines."""
    match = re.search(r"\[.*\]", reply or "", re.DOTALL)
    if not match:
        return {}, ["no JSON list found in the reply"]
    try:
        items = json.loads(re.sub(r",\s*([\]}])", r"\1", match.group(0)))
    except json.JSONDecodeError as e:
        # Small models repeat items until max_tokens cuts the list off; the objects that are
        # whole still describe a graph, so keep them rather than throw the reply away.
        items = objects_in(reply)
        if not items:
            return {}, [f"the JSON does not parse: {e.msg} (line {e.lineno})"]
    graph: dict[str, Skill] = {}
    errors: list[str] = []
    for item in items if isinstance(items, list) else []:
        if not isinstance(item, dict) or not item.get("name"):
            errors.append(f"an item is not an object with a name: {json.dumps(item)[:80]}")
            continue
        name = match_goal(item["name"], goals)
        if name is None:
            errors.append(f"unknown skill {item['name']!r}")
            continue
        requires = item.get("requires") or []
        requires = [requires] if isinstance(requires, str) else requires
        known = []
        for req in requires if isinstance(requires, list) else []:
            got = match_goal(str(req), goals)
            if got is None:
                errors.append(f"skill {name}: unknown requirement {req!r}")
            elif got != name:
                known.append(got)
        if name in graph:  # a repeated skill: one node with the requirements of every mention
            known = graph[name].requires + [r for r in known if r not in graph[name].requires]
        graph[name] = Skill(name, list(dict.fromkeys(known)), str(item.get("yields", ""))[:120])
    if not graph and not errors:
        errors.append("the list holds no skills")
    return graph, list(dict.fromkeys(errors))


def objects_in(reply: str) -> list[dict]:
    """Every flat JSON object in the text that parses on its own (a cut-off or broken list's whole items)."""
    items = []
    for text in re.findall(r"\{[^{}]*\}", reply or ""):
        try:
            item = json.loads(re.sub(r",\s*([\]}])", r"\1", text))
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict):
            items.append(item)
    return items


def search(graph: dict[str, Skill], target: str) -> tuple[list[str], list[str]]:
    """Skills from the target back through the requirements, requirements first (DFS post-order).

    A requirement the graph does not describe is a basic skill with no requirements of
    its own. Returns (sequence, errors). A cycle is an error, and the sequence skips the
    requirement that closes it (the order the graph gives, as written); a target missing
    from the graph is an error with no sequence.
    """
    if target not in graph:
        return [], [f"the graph has no skill for the target {target!r}"]
    order: list[str] = []
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    errors: list[str] = []

    def visit(name: str, path: list[str]) -> None:
        if state.get(name) == "done":
            return
        if state.get(name) == "open":
            errors.append("the requirements form a cycle: " + " -> ".join(path + [name]))
            return
        state[name] = "open"
        for req in graph[name].requires if name in graph else []:
            visit(req, path + [name])
        state[name] = "done"
        order.append(name)

    visit(target, [])
    return order, errors


#: what produces each item or placed object, as the achievement that first gives it
PRODUCER = {
    "wood": "collect_wood",
    "stone": "collect_stone",
    "coal": "collect_coal",
    "iron": "collect_iron",
    "diamond": "collect_diamond",
    "sapling": "collect_sapling",
    "drink": "collect_drink",
    "table": "place_table",
    "furnace": "place_furnace",
}


def game_requirements(task: Any) -> dict[str, set[str]]:
    """Each Crafter achievement's direct prerequisites by the game's own rules (``crafter/data.yaml``).

    ``collect_<m>`` needs the tool the material requires, ``place_<x>`` the items it uses,
    ``make_<x>`` the items it uses and the stations it must be near. Empty for other tasks.
    """
    if task.name not in ("minecraft", "crafter"):
        return {}
    import pathlib

    import crafter
    import yaml

    data = yaml.safe_load((pathlib.Path(crafter.__file__).parent / "data.yaml").read_text())
    produced = dict(PRODUCER) | {f"{k}": f"make_{k}" for k in data["make"]}
    material = {"tree": "wood", "water": "drink", "grass": "sapling"}
    needs: dict[str, set[str]] = {}
    for mat, rule in data["collect"].items():
        needs[f"collect_{material.get(mat, mat)}"] = {produced[i] for i in rule.get("require", {}) if i in produced}
    for obj, rule in data["place"].items():
        needs[f"place_{obj}"] = {produced[i] for i in rule.get("uses", {}) if i in produced}
    for item, rule in data["make"].items():
        needs[f"make_{item}"] = {produced[i] for i in [*rule.get("uses", {}), *rule.get("nearby", [])] if i in produced}
    return needs


def rule_errors(sequence: list[str], rules: dict[str, set[str]]) -> list[str]:
    """A sequence's skills whose game prerequisites are not among the skills before them."""
    errors = []
    for i, name in enumerate(sequence):
        missing = sorted(rules.get(name, set()) - set(sequence[:i]))
        if missing:
            errors.append(
                f"skill {name}: the game needs {', '.join(missing)} before it; add "
                f"{'it' if len(missing) == 1 else 'them'} to its requires"
            )
    return errors


def complete(graph: dict[str, Skill], rules: dict[str, set[str]], target: str) -> dict[str, Skill]:
    """The graph mended by the game's rules: each skill the rules know requires exactly what they
    say (wrong requirements, and the cycles they make, go), missing prerequisites and the
    target are added as skills. ``complete({}, rules, target)`` is the rules' own graph."""
    out = {
        name: Skill(s.name, sorted(rules[name]) if name in rules else list(s.requires), s.yields)
        for name, s in graph.items()
    }
    if target not in out:
        out[target] = Skill(target, sorted(rules.get(target, set())), "")
    todo = list(out)
    while todo:
        name = todo.pop()
        for req in out[name].requires:
            if req not in out:
                out[req] = Skill(req, sorted(rules.get(req, set())), "")
                todo.append(req)
    return out


def plan_of(
    graph: dict[str, Skill],
    sequence: list[str],
    target: str,
    source: str = "llm",
    written: dict[str, Skill] | None = None,
    errors: list[str] | None = None,
) -> SkillPlan:
    """The plan of a searched ``sequence``. A step is the LLM's when ``written`` (the LLM's
    graph; default ``graph``) holds the skill with the requirements the search followed;
    otherwise the rules added or rewrote it."""
    written = graph if written is None else written
    steps = []
    for name in sequence:
        requires = graph[name].requires if name in graph else []
        # a requirement the LLM named but did not describe is its basic skill (see search)
        named = name in written or any(name in s.requires for s in written.values())
        mine = named and sorted(requires) == sorted(written[name].requires if name in written else [])
        steps.append(
            SkillStep(
                name,
                "skill",
                graph[name].yields if name in graph else "",
                done=name,
                source="llm" if source != "rules" and mine else "rules",
                requires=list(requires),
            )
        )
    return SkillPlan(steps, origin=NAME, target=target, source=source, errors=list(errors or []))  # type: ignore[arg-type]


def build_plan(
    reply: str, goals: list[str], target: str, rules: dict[str, set[str]] | None = None, fix: bool = False
) -> tuple[SkillPlan | None, list[str]]:
    """The plan of one reply and the reply's errors (unknown names, cycles, a missing target,
    requirements that contradict the game's ``rules``).

    The plan is the graph as written, errors and all (None only when there is no sequence:
    no skill named, or no target); :meth:`Plugin.plan` sends the errors back before it uses
    one. With ``fix``, the graph is first mended by the rules (:func:`complete`) and the
    errors are those left after mending (none, as long as the reply named some skill).
    """
    graph, errors = parse_graph(reply, goals)
    if not graph:
        return None, errors
    if fix and rules:
        mended = complete(graph, rules, target)
        sequence, errors = search(mended, target)
        return plan_of(mended, sequence, target, "fixed", written=graph), errors
    sequence, more = search(graph, target)
    errors += more
    if sequence and rules:
        errors += rule_errors(sequence, rules)
    return (plan_of(graph, sequence, target, errors=errors) if sequence else None), errors


def rules_plan(rules: dict[str, set[str]], target: str) -> SkillPlan:
    """The no-LLM control: the game's own tech tree for ``target``, searched the same way."""
    graph = complete({}, rules, target)
    sequence, _ = search(graph, target)
    return plan_of(graph, sequence, target, "rules")


@dataclass
class Outcome:
    """What one conversation with the graph builder gave: the plan (or None), its replies'
    errors and texts, and the calls and wall seconds it cost."""

    plan: SkillPlan | None = None
    rounds: int = 0  # replies received
    errors: list[str] = field(default_factory=list)  # the last reply's errors
    logs: list[tuple[str, str]] = field(default_factory=list)  # (name, reply + errors) per round
    calls: int = 0
    seconds: float = 0.0


def converse(
    llm: Any,
    messages: list[dict[str, str]],
    cfg: Config,
    goals: list[str],
    target: str,
    rules: dict[str, set[str]],
    seed: int,
    tag: str,
    stop: Callable[[], bool] = lambda: False,
) -> Outcome:
    """Ask for a graph, send its errors back ``cfg.repair_rounds`` times, and keep the plan to use.

    A reply with no errors ends it. Otherwise, of the replies that give a sequence, the one
    with the fewest errors (the latest of equals) is used as written (with ``fix_rules``:
    the latest reply that named a skill, mended by the rules); a failed call ends the
    conversation (logged, never raised); ``stop()`` true ends it before the next call (a
    training that is over needs no more revisions).
    """
    out = Outcome()
    checked = rules if cfg.check_rules else {}
    named = ""  # the latest reply that named some skill: what fix_rules mends
    for rnd in range(1 + cfg.repair_rounds):
        if stop():
            out.logs.append((f"r{rnd}", "Stopped: the training ended."))
            break
        start = time.perf_counter()
        out.calls += 1
        try:
            (reply,) = llm.chat(
                messages,
                n=1,
                temperature=cfg.temperature,
                max_tokens=cfg.max_tokens,
                seed=seed + rnd,
                tag=f"{tag}-r{rnd}",
            )
        except LLMError as e:  # one failed call: log it and keep what came before
            out.logs.append((f"r{rnd}", f"The LLM call failed: {e}"))
            break
        finally:
            out.seconds += time.perf_counter() - start
        out.rounds += 1
        plan, errors = build_plan(reply.text, goals, target, checked)
        out.logs.append((f"r{rnd}", reply.text + ("\n\nErrors:\n" + "\n".join(errors) if errors else "")))
        out.errors = errors
        named = reply.text if parse_graph(reply.text, goals)[0] else named
        if plan is not None and (out.plan is None or len(errors) <= len(out.plan.errors)):
            out.plan = plan  # of the LLM's usable graphs, the one with the fewest errors (the latest of equals)
        if (plan is not None and not errors) or rnd == cfg.repair_rounds:
            break
        messages = messages + [
            {"role": "assistant", "content": reply.text},
            {
                "role": "user",
                "content": REPAIR.format(errors="\n".join(f"- {e}" for e in errors[:8]), skills=", ".join(goals)),
            },
        ]
    if cfg.fix_rules and rules and named and (out.plan is None or out.plan.errors):
        out.plan, out.errors = build_plan(named, goals, target, rules, fix=True)
        out.logs.append(("fixed", f"Mended by the game's rules (fix_rules):\n\n{out.plan.text if out.plan else ''}"))
    return out


def goal_at(follower: PlanFollower, active: torch.Tensor) -> torch.Tensor:
    """``[B]`` long: the goal index among the task's goals of the steps ``active`` (-1: plan finished)."""
    return torch.cat([follower.index, torch.tensor([-1])])[active]


def skill_one_hot(follower: PlanFollower, obs: torch.Tensor, n_goals: int) -> torch.Tensor:
    """``[B, G + 1]``: the active skill's goal as a one-hot (the last column: plan finished).

    Over the task's goals, not the plan's positions, so a re-plan keeps its width and a
    skill keeps its column."""
    goal = goal_at(follower, follower.active(obs))
    return torch.nn.functional.one_hot(torch.where(goal < 0, n_goals, goal), n_goals + 1).float()


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """One Plan4MC run: the skill graph and its sequence; in training, the active skill's reward and re-plans."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.latest: SkillPlan | None = None  # the latest plan
        self.errors: list[str] = []  # the last reply's errors

    @hookimpl
    def on_run_start(self, run) -> None:
        goals = goal_names(run.task)
        if not goals:
            raise UserError(
                f"plan4mc needs a task with goals it can check (achievement fields, e.g. env=minecraft); "
                f"{run.task.name!r} has none"
            )
        if match_goal(self.cfg.target, goals) is None:
            raise UserError(
                f"plugins.plan4mc.target={self.cfg.target!r} is not a goal of {run.task.name!r}; "
                f"choose one of: {', '.join(goals)}"
            )
        needs = [
            k
            for k, on in (
                ("plan_source=rules", self.cfg.plan_source == "rules"),
                ("fix_rules=true", self.cfg.fix_rules),
            )
            if on
        ]
        if needs and not game_requirements(run.task):
            raise UserError(
                f"plugins.plan4mc.{needs[0]} needs the game's rules, which are known for Crafter only "
                f"(env=minecraft); {run.task.name!r} has none"
            )

    @hookimpl
    def plan(self, run, iteration: int) -> Plan | None:
        cfg = self.cfg
        goals = goal_names(run.task)
        target = match_goal(cfg.target, goals) or cfg.target
        rules = game_requirements(run.task)
        plan: SkillPlan | None
        if cfg.plan_source == "rules":
            plan, out = rules_plan(rules, target), Outcome()
        else:
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": TASK.format(goal=run.task.goal, skills=", ".join(goals), target=target)},
            ]
            out = converse(
                run.llm,
                msgs,
                cfg,
                goals,
                target,
                rules,
                seed=run.seed * 1000 + iteration * 10,
                tag=f"{NAME}-graph-it{iteration}",
            )
            plan = out.plan
            if plan is not None and check_plan(plan, run.task):  # every skill must be a goal the task checks
                out.logs.append(("check", "\n".join(check_plan(plan, run.task))))
                plan = None
            for name, text in out.logs:
                run.log_text(f"{NAME}/it{iteration}-{name}.md", text)
        self.errors = out.errors
        if plan is not None:
            plan.cost = {"calls": out.calls, "seconds": out.seconds}
            self.latest = plan
        run.log_metrics(
            {
                f"{NAME}/skills": len(plan.steps) if plan else 0,
                f"{NAME}/repairs": max(0, out.rounds - 1),
                f"{NAME}/llm_steps": plan.llm_steps if plan else 0,
                f"{NAME}/errors_left": len(plan.errors) if plan else 0,
            },
            step=iteration,
        )
        return plan  # None: no usable graph; the run goes on without a plan

    # -- training: the active skill's reward and one-hot, re-plans ---------------------------

    def _state(self, train) -> dict[str, Any] | None:
        plan = train.plan
        if plan is None or plan.origin != NAME:
            return None
        st = train.state.get(NAME)
        if st is None:
            st = train.state[NAME] = {
                "goals": goal_names(train.task),
                "steps": 0,
                "llm_steps": 0,
                "unlike_rules": 0,
                "completed": 0,
                "per_skill": {},
                "stuck": None,
                "replans": 0,
                "calls": None,
                "pending": 0,
                "ended": threading.Event(),
                "llm_calls": 0,
                "llm_seconds": 0.0,
            }
            self._adopt(st, plan, train.task)
            cost = getattr(plan, "cost", {})  # the calls that built the plan count in each training that uses it
            st["llm_calls"], st["llm_seconds"] = int(cost.get("calls", 0)), float(cost.get("seconds", 0.0))
        return st

    @staticmethod
    def _adopt(st: dict[str, Any], plan: Plan, task: Any) -> None:
        st["plan"], st["follower"] = plan, PlanFollower(plan, task)
        st["from_llm"] = torch.tensor([getattr(s, "source", "llm") == "llm" for s in st["follower"].steps] + [False])
        # the control's plan (the rules' tree for the same target): a step steers differently only where
        # the plan's active skill is not the one the control would follow; None where the game has no rules
        rules = game_requirements(task)
        target = getattr(plan, "target", "")
        st["rules"] = PlanFollower(rules_plan(rules, target), task) if rules else None
        st["stuck"] = None  # steps per env on each skill since it last completed it; sized on the next batch

    @hookimpl
    def represent_state(self, train, obs: torch.Tensor) -> torch.Tensor | None:
        st = self._state(train)
        if st is None or not self.cfg.condition_policy:
            return None
        return skill_one_hot(st["follower"], obs[..., : train.task.obs_dim], len(st["goals"]))

    @hookimpl
    def compute_reward(self, train, batch) -> torch.Tensor | None:
        st = self._state(train)
        if st is None or not len(st["follower"]):
            return None
        follower = st["follower"]
        active = follower.active(batch.obs)
        done = follower.completed(batch.obs, batch.next_obs)
        st["steps"] += int(active.numel())
        st["llm_steps"] += int(st["from_llm"][active].sum())
        if st["rules"] is not None:
            control = st["rules"]
            st["unlike_rules"] += int((goal_at(follower, active) != goal_at(control, control.active(batch.obs))).sum())
        # per env and skill: steps on it without completing it (prerequisites done: it is active)
        if st["stuck"] is None or st["stuck"].shape[0] != active.shape[0]:
            st["stuck"] = torch.zeros(active.shape[0], len(follower) + 1, dtype=torch.long)
        rows = torch.arange(active.shape[0])
        st["stuck"][rows, active] += 1
        st["stuck"][rows[done], active[done]] = 0
        st["stuck"][:, -1] = 0  # plan finished: nothing is failing
        if done.any():
            st["completed"] += int(done.sum())
            for i in active[done].tolist():
                name = follower.steps[i].name
                st["per_skill"][name] = st["per_skill"].get(name, 0) + 1
        return done.float() * self.cfg.skill_reward

    @hookimpl
    def on_rollout(self, train, batch: Any) -> None:
        st = self._state(train)
        if st is None:
            return
        train.log_metric(f"{NAME}/skills_completed", st["completed"])
        self._take_replans(train, st)
        self._maybe_replan(train, st)

    def _maybe_replan(self, train, st: dict[str, Any]) -> None:
        """Ask for a revised graph when an env has spent ``replan_after`` steps on one skill."""
        cfg = self.cfg
        if (
            cfg.plan_source == "rules"
            or st["replans"] >= cfg.replans
            or st["stuck"] is None
            or st["pending"]
            or train.llm is None
        ):
            return
        worst = st["stuck"].max(dim=0).values
        if int(worst.max()) < cfg.replan_after:
            return
        i = int(worst.argmax())
        follower, plan = st["follower"], st["plan"]
        skill = follower.steps[i].name
        st["replans"] += 1
        st["stuck"].zero_()
        if st["calls"] is None:
            warm_up(train.llm)  # an in-process model loads here once, not in the worker (it holds the GIL)
            calls = st["calls"] = BackgroundCalls(self._replan_work(train, st), name=f"{NAME}-replan", queue_size=1)
            calls.start()
        failure = {
            "skill": skill,
            "steps": int(worst.max()),
            "done": [s.name for s in follower.steps[:i]],
            "completions": st["per_skill"].get(skill, 0),
            "k": st["replans"],
            "graph": plan.graph_json(),
            "sequence": [s.name for s in plan.steps],
        }
        st["pending"] += int(st["calls"].submit(json.dumps(failure)))
        train.log_text(
            f"{NAME}-replans.md",
            f"## re-plan {st['replans']} at {train.frames} frames\n\n"
            f"{skill}: {failure['steps']} steps without completing it "
            f"(prerequisites done: {', '.join(failure['done']) or 'none'})\n\n",
        )

    def _replan_work(self, train, st: dict[str, Any]):
        """The worker's job: one re-plan conversation (reads only what the job and the config hold)."""
        cfg, goals = self.cfg, list(st["goals"])
        target = match_goal(cfg.target, goals) or cfg.target
        rules, llm, seed, goal_text = game_requirements(train.task), train.llm, train.seed, train.task.goal
        ended = st["ended"]

        def work(job: str) -> Outcome:
            f = json.loads(job)
            msgs = [
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": TASK.format(goal=goal_text, skills=", ".join(goals), target=target)},
                {"role": "assistant", "content": "```json\n" + f["graph"] + "\n```"},
                {
                    "role": "user",
                    "content": REPLAN.format(
                        sequence=" -> ".join(f["sequence"]),
                        skill=f["skill"],
                        steps=f["steps"],
                        done=", ".join(f["done"]) or "none",
                        completions=f["completions"],
                        skills=", ".join(goals),
                    ),
                },
            ]
            return converse(
                llm,
                msgs,
                cfg,
                goals,
                target,
                rules,
                seed=seed * 1000 + 500 + 10 * f["k"],
                tag=f"{NAME}-replan{f['k']}",
                stop=ended.is_set,
            )

        return work

    def _take_replans(self, train, st: dict[str, Any]) -> None:
        """Adopt a revised graph that has landed (a revision with no usable graph keeps the plan)."""
        calls = st["calls"]
        if calls is None:
            return
        for job, out in calls.drain():
            k = json.loads(job)["k"]
            st["pending"] -= 1
            st["llm_calls"] += out.calls
            st["llm_seconds"] += out.seconds
            text = "\n\n".join(f"### {name}\n\n{t}" for name, t in out.logs)
            if out.plan is not None:
                self._adopt(st, out.plan, train.task)
                text += f"\n\nAdopted at {train.frames} frames:\n\n{out.plan.text}\n"
            else:
                text += "\n\nNo usable graph: the plan stays.\n"
            train.log_text(f"{NAME}-replans.md", f"## re-plan {k}\n\n{text}\n\n")
            train.log_metric(f"{NAME}/replans", st["replans"])
        for error in calls.errors:  # an exception in the worker: the job is gone, the plan stays
            st["pending"] = max(0, st["pending"] - 1)
            train.log_text(f"{NAME}-replans.md", f"A re-plan failed: {error}\n\n")
        calls.errors.clear()

    @hookimpl
    def on_train_end(self, train, result: TrainResult) -> None:
        st = train.state.pop(NAME, None)
        if st is None:  # no plan of ours (none usable): the LLM changed nothing; another plugin's figures stay
            for key in ("llm/changed_share", "llm/calls", "llm/seconds"):
                result.metrics.setdefault(key, 0.0)
            return
        if st["calls"] is not None:
            st["ended"].set()
            st["calls"].stop(wait_s=1.0)  # a revision still running is dropped: training is over
            self._take_replans(train, st)
            if st["pending"]:
                train.log_text(
                    f"{NAME}-replans.md",
                    f"A re-plan was still running when training ended at "
                    f"{train.frames} frames: dropped, its calls not counted.\n\n",
                )
        plan = st["plan"]
        # against the control's plan where the game has rules: an LLM plan equal to the rules' changes nothing
        changed = (st["unlike_rules"] if st["rules"] is not None else st["llm_steps"]) / max(1, st["steps"])
        result.metrics.update(
            {
                f"{NAME}/skills": float(len(plan.steps)),
                f"{NAME}/llm_steps": float(st["from_llm"][:-1].sum()),
                f"{NAME}/rule_steps": float(len(st["follower"]) - int(st["from_llm"][:-1].sum())),
                f"{NAME}/replans": float(st["replans"]),
                f"{NAME}/skills_completed": float(st["completed"]),
                f"{NAME}/llm_written_share": st["llm_steps"] / max(1, st["steps"]),
                "llm/changed_share": changed,
                # the same under this plugin's name: runs that logged it measured change against the control
                f"{NAME}/changed_share": changed,
                "llm/calls": float(st["llm_calls"]),
                "llm/seconds": float(st["llm_seconds"]),
            }
        )
        for name, count in st["per_skill"].items():
            result.metrics[f"{NAME}/completed_{name}"] = float(count)
