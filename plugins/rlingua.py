"""rlingua: an LLM-written controller acts as SAC's behaviour policy early on, then is annealed away.

Method (Zhang et al., 2024, "RLingua: Improving Reinforcement Learning Sample Efficiency
in Robotic Manipulations With Large Language Models"):

1. The LLM gets the manipulation task in words (the environment, the state fields, the
   action space, the goal) and writes a rule-based controller as code: here
   ``act(state) -> action [B, A]``, batched over the envs, values within the action bounds.
   The prompt lists the task's fields (derived ones included) with their shapes and
   meanings and a skeleton that reads each as ``state.<name>``
   (:func:`core.prompting.field_bindings`); ``code.interface=dict`` keeps the earlier
   prompt (a dict signature over ``Task.schema_text``), for comparison.
2. The names the controller reads are checked before anything runs
   (:mod:`core.namecheck`; ``fields`` interface): a field the task lacks, or a name never
   assigned, is refused with the valid fields; a unique close field is renamed. The
   controller then runs in the sandbox (a worker process, like reward programs): it is
   checked, loaded and probed on real states of the task before training; a program that
   fails (no function, an unknown name, an exception, the wrong shape) goes back to the
   LLM with the error, up to ``attempts`` times. A controller that still fails leaves
   plain SAC, and says why in ``rlingua/controller.md``.
3. During training the controller is a behaviour policy through the ``action_prior``
   hook: with probability ``p = p0 * max(0, 1 - progress / anneal)`` a step's action is
   the controller's (plus Gaussian noise ``std``) instead of the actor's; its transitions
   fill SAC's replay buffer like any other, so the critic learns from the controller's
   successes early.
4. An imitation term pulls the actor towards the controller's actions on the replayed
   transitions the controller took (weight ``imitation``, annealed with ``p``): RLingua's
   actor loss with the prior's demonstrations.

Needs an off-policy trainer: ``trainer=sac`` (PPO is refused at the start). Config:
``conf/plugins/rlingua.yaml`` (schema: :class:`Config`). Each training's controller lives
in ``train.state["rlingua"]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from core.plugin import (
    SAFE_BUILTIN_NAMES,
    ActionPrior,
    IterationResult,
    PluginConfig,
    RunContext,
    SandboxError,
    Shapes,
    StateProgram,
    Task,
    TrainContext,
    TrainResult,
    UserError,
    batch_shapes,
    check_names,
    code_options,
    extract_function,
    field_bindings,
    fields_text,
    hookimpl,
    interface_of,
    prepare_state,
    state_arguments,
)

NAME = "rlingua"
ENTRY = "act"


@dataclass
class Config(PluginConfig):
    """``plugins.rlingua``: the controller's prompt, and how long and how strongly it acts."""

    p0: float = 0.5  # probability that the controller acts at the start of training
    anneal: float = 0.5  # share of the training budget over which the probability falls linearly to 0
    std: float = 0.1  # Gaussian noise on the controller's action (action units)
    imitation: float = 1.0  # weight of the imitation step towards the controller's actions (annealed like p0; 0: off)
    attempts: int = 3  # tries to write a controller that passes the sandbox probe (each gets the last error)
    temperature: float = 0.7  # sampling temperature of the controller code
    max_tokens: int = 1024  # cap on each reply

    def check(self) -> None:
        super().check()
        if not 0.0 <= self.p0 <= 1.0:
            raise ValueError(f"p0 must be in [0, 1], got {self.p0}")
        if not 0.0 < self.anneal <= 1.0:
            raise ValueError(f"anneal must be in (0, 1], got {self.anneal}")
        if self.std < 0 or self.imitation < 0:
            raise ValueError("std and imitation must be >= 0")
        if self.attempts < 1 or self.max_tokens < 1:
            raise ValueError("attempts and max_tokens must be >= 1")


# -- prompt pieces -----------------------------------------------------------------------

SYSTEM = """You are a robotics engineer. You write simple, robust feedback controllers in Python
(proportional rules on the state) that solve manipulation tasks. Reply with one ```python
code block holding the controller function (helpers may sit in the same block)."""

#: the request with ``code.interface=fields``: the task's fields and a skeleton that binds each of them
TASK = """The environment:

{description}

The fields of a state (float32 tensors batched over B environments; the shape each one has):
{fields}

The action: {actions}

Task goal: {goal}

Write the controller by completing this skeleton; it reads each field as `state.<name>`:

```python
import torch

def act(state):
{bindings}
    # ... compute each environment's action from these (proportional rules on the state) ...
    action = ...  # float tensor [B, {act_dim}]
    return action  # clamped to the action's bounds
```

The state has no fields but those in the skeleton: reading any other is refused before the code runs
(delete the bindings you do not use). Use only {imports}; work on the whole batch with tensor operations
(no loop over B), give torch functions tensors, not Python numbers, and clamp the result to the
action's bounds.
Reply with the complete function in one ```python block and nothing after it."""

#: the earlier request (``code.interface=dict``), kept for comparison
TASK_DICT = """The environment:

{description}

The state fields:
{schema}

The action: {actions}

Task goal: {goal}

Write the controller with exactly this signature:

```python
import torch

def act(state):
    # state: dict of field name -> torch.Tensor, batched over B environments
    #        (a scalar field is [B], a vector field [B, size])
    # returns a float tensor [B, {act_dim}]: the action of each environment, within the action's bounds
    ...
```

Read only the state fields listed above, by those exact names. Use only {imports}; work
on the whole batch with tensor operations (no loop over B), and clamp the result to the
action's bounds."""

RETRY = """The controller above failed the check before training:

{error}

Write the corrected controller (the whole function)."""


def action_dim(task: Task) -> int | None:
    """The action size from a ``Box(A,)`` action description, or None."""
    found = re.match(r"\s*Box\((\d+)\s*,?\s*\)", task.action_description or "")
    return int(found.group(1)) if found else None


def build_messages(
    task: Task, imports: tuple[str, ...], act_dim: int | None, shapes: Shapes | None = None, interface: str = "fields"
) -> list[dict[str, str]]:
    """System + the controller request, in the run's ``code.interface`` (``fields``: the
    task's fields with the shapes of a real batch, :func:`core.prompting.batch_shapes`,
    made when ``shapes`` is None, and a skeleton binding each; ``dict``: the earlier prompt)."""
    if interface == "dict":
        text = TASK_DICT.format(
            description=task.description,
            schema=task.schema_text(),
            actions=task.action_description,
            goal=task.goal,
            act_dim=act_dim or "A",
            imports=", ".join(imports),
        )
    else:
        shapes = shapes or batch_shapes(task)
        text = TASK.format(
            description=task.description,
            fields=fields_text(task, shapes),
            actions=task.action_description,
            goal=task.goal,
            bindings=field_bindings(task, shapes, source="state"),
            act_dim=act_dim or "A",
            imports=", ".join(imports),
        )
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]


def check_controller_names(source: str, fields: list[str]) -> Any:
    """:func:`core.namecheck.check_names` on a controller: its ``state`` (whatever ``act`` calls
    it) may hold only ``fields``."""
    return check_names(
        source, fields, available=SAFE_BUILTIN_NAMES, state_args=state_arguments(source, ENTRY, ["state"])
    )


class Controller:
    """One training's controller: written and probed at the start, called per step, annealed."""

    def __init__(self, train: TrainContext, cfg: Config) -> None:
        self.train, self.cfg = train, cfg
        self.fn: Any = None  # the probed program (a core.sandbox.StateFunction), or None
        self.source = ""
        self.errors: list[str] = []
        self.fixes: list[str] = []  # the name check's fixes to the controller that passed
        self.calls = 0
        self.act_dim = action_dim(train.task)

    def write(self) -> None:
        """Ask the LLM for a controller until one passes the sandbox probe (``attempts`` tries)."""
        train, cfg = self.train, self.cfg
        interface = interface_of(train)
        shapes = batch_shapes(train.task, train.seed) if interface == "fields" else None
        fields = train.task.field_names() if interface == "fields" else None  # None: the earlier interface, unchecked
        messages = build_messages(train.task, train.sandbox.imports, self.act_dim, shapes, interface)
        options = code_options(train, 1, cfg.temperature)
        for attempt in range(cfg.attempts):
            reply = train.llm.chat(
                messages,
                n=1,
                max_tokens=cfg.max_tokens,
                seed=train.seed * 1000 + attempt,
                tag=f"{NAME}/controller",
                **options,
            )[0].text
            found = extract_function(reply, ENTRY, ["state"], rename=True)
            error = found.error if not found.ok else ""
            fixes: list[str] = []
            if found.ok and fields is not None:  # the names it reads, before anything runs
                names = check_controller_names(found.source, fields)
                found.source, fixes = names.source, list(names.fixes)
                if not names.ok:
                    error = names.message(fields)
            if found.ok and not error:
                program = StateProgram(
                    source=found.source, entry=ENTRY, origin=NAME, meta={"fixes": fixes} if fixes else {}
                )
                try:
                    fn = prepare_state(
                        program, train.task, limits=train.sandbox.limits(), allowed_imports=train.sandbox.imports
                    )
                except SandboxError as exc:
                    error = exc.report.message
                else:
                    if self.act_dim is not None and fn.extra_dim != self.act_dim:
                        error = f"act returned {fn.extra_dim} values per state; the action has {self.act_dim}."
                        fn.close()
                    else:
                        self.fn, self.source, self.fixes = fn, found.source, fixes
                        return
            self.errors.append(f"attempt {attempt + 1}: {error}")
            messages = messages + [
                {"role": "assistant", "content": reply},
                {"role": "user", "content": RETRY.format(error=error[:1500])},
            ]

    def probability(self) -> float:
        return self.cfg.p0 * max(0.0, 1.0 - self.train.progress / self.cfg.anneal)

    def prior(self, obs: torch.Tensor) -> ActionPrior | None:
        """The controller's actions with the annealed probability; None once annealed away or failed."""
        p = self.probability()
        if self.fn is None or p <= 0.0:
            return None
        try:
            mean = self.fn.from_obs(obs)
        except SandboxError as exc:  # a controller that breaks mid-training stops acting
            self.errors.append(f"during training (frames {self.train.frames}): {exc.report.message}")
            self.fn = None
            return None
        self.calls += 1
        weight = self.cfg.imitation * p / self.cfg.p0 if self.cfg.p0 > 0 else 0.0
        return ActionPrior(mean=mean, std=self.cfg.std, prob=p, imitation=weight)  # the trainer clips to the bounds

    def report(self) -> str:
        lines = [f"# RLingua controller ({'used' if self.source else 'none passed the check'})", ""]
        if self.source:
            lines += ["```python", self.source.strip(), "```", ""]
        if self.fixes:
            lines += ["## Name fixes before it ran", "", *[f"- {f}" for f in self.fixes], ""]
        if self.errors:
            lines += ["## Errors", "", *[f"- {e}" for e in self.errors]]
        return "\n".join(lines) + "\n"

    def metrics(self) -> dict[str, float]:
        return {
            f"{NAME}/controller_ok": float(bool(self.source)),
            f"{NAME}/failed_attempts": float(len(self.errors)),
            f"{NAME}/calls": float(self.calls),
        }


class Plugin:
    """RLingua's behaviour prior. Each training's :class:`Controller` lives in ``train.state[NAME]``;
    the object holds only the config."""

    def __init__(self, config: Config) -> None:
        self.cfg = config

    @hookimpl
    def on_run_start(self, run: RunContext) -> None:
        """Refuse an on-policy trainer: the controller's transitions need a replay buffer."""
        from omegaconf import OmegaConf

        trainer = str(OmegaConf.select(run.config, "trainer.name", default="ppo"))
        if trainer != "sac":
            raise UserError(
                f"rlingua fills an off-policy replay buffer with the controller's transitions; "
                f"trainer={trainer} is on-policy. Add trainer=sac (e.g. python -m core "
                f"+plugins=[rlingua] env=kuka_grasp trainer=sac)."
            )

    @hookimpl
    def on_train_start(self, train: TrainContext) -> None:
        """Have the LLM write the controller and probe it in the sandbox."""
        controller = train.state[NAME] = Controller(train, self.cfg)
        controller.write()

    @hookimpl
    def action_prior(self, train: TrainContext, obs: torch.Tensor) -> ActionPrior | None:
        controller = train.state.get(NAME)
        return controller.prior(obs) if controller is not None else None

    @hookimpl
    def on_train_end(self, train: TrainContext, result: TrainResult) -> None:
        """The controller's code and errors as a text, its counters on the result."""
        controller = train.state.pop(NAME, None)
        if controller is None:
            return
        result.metrics.update(controller.metrics())
        train.log_text(f"{NAME}/controller.md", controller.report())
        if controller.fn is not None:
            controller.fn.close()

    @hookimpl
    def reflect(self, run: RunContext, result: IterationResult) -> str | None:
        """Feedback: whether the controller passed and acted, and the fitness it led to."""
        lines = []
        for candidate, res in zip(result.candidates, result.results):
            ok = res.metrics.get(f"{NAME}/controller_ok")
            if ok is None:
                continue
            share = res.metrics.get("action_prior/share", 0.0)
            score = f"{res.fitness.name} {res.fitness.value:.3f}" if res.fitness is not None else "no fitness"
            lines.append(
                f"- {candidate.id}: controller {'passed' if ok else 'failed'}, acted on {share:.1%} of "
                f"the steps, {score}" + ("" if res.ok else f"; training failed: {res.error[:300]}")
            )
        return "\n".join(lines) or None
