"""plan4mc: an LLM-built skill graph, searched for a skill sequence that RL skills carry out (Plan4MC).

Method (Yuan et al., 2023, "Plan4MC: Skill Reinforcement Learning and Planning for
Open-World Minecraft Tasks"):

1. Skill graph (``plan``): the LLM lists the basic skills the target needs, each with the
   skills it requires first and what it yields, as JSON. Skills are the task's checkable
   goals (Crafter's achievements); the reply is validated (unknown skills, unknown
   requirements, a missing target, cycles) and its errors go back to the LLM for a
   revision, ``repair_rounds`` times.
2. Search: a depth-first walk from the target through the requirements gives the skills
   in an order where each one's requirements come first (a topological order of the
   target's part of the graph). It becomes the run's :class:`core.records.Plan`.
3. Skills learned with RL (``compute_reward``, ``represent_state``): one goal-conditioned
   PPO policy. Each env's active skill is the first one of the sequence not yet achieved
   in its episode (read from the observation's achievement flags, so it advances as the
   agent progresses and resets with the episode); completing it pays ``skill_reward``,
   and its one-hot is appended to the observation so the policy knows which skill runs.

Config: ``conf/plugins/plan4mc.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import torch

from core import PluginConfig, hookimpl
from core.errors import UserError
from core.plan import PlanFollower, check_plan, goal_names, match_goal
from core.records import Plan, PlanStep, TrainResult

NAME = "plan4mc"


@dataclass
class Config(PluginConfig):
    """``plugins.plan4mc``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 1  # outer rounds (the skill graph is built once per round; the paper plans once)
    target: str = "make_stone_pickaxe"  # the goal the skill sequence leads to (a task goal: a Crafter achievement)
    repair_rounds: int = 2  # times a skill graph with errors goes back to the LLM for a revision
    check_rules: bool = True  # check the sequence against the game's rules (Crafter); errors go back to the LLM
    fix_rules: bool = True  # in the last round, mend the graph by the game's rules (requirements, missing skills, the target)
    skill_reward: float = 1.0  # reward for completing the active skill, added to the env's reward
    condition_policy: bool = True  # append the active skill's one-hot to the policy's observation
    temperature: float = 0.2  # sampling temperature of the graph builder
    max_tokens: int = 600  # cap on each reply
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        if not self.target.strip():
            raise ValueError("target must name a goal, e.g. make_stone_pickaxe")
        if self.repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {self.repair_rounds}")
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


# -- pure pieces ---------------------------------------------------------------------------


@dataclass
class Skill:
    name: str
    requires: list[str]
    yields: str = ""


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
        graph[name] = Skill(name, known, str(item.get("yields", ""))[:120])
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
    its own. Returns (sequence, errors); a cycle or a target missing from the graph is an error.
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
    return (order if not errors else []), errors


#: what produces each item or placed object, as the achievement that first gives it
PRODUCER = {"wood": "collect_wood", "stone": "collect_stone", "coal": "collect_coal", "iron": "collect_iron",
            "diamond": "collect_diamond", "sapling": "collect_sapling", "drink": "collect_drink",
            "table": "place_table", "furnace": "place_furnace"}


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
            errors.append(f"skill {name}: the game needs {', '.join(missing)} before it; add "
                          f"{'it' if len(missing) == 1 else 'them'} to its requires")
    return errors


def complete(graph: dict[str, Skill], rules: dict[str, set[str]], target: str) -> dict[str, Skill]:
    """The graph mended by the game's rules: each skill the rules know requires exactly what they
    say (wrong requirements, and the cycles they make, go), missing prerequisites and the
    target are added as skills."""
    out = {name: Skill(s.name, sorted(rules[name]) if name in rules else list(s.requires), s.yields)
           for name, s in graph.items()}
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


def build_plan(reply: str, goals: list[str], target: str, rules: dict[str, set[str]] | None = None,
               fix: bool = False) -> tuple[Plan | None, list[str]]:
    """A plan from a reply: parse and validate the graph, search it from ``target``, check the
    sequence against the game's ``rules``. With ``fix`` (the last round), a graph is first
    mended by the rules (:func:`complete`); what the reply got wrong then no longer blocks
    the plan, as long as it named some skills."""
    graph, errors = parse_graph(reply, goals)
    if graph and fix and rules:
        graph, errors = complete(graph, rules, target), []
    sequence, more = search(graph, target) if graph else ([], [])
    errors += more
    if not errors and rules:
        errors += rule_errors(sequence, rules)
    if errors:
        return None, errors
    steps = [PlanStep(name, "skill", graph[name].yields if name in graph else "", done=name) for name in sequence]
    return Plan(steps, origin=NAME, target=target), []


# -- hooks -----------------------------------------------------------------------------------


class Plugin:
    """One Plan4MC run: the skill graph and its sequence; in training, the active skill's reward."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.latest: Plan | None = None  # the latest valid plan
        self.errors: list[str] = []  # the last reply's errors, when no valid plan came of it

    @hookimpl
    def on_run_start(self, run) -> None:
        goals = goal_names(run.task)
        if not goals:
            raise UserError(f"plan4mc needs a task with goals it can check (achievement fields, e.g. env=minecraft); "
                            f"{run.task.name!r} has none")
        if match_goal(self.cfg.target, goals) is None:
            raise UserError(f"plugins.plan4mc.target={self.cfg.target!r} is not a goal of {run.task.name!r}; "
                            f"choose one of: {', '.join(goals)}")

    @hookimpl
    def plan(self, run, iteration: int) -> Plan | None:
        cfg = self.cfg
        if iteration >= cfg.iterations:
            return None
        goals = goal_names(run.task)
        target = match_goal(cfg.target, goals) or cfg.target
        rules = game_requirements(run.task) if cfg.check_rules else {}
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": TASK.format(goal=run.task.goal, skills=", ".join(goals), target=target)}]
        for rnd in range(1 + cfg.repair_rounds):
            (reply,) = run.llm.chat(msgs, n=1, temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                    seed=run.seed * 1000 + iteration * 10 + rnd, tag=f"{NAME}-graph-it{iteration}-r{rnd}")
            last = rnd == cfg.repair_rounds
            plan, errors = build_plan(reply.text, goals, target, rules, fix=last and cfg.fix_rules)
            if plan is not None:
                errors = check_plan(plan, run.task)
            run.log_text(f"{NAME}/it{iteration}-r{rnd}.md", reply.text + ("\n\nErrors:\n" + "\n".join(errors) if errors else ""))
            if plan is not None and not errors:
                self.latest, self.errors = plan, []
                run.log_metrics({f"{NAME}/skills": len(plan.steps), f"{NAME}/repairs": rnd}, step=iteration)
                return plan
            self.errors = errors
            msgs = msgs + [{"role": "assistant", "content": reply.text},
                           {"role": "user", "content": REPAIR.format(errors="\n".join(f"- {e}" for e in errors[:8]),
                                                                     skills=", ".join(goals))}]
        run.log_metrics({f"{NAME}/skills": len(self.latest.steps) if self.latest else 0, f"{NAME}/repairs": cfg.repair_rounds + 1},
                        step=iteration)
        return self.latest  # the last valid plan, or None: the run goes on without one

    # -- training: the active skill's reward and one-hot ---------------------------------

    def _follower(self, train) -> PlanFollower | None:
        plan = train.plan
        if plan is None or plan.origin != NAME:
            return None
        got = train.state.get(NAME)
        if got is None:
            got = train.state[NAME] = {"follower": PlanFollower(plan, train.task), "completed": 0, "per_skill": {}}
        return got["follower"]

    @hookimpl
    def represent_state(self, train, obs: torch.Tensor) -> torch.Tensor | None:
        follower = self._follower(train)
        if follower is None or not self.cfg.condition_policy:
            return None
        return follower.one_hot(obs[..., : train.task.obs_dim])

    @hookimpl
    def compute_reward(self, train, batch) -> torch.Tensor | None:
        follower = self._follower(train)
        if follower is None or not len(follower):
            return None
        done = follower.completed(batch.obs, batch.next_obs)
        if done.any():
            st = train.state[NAME]
            st["completed"] += int(done.sum())
            active = follower.active(batch.obs)[done]
            for i in active.tolist():
                name = follower.steps[i].name
                st["per_skill"][name] = st["per_skill"].get(name, 0) + 1
        return done.float() * self.cfg.skill_reward

    @hookimpl
    def on_rollout(self, train, batch: Any) -> None:
        st = train.state.get(NAME)
        if st is not None:
            train.log_metric(f"{NAME}/skills_completed", st["completed"])

    @hookimpl
    def on_train_end(self, train, result: TrainResult) -> None:
        st = train.state.pop(NAME, None)
        if st is not None:
            result.metrics[f"{NAME}/skills_completed"] = float(st["completed"])
            for name, count in st["per_skill"].items():
                result.metrics[f"{NAME}/completed_{name}"] = float(count)
