"""rl_gpt: a slow agent plans, a fast agent codes macro-actions, RL learns when to use them (RL-GPT, NeurIPS 2024).

Method (Liu et al., "RL-GPT: Integrating Reinforcement Learning and Code-as-policy"):

1. Slow agent (``plan``): the LLM decomposes the task into sub-actions and marks each as
   ``code`` (simple enough to write as a program over primitive actions) or ``rl`` (left
   to the RL agent to learn from primitive actions).
2. Fast agent (``propose_actions``): for every ``code`` sub-action the LLM writes a
   macro-action, ``act(state) -> primitive action`` plus ``done(state) -> bool``, over the
   task's named fields; the macros are added to the policy's discrete action space
   (:mod:`core.train.macros`), so RL learns when to call each one. The prompt lists the
   task's fields (derived ones included) with their shapes at a batch of one, how the
   code reads each (``name = state.name``, :func:`core.prompting.field_bindings`) and a
   short skeleton of the two functions;
   the names a reply reads are checked before anything runs (:mod:`core.namecheck`): an
   unknown field goes back to the fast agent with the valid ones, a unique close one is
   renamed. ``code.interface=dict`` keeps the earlier prompt (dict reads, an example of
   another skill) and skips the check, for comparison.
3. Critic: each macro is rolled out on its own on a small env of the task (in plan order,
   so that a later skill starts where the earlier one left off); failures (exceptions,
   bad actions, never reaching ``done``) go back to the LLM, which revises the code.
   After training, the macros' call counts and the task fitness feed the next round.
4. Parameters of the coded actions: each macro's step budget is tuned from the critic's
   rollouts (twice the longest run that finished, at most ``max_steps``).
5. RL sub-actions as RL-trained skills: the plan (a :class:`core.records.Plan`) names for
   each ``rl`` sub-action the task goal that shows it finished (a Crafter achievement);
   in training the policy is paid ``rl_reward`` when it completes the active ``rl``
   sub-action and sees which one is active (``compute_reward`` / ``represent_state``
   through :class:`core.plan.PlanFollower`). A goal the task cannot check goes back to
   the slow agent for a revision.

Config: ``conf/plugins/rl_gpt.yaml`` (schema: :class:`Config`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.plugin import (
    SAFE_BUILTIN_NAMES,
    Candidate,
    IterationResult,
    MacroAction,
    MacroSet,
    Plan,
    PlanFollower,
    PlanStep,
    PluginConfig,
    Program,
    SandboxError,
    Shapes,
    TrainResult,
    batch_shapes,
    check_names,
    code_options,
    extract_code,
    extract_function,
    field_bindings,
    fields_text,
    goal_names,
    hookimpl,
    interface_of,
    match_goal,
    state_arguments,
)

NAME = "rl_gpt"
ACT, DONE = "act", "done"


@dataclass
class Config(PluginConfig):
    """``plugins.rl_gpt``; ``iterations`` and ``final_seeds`` come from :class:`core.PluginConfig`."""

    iterations: int = 2  # outer rounds: plan, code + critic, train, feed back (paper: a few)
    max_subactions: int = 4  # most sub-actions in the slow agent's plan
    max_steps: int = 32  # most primitive steps one macro-action runs
    critic_rounds: int = 1  # times the critic may send a macro's failed rollouts back for a revision
    rollouts: int = 2  # critic rollouts of the macros per check (each on a fresh episode)
    temperature: float = 0.3  # sampling temperature of both agents
    max_tokens: int = 500  # cap on each reply
    # optional decomposition hint for the slow agent, e.g. "collect wood, place a table, make a wood pickaxe"
    hint: str = ""
    # times a plan whose rl sub-actions name goals the task cannot check goes back to the slow agent
    repair_rounds: int = 1
    rl_reward: float = 1.0  # reward for completing the active rl sub-action (its goal), added to the env's reward
    tune_steps: bool = True  # tune each macro's step budget from the critic's rollouts (twice the longest finished run)
    final_seeds: int = 0  # retrain the best candidate on this many more seeds after the loop

    def check(self) -> None:
        super().check()
        for name in ("max_subactions", "max_steps", "rollouts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.critic_rounds < 0:
            raise ValueError(f"critic_rounds must be >= 0, got {self.critic_rounds}")
        if self.repair_rounds < 0:
            raise ValueError(f"repair_rounds must be >= 0, got {self.repair_rounds}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")


# -- prompt pieces -----------------------------------------------------------------------

SLOW_SYSTEM = """You are the planner of an agent that combines coded skills with reinforcement
learning. You split a task into short sub-actions in order. A sub-action whose steps are
easy to write as a rule (walk to a visible thing, use it, craft an item) is "code"; one
that needs trial and error is "rl". Reply with a ```json list only."""

SLOW_TASK = """Task: {goal}
{hint}
Actions: {actions}

Reply with a JSON list of at most {max_subactions} items in order, each
{{"name": "<snake_case>", "how": "code" or "rl", "what": "<one sentence>"{done}}}.{goals}"""

#: the "done" field of an item, on tasks with goals the game can check
DONE_FIELD = ', "done": "<the goal that shows it finished>"'
GOALS = """
For an "rl" sub-action, "done" must be one of the goals the game checks: {goals}."""

REPAIR = """The plan has errors:
{errors}
Reply with the corrected JSON list."""

FAST_SYSTEM = """You write small Python skills (code-as-policy) for a game agent. Reply with one
```python code block."""

#: the fast agent's request (``code.interface=fields``): the task's fields at a batch of one, the binding of each
#: (:func:`core.prompting.field_bindings`) listed once, and a skeleton of the two functions. The bindings are not
#: inside the skeleton: a skill reads a few of the task's fields, and the embedded model copies a skeleton whole
#: (on Crafter, with its 45 bindings inside the skeleton, 6 of 6 replies were cut off before `done`; listed apart,
#: 5 of 6 were complete skills that read only real fields, the sixth cut off before `done`).
FAST_TASK = """The fields of `state` (float32 tensors with a batch dimension of 1; the shape each one has):
{fields}

Each field as the code reads it:
{bindings}

Actions: {actions}

Write the skill "{name}": {what}

Complete this skeleton:

```python
import torch

def act(state):
    # ... read the fields this skill needs as above ({first} = state.{first}) and choose this step's action ...
    return ...  # one primitive action index (an int)

def done(state):
    # ... read the fields it needs the same way ...
    return ...  # True once the skill has finished
```
`act` is called once per step until `done` is true or {max_steps} steps have passed.
The state has no fields but those listed: reading any other is refused before the code runs.
You may import only: {imports}.
Reply with both functions in one ```python block and nothing after it."""

#: the earlier request (``code.interface=dict``), kept for comparison: dict reads and an example of another skill
FAST_TASK_DICT = """Environment fields (`state` is a dict of these names to torch tensors with a
batch dimension of 1, e.g. state["wood"] has shape [1]):
{schema}

Actions: {actions}

Write the skill "{name}": {what}

```python
import torch

def act(state):
    # returns one primitive action index (an int) for this step
    ...

def done(state):
    # returns True once the skill has finished
    ...
```
`act` is called once per step until `done` is true or {max_steps} steps have passed.
You may import only: {imports}. Example for a different skill (walk right until x >= 10):
```python
def act(state):
    return 2

def done(state):
    return bool(state["position"][0, 0] >= 10)
```"""

CRITIC = """We ran the skill "{name}" in the game {runs} times. It failed:
{failures}
`state` has only these fields: {fields}. Revise the code so that it reaches `done`
reliably. Reply with both functions in one ```python block."""

FEEDBACK = """With the skills {skills} added to the agent's actions, training reached
{fitness_name} {fitness:.3g}. The agent called them: {calls}."""


# -- pure pieces ---------------------------------------------------------------------------


@dataclass
class SubAction:
    name: str
    how: str  # "code" or "rl"
    what: str
    done: str = ""  # the goal that shows it finished, as the slow agent named it


def parse_plan(reply: str, max_items: int) -> list[SubAction]:
    """Sub-actions from the slow agent's JSON (fenced or bare); lines ``name: code|rl: what`` too."""
    text = reply or ""
    match = re.search(r"\[.*\]", text, re.DOTALL)
    items: list[Any] = []
    if match:
        chunk = re.sub(r",\s*([\]}])", r"\1", match.group(0))
        try:
            items = json.loads(chunk)
        except json.JSONDecodeError:
            items = []
    out: list[SubAction] = []
    for item in items if isinstance(items, list) else []:
        if isinstance(item, dict) and item.get("name"):
            how = "code" if str(item.get("how", "")).strip().lower().startswith("code") else "rl"
            out.append(
                SubAction(
                    _snake(str(item["name"])),
                    how,
                    str(item.get("what", item["name"]))[:200],
                    str(item.get("done") or "")[:60],
                )
            )
    if not out:
        for line in text.splitlines():
            m = re.match(r"\s*[-*\d.]*\s*([A-Za-z_ ]+?)\s*[:|-]\s*(code|rl)\b\s*[:|-]?\s*(.*)", line, re.IGNORECASE)
            if m:
                out.append(SubAction(_snake(m.group(1)), m.group(2).lower(), m.group(3).strip() or m.group(1)))
    seen: set[str] = set()
    unique = [s for s in out if s.name and not (s.name in seen or seen.add(s.name))]  # type: ignore[func-returns-value]
    return unique[:max_items]


def _snake(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", text.strip().lower()).strip("_")[:40]


def plan_text(subs: list[SubAction]) -> str:
    return "\n".join(f"{i + 1}. {s.name} [{s.how}]: {s.what}" for i, s in enumerate(subs))


def to_plan(subs: list[SubAction], goals: list[str]) -> tuple[Plan, list[str]]:
    """The plan training consumes, and its errors for the slow agent.

    Code sub-actions become ``"skill"`` steps, rl ones ``"rl"`` steps; a step's ``done`` is
    the task goal its ``done`` (or its name) names. On a task with goals, an rl
    sub-action whose goal the task cannot check is an error (RL would have nothing to
    learn it from).
    """
    steps, errors = [], []
    for sub in subs:
        done = match_goal(sub.done, goals) or match_goal(sub.name, goals) or ""
        if sub.how == "rl" and goals and not done:
            errors.append(
                f"rl sub-action {sub.name}: the game cannot check the goal {sub.done or sub.name!r}; "
                f'set "done" to one of: {", ".join(goals)}'
            )
        steps.append(PlanStep(sub.name, "rl" if sub.how == "rl" else "skill", sub.what, done))
    return Plan(steps, text=plan_text(subs), origin=NAME), errors


def tuned_steps(rollout: Rollout, max_steps: int) -> int:
    """A macro's step budget from its critic rollouts: twice the longest finished run, at most ``max_steps``."""
    return min(max_steps, max(2, 2 * max(rollout.steps))) if rollout.steps else max_steps


def extract_macro(
    reply: str, name: str, max_steps: int, fields: list[str] | None = None
) -> tuple[MacroAction | None, str]:
    """A macro from a fast-agent reply (``act`` and ``done`` in one source), or an error text.

    With ``fields`` (the task's :meth:`~core.envs.task.Task.field_names`) the names both
    functions read are checked first (:func:`check_macro_names`).
    """
    macro, error, _ = extract_macro_kind(reply, name, max_steps, fields)
    return macro, error


def extract_macro_kind(
    reply: str, name: str, max_steps: int, fields: list[str] | None = None
) -> tuple[MacroAction | None, str, str]:
    """:func:`extract_macro` with the failure's kind (:data:`core.codegen.KINDS`; ``names``
    when a function reads a field the task lacks or a name never assigned)."""
    found = extract_function(reply, ACT, ["state"])
    if not found.ok:
        return None, found.error, found.kind
    source = found.source
    if f"def {DONE}(" not in source:
        other = extract_function(reply, DONE, ["state"])
        if not other.ok:
            return None, other.error, other.kind
        source = source.rstrip() + "\n\n" + other.source
    meta: dict[str, Any] = {"skill": name}
    if fields is not None:
        names = check_macro_names(source, fields)
        source = names.source
        if names.fixes:
            meta["fixes"] = list(names.fixes)
        if not names.ok:
            return None, names.message(fields), "names"
    program = Program(source=source, entry=ACT, origin=NAME, reply=reply, meta=meta)
    return MacroAction(name=name, program=program, max_steps=max_steps, done_entry=DONE), "", ""


def check_macro_names(source: str, fields: list[str]) -> Any:
    """:func:`core.namecheck.check_names` over both functions of a macro: the state each
    of ``act`` and ``done`` takes (whatever it calls it) may hold only ``fields``."""
    states = tuple(dict.fromkeys(state_arguments(source, ACT, ["state"]) + state_arguments(source, DONE, ["state"])))
    return check_names(source, fields, available=SAFE_BUILTIN_NAMES, state_args=states)


def batch_of_one(text: str) -> str:
    """A prompt text's shapes at a batch of one (``[B]`` -> ``[1]``, ``[B, 2]`` -> ``[1, 2]``): a macro sees one env."""
    return re.sub(r"\[B(?=[,\]])", "[1", text)


@dataclass
class Rollout:
    """How one macro fared in the critic's rollouts."""

    name: str
    runs: int = 0
    finished: int = 0
    failures: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)  # primitive steps each finished run took

    @property
    def ok(self) -> bool:
        return self.runs > 0 and self.finished == self.runs


def rollout_macros(
    macros: list[MacroAction], task: Any, *, runs: int, seed: int, limits: Any, imports: tuple[str, ...]
) -> list[Rollout]:
    """Run the macros in order, each from where the previous one stopped, ``runs`` times.

    Programs go through the sandbox (check, isolated probe, compile) via
    :class:`core.train.macros.MacroSet`; a macro that fails to prepare fails every run.
    """
    stats = [Rollout(m.name) for m in macros]
    prepared: list[Any] = []
    for m, st in zip(macros, stats):
        try:
            prepared.append(MacroSet.prepare([m], task, limits=limits, allowed_imports=imports))
        except (SandboxError, ValueError) as e:
            prepared.append(None)
            st.runs, st.failures = (
                runs,
                [f"the code does not run: {getattr(e, 'report', None).message if hasattr(e, 'report') else e}"],  # type: ignore[union-attr]
            )
    env = task.make_env(1, seed, None)
    n = int(env.single_action_space.n)
    try:
        for r in range(runs):
            obs, _ = env.reset(seed=seed + r)
            for macro, st, mset in zip(macros, stats, prepared):
                if mset is None:
                    continue
                st.runs += 1
                obs, outcome = _run_one(env, mset, obs[0], n, macro.max_steps)
                if outcome.startswith("done"):
                    st.finished += 1
                    st.steps.append(int(outcome.split()[-1]))
                elif outcome not in st.failures:
                    st.failures.append(outcome)
    finally:
        env.close()
    return stats


def _run_one(env: Any, mset: Any, obs: np.ndarray, n: int, max_steps: int) -> tuple[np.ndarray, str]:
    batch = np.asarray(obs)[None]
    for step in range(max_steps):
        try:
            action = mset.action(0, batch[0], n)
        except SandboxError as e:
            return batch, f"error at step {step}: {e.report.message}"
        batch, _, term, trunc, _ = env.step(np.array([action]))
        if term[0] or trunc[0]:
            return batch, f"the episode ended after {step + 1} steps (the agent died or time ran out)"
        try:
            if mset.finished(0, batch[0]):
                return batch, f"done {step + 1}"
        except SandboxError as e:
            return batch, f"error in done() at step {step}: {e.report.message}"
    return batch, f"`done` was still false after {max_steps} steps"


# -- hooks -----------------------------------------------------------------------------------


def _actions(task: Any) -> str:
    return task.action_description or "the env's discrete actions, 0..n-1"


class Plugin:
    """One RL-GPT run: the slow agent's plan, the fast agent's macros and the critic's record."""

    def __init__(self, config: Config) -> None:
        self.cfg = config
        self.subactions: list[SubAction] = []  # the latest usable plan
        self.feedback = ""  # how the last round's training went, for the next plan
        self.rollouts: dict[str, Rollout] = {}  # the critic's latest rollouts per skill
        self.macros: list[MacroAction] = []  # the latest round's accepted macros
        self.shapes: Shapes | None = None  # each field's shape, read off a real batch once per run

    def _chat(self, run: Any, msgs: list[dict[str, str]], seed: int, tag: str, code: bool = False) -> str:
        """One reply at the configured temperature (the method's); a request for code also
        ends at its code block (:func:`core.prompting.code_options`)."""
        options = code_options(run, 1, self.cfg.temperature) if code else {"temperature": self.cfg.temperature}
        (reply,) = run.llm.chat(msgs, n=1, max_tokens=self.cfg.max_tokens, seed=seed, tag=tag, **options)
        return reply.text

    def fast_prompt(self, run: Any, sub: SubAction) -> str:
        """The fast agent's request for one skill, in the run's ``code.interface``."""
        cfg, task, imports = self.cfg, run.task, ", ".join(run.sandbox.imports)
        if interface_of(run) == "dict":
            return FAST_TASK_DICT.format(
                schema=task.schema_text(),
                actions=_actions(task),
                name=sub.name,
                what=sub.what,
                max_steps=cfg.max_steps,
                imports=imports,
            )
        self.shapes = self.shapes or batch_shapes(task, run.seed)
        return FAST_TASK.format(
            fields=batch_of_one(fields_text(task, self.shapes)),
            actions=_actions(task),
            name=sub.name,
            what=sub.what,
            bindings=batch_of_one(field_bindings(task, self.shapes, source="state")),
            first=task.field_names()[0],
            max_steps=cfg.max_steps,
            imports=imports,
        )

    @hookimpl
    def plan(self, run, iteration: int) -> Plan | None:
        cfg = self.cfg
        hint = f"Suggested decomposition: {cfg.hint}" if cfg.hint else ""
        goals = goal_names(run.task)
        user = SLOW_TASK.format(
            goal=run.task.goal,
            hint=hint,
            actions=_actions(run.task),
            max_subactions=cfg.max_subactions,
            done=DONE_FIELD if goals else "",
            goals=GOALS.format(goals=", ".join(goals)) if goals else "",
        )
        if self.feedback:
            user += (
                "\n\nLast round:\n"
                + self.feedback
                + "\nRevise the plan (you may move sub-actions between code and rl)."
            )
        msgs = [{"role": "system", "content": SLOW_SYSTEM}, {"role": "user", "content": user}]
        subs: list[SubAction] = []
        for rnd in range(1 + cfg.repair_rounds):
            tag = f"{NAME}-slow-it{iteration}" + (f"-r{rnd}" if rnd else "")
            reply = self._chat(run, msgs, run.seed * 1000 + iteration + 100 * rnd, tag)
            subs = parse_plan(reply, cfg.max_subactions)
            plan, errors = to_plan(subs, goals)
            if subs and not errors:
                break
            errors = errors or ["no sub-actions found: reply with a JSON list of the items described above"]
            run.log_text(f"{NAME}/it{iteration}-plan-errors-r{rnd}.md", "\n".join(errors))
            msgs = msgs + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": REPAIR.format(errors="\n".join(f"- {e}" for e in errors))},
            ]
        if not subs and self.subactions:
            subs = self.subactions  # keep the last usable plan
        # rl sub-actions the game still cannot check stay in the plan as text, unfollowed (done "")
        self.subactions = subs
        plan, _ = to_plan(subs, goals)
        return plan if subs else None

    @hookimpl
    def propose_actions(self, run, iteration: int) -> list[list[MacroAction]] | None:
        cfg = self.cfg
        limits, imports = run.sandbox.limits(), run.sandbox.imports
        macros: list[MacroAction] = []
        rejected: list[
            MacroAction
        ] = []  # skills with no runnable code after the critic's rounds: recorded, not trained
        fields = (
            run.task.field_names() if interface_of(run) == "fields" else None
        )  # None: the earlier interface, unchecked
        listed = ", ".join(fields if fields is not None else [f.name for f in run.task.state_fields])
        for k, sub in enumerate(s for s in self.subactions if s.how == "code"):
            msgs = [{"role": "system", "content": FAST_SYSTEM}, {"role": "user", "content": self.fast_prompt(run, sub)}]
            best: MacroAction | None = None
            kind = ""
            for rnd in range(1 + cfg.critic_rounds):
                reply = self._chat(
                    run,
                    msgs,
                    run.seed * 100_000 + iteration * 1000 + k * 10 + rnd,
                    f"{NAME}-fast-{sub.name}-r{rnd}",
                    code=True,
                )
                macro, error, kind = extract_macro_kind(reply, sub.name, cfg.max_steps, fields)
                if macro is not None:
                    # the critic rolls the new macro out after the ones already accepted
                    (st,) = rollout_macros(
                        macros + [macro], run.task, runs=cfg.rollouts, seed=run.seed, limits=limits, imports=imports
                    )[-1:]
                    self.rollouts[sub.name] = st
                    runnable = not any(f.startswith(("the code does not run", "error")) for f in st.failures)
                    if runnable:
                        best = macro
                        if cfg.tune_steps:
                            best.max_steps = tuned_steps(st, cfg.max_steps)
                    if st.ok:
                        break
                    error = CRITIC.format(
                        name=sub.name,
                        runs=st.runs,
                        failures="\n".join(f"- {f}" for f in st.failures[:4]),
                        fields=listed,
                    )
                msgs = msgs + [
                    {"role": "assistant", "content": reply},
                    {
                        "role": "user",
                        "content": error
                        if macro is not None
                        else f"{error}\nReply with `act` and `done` in one ```python block.",
                    },
                ]
            if best is not None:
                macros.append(best)
            else:
                program = Program(
                    source=macro.program.source if macro is not None else extract_code(reply),
                    entry=ACT,
                    origin=NAME,
                    reply=reply,
                    rejected=error,
                    meta={
                        "skill": sub.name,
                        "rounds": rnd + 1,
                        "rejected_kind": "critic" if macro is not None else "names" if kind == "names" else "extract",
                    },
                )
                rejected.append(MacroAction(name=sub.name, program=program, max_steps=cfg.max_steps, done_entry=DONE))
        self.macros = macros
        report = {
            name: {"runs": r.runs, "finished": r.finished, "failures": r.failures, "steps": r.steps}
            for name, r in self.rollouts.items()
        }
        report["max_steps"] = {m.name: m.max_steps for m in macros}  # the tuned step budgets
        run.log_text(f"{NAME}/it{iteration}-critic.json", json.dumps(report, indent=2))
        run.log_metrics({f"{NAME}/macros": len(macros)}, step=iteration)
        # each rejected skill alone: the loop records it as a candidate that did not train
        return ([macros] if macros else []) + [[m] for m in rejected] or None

    # -- training: the plan's rl sub-actions as RL-trained skills --------------------------

    def _follower(self, train) -> PlanFollower | None:
        plan = train.plan
        if plan is None or plan.origin != NAME:
            return None
        got = train.state.get(NAME)
        if got is None:
            got = train.state[NAME] = {"follower": PlanFollower(plan, train.task, kinds=["rl"]), "completed": 0}
        return got["follower"] if len(got["follower"]) else None

    @hookimpl
    def represent_state(self, train, obs) -> Any:
        follower = self._follower(train)
        return None if follower is None else follower.one_hot(obs[..., : train.task.obs_dim])

    @hookimpl
    def compute_reward(self, train, batch) -> Any:
        follower = self._follower(train)
        if follower is None:
            return None
        done = follower.completed(batch.obs, batch.next_obs)
        train.state[NAME]["completed"] += int(done.sum())
        return done.float() * self.cfg.rl_reward

    @hookimpl
    def on_train_end(self, train, result: TrainResult) -> None:
        st = train.state.pop(NAME, None)
        if st is not None and len(st["follower"]):
            result.metrics[f"{NAME}/rl_completed"] = float(st["completed"])

    @hookimpl
    def reflect(self, run, result: IterationResult) -> str | None:
        mine = [
            (c, r)
            for c, r in zip(result.candidates, result.results)
            if c.macros and any(m.program.origin == NAME for m in c.macros)
        ]
        if not mine:
            return None
        c, r = max(mine, key=lambda cr: cr[1].score)
        if r.ok and r.fitness is not None:
            calls = ", ".join(f"{m.name} {int(r.metrics.get(f'macros/{m.name}_calls', 0))} times" for m in c.macros)
            self.feedback = FEEDBACK.format(
                skills=", ".join(m.name for m in c.macros), fitness_name=r.fitness.name, fitness=r.score, calls=calls
            )
        else:
            self.feedback = f"Training with the skills failed ({r.error_kind}): {r.error.strip()[-400:]}"
        rollouts = "\n".join(f"- {n}: finished {s.finished}/{s.runs} critic rollouts" for n, s in self.rollouts.items())
        return self.feedback + ("\n\nCritic rollouts:\n" + rollouts if rollouts else "")

    @hookimpl
    def on_run_end(self, run, best: tuple[Candidate, TrainResult] | None) -> None:
        for m in self.macros:
            run.log_text(f"{NAME}/macros/{m.name}.py", m.program.source)
