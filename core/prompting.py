"""Prompt text every code-writing method needs: how the core will call the code.

These describe the calling convention of ``core.sandbox`` (argument names, batching,
return values, allowed imports); methods add their own framing around them.

Everything here is built from the task's own definition, never from an example of
another task: the signature and a skeleton that binds each of the task's fields
(:attr:`core.envs.task.Task.program_fields`, derived fields included) with its shape and
meaning (:func:`field_bindings`), and the sign a per-step reward needs from the task's
semantics (:func:`sign_rule`). A program reads fields as ``next_state.name`` /
``state.name``; :mod:`core.namecheck` refuses any other name before the code runs.
:func:`repair_messages` is the short request that asks for a fix; :data:`CODE_STOP`
ends a reply at its code block, and :func:`sampling_temperature` is the default
temperature for a number of samples. ``interface="dict"`` keeps the earlier prompt
(dict reads and a worked example of a made-up task), for comparison only. The shapes
the prompt states are read off a real batch of the task (:func:`batch_shapes`): the
task's env stepped through the same TorchRL env training collects from, and its
observation split into the state fields as training splits it, so that a prompt never
says ``[B, ...]`` where the code will get ``[B]``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from core.envs.task import Task

#: the prompt styles :func:`reward_interface` and :func:`state_interface` can write (``code.interface``)
INTERFACES = ("fields", "dict")
#: ends a reply at the close of its first code block: the explanation after it is never used
CODE_STOP = ["\n```\n"]


@dataclass(frozen=True)
class Shapes:
    """What code written for a task receives, read off a real batch (``B``: the batch).

    ``action`` and each of ``fields`` are the dims after the batch dim (``()`` for one
    number per env); ``actions`` is the number of discrete actions (0: continuous, then
    ``low``/``high`` are the bounds).
    """

    action: tuple[int, ...]
    action_dtype: str  # "int64", "float32"
    fields: dict[str, tuple[int, ...]]
    actions: int = 0
    low: tuple[float, ...] = ()
    high: tuple[float, ...] = ()

    @staticmethod
    def text(dims: tuple[int, ...]) -> str:
        """``[B]``, ``[B, 3]``: a shape as the prompt writes it."""
        return "[" + ", ".join(["B", *map(str, dims)]) + "]"


def batch_shapes(task: Task, seed: int = 0) -> Shapes:
    """The shapes of ``action`` and of every state field, from one real step of the task.

    The task's vector env (2 copies) is wrapped in :class:`core.train.envs.VecGymEnv`, the
    env the trainers collect from, and stepped once with a random action; the action is
    read from that step's batch and the state fields from ``task.split_state`` of its
    observation, as :class:`core.train.transforms.ProgramReward` splits it. Costs one env
    construction (seconds for MuJoCo-based tasks): compute it once per run.
    """
    import gymnasium as gym

    from core.train.envs import VecGymEnv

    vec = task.make_env(2, seed)
    space = vec.single_action_space
    env = VecGymEnv(vec, seed)
    try:
        td = env.rand_step(env.reset())
    finally:
        env.close(raise_if_closed=False)
    action = td.get("action")
    states = task.split_state(td.get(("next", "observation"))[..., : task.obs_dim])
    box = isinstance(space, gym.spaces.Box)
    return Shapes(
        action=tuple(action.shape[1:]),
        action_dtype=str(action.dtype).removeprefix("torch."),
        fields={name: tuple(value.shape[1:]) for name, value in states.items()},
        actions=0 if box else int(getattr(space, "n", 0)),
        low=tuple(float(x) for x in space.low.reshape(-1)) if isinstance(space, gym.spaces.Box) else (),
        high=tuple(float(x) for x in space.high.reshape(-1)) if isinstance(space, gym.spaces.Box) else (),
    )


def action_text(task: Task, shapes: Shapes | None = None) -> str:
    """What the ``action`` argument holds: dtype, shape and meaning, as training passes it."""
    shapes = shapes or batch_shapes(task)
    described = f" {task.action_description}" if task.action_description else ""
    shape = Shapes.text(shapes.action)
    if shapes.actions:
        return (
            f"`action` is an {shapes.action_dtype} tensor of shape {shape} (one action index per env, "
            f"0..{shapes.actions - 1}; no trailing dimension).{described}"
        )
    bounds = ""
    if shapes.low and len(set(shapes.low)) == 1 and len(set(shapes.high)) == 1:
        bounds = f" within [{shapes.low[0]:g}, {shapes.high[0]:g}]"
    return (
        f"`action` is a {shapes.action_dtype} tensor of shape {shape}: the policy's sample, which may lie "
        f"outside the bounds{bounds} (the env clips it before stepping).{described}"
    )


def fields_text(task: Task, shapes: Shapes | None = None) -> str:
    """One line per field (derived fields included) with the shape the code receives (``[B]`` or ``[B, 3]``)."""
    shapes = shapes or batch_shapes(task)
    lines = []
    for f in program_fields(task):
        unit = f", unit {f.unit}" if f.unit else ""
        lines.append(
            f"- {f.name} ({Shapes.text(shapes.fields.get(f.name, getattr(f, 'shape', ())))}{unit}): {f.description}"
        )
    return "\n".join(lines)


def program_fields(task: Any) -> list[Any]:
    """The fields LLM code may read (:attr:`Task.program_fields`; a task-like object without it: its state fields)."""
    return list(getattr(task, "program_fields", None) or task.state_fields)


def sampling_temperature(samples: int) -> float:
    """The default sampling temperature for ``samples`` replies to one prompt.

    Eureka samples 16 rewards at 1.0: diversity pays when many are drawn. With a few
    samples a small model's hotter replies are mostly broken, so the temperature falls
    with the count: 0.4 + 0.6 * min(samples, 16) / 16 (1 -> 0.44, 4 -> 0.55, 8 -> 0.7, 16+ -> 1.0).
    """
    return round(0.4 + 0.6 * min(max(int(samples), 1), 16) / 16, 3)


def code_options(run: Any, samples: int, temperature: float | None) -> dict[str, Any]:
    """The chat options every request for code shares: the temperature (by ``samples`` when
    None, :func:`sampling_temperature`) and the stop at the code block's end (``code.stop_at_code_end``)."""
    code = run.settings.run.code
    return {
        "temperature": sampling_temperature(samples) if temperature is None else float(temperature),
        "stop": list(CODE_STOP) if code.stop_at_code_end else None,
    }


def interface_of(run: Any) -> str:
    """The run's prompt style for code (``code.interface``: ``fields`` or ``dict``)."""
    return str(run.settings.run.code.interface)


def sign_rule(task: Task) -> str:
    """One line on the sign a per-step reward needs, from how the task's episodes end."""
    if task.ends_on_success and task.ends_on_failure:
        return (
            "Sign rule: both reaching the goal and failing end this task's episode, so reaching the goal must pay "
            "the most, failing the least, and no per-step term may make ending the episode early by failing pay "
            "more than carrying on towards the goal."
        )
    if task.ends_on_success:
        return (
            "Sign rule: reaching the goal ends this task's episode, so the reward per step must be negative or zero "
            "on average until the goal is reached (for example a small step cost plus progress terms), and "
            "reaching the goal must pay the most; a positive reward on every step teaches the agent never to finish."
        )
    if task.ends_on_failure:
        return (
            "Sign rule: in this task a long episode is the success (failing ends it early), so the reward per step "
            "must be positive on average while the agent has not failed; a negative reward on every step teaches "
            "the agent to fail as early as it can."
        )
    return (
        "Sign rule: this task's episodes always run to their time limit, so only differences between states matter: "
        "pay more for states closer to the goal (a constant added to every step changes nothing)."
    )


def field_bindings(
    task: Task,
    shapes: Shapes | None = None,
    source: str = "next_state",
    indent: str = "    ",
    names: list[str] | None = None,
) -> str:
    """One line per field (or per field in ``names``) that binds it from ``source``, with its shape as a comment.

    The meanings go in :func:`fields_text` above the skeleton: a model copies the skeleton
    into its reply, and long comments there would be paid for again in every sample.
    """
    shapes = shapes or batch_shapes(task)
    fields = program_fields(task)
    if names is not None:
        fields = [f for f in fields if f.name in names]
    rows = [
        (f"{indent}{f.name} = {source}.{f.name}", f"# {Shapes.text(shapes.fields.get(f.name, f.shape))}")
        for f in fields
    ]
    width = max((len(code) for code, _ in rows), default=0)
    return "\n".join(f"{code.ljust(width)}  {comment}" for code, comment in rows)


#: above this many fields a skeleton binds none of them: the embedded model copies a skeleton
#: whole, and on Crafter (45 fields) that copy was about three quarters of each reply
#: (docs/scaling/first_run.json) and cut replies off at their token cap
SKELETON_MAX_FIELDS = 20


def goal_fields(task: Task) -> list[str]:
    """The fields the task's goal names in backticks, in the goal's order (Crafter: ``health``,
    ``achievements_unlocked``; Humanoid: ``root_vx``, ``root_z``, ``torso_upright``)."""
    names = {f.name for f in program_fields(task)}
    return list(dict.fromkeys(n for n in re.findall(r"`(\w+)`", task.goal) if n in names))


def skeleton_bindings(task: Task, shapes: Shapes | None = None, source: str = "next_state") -> str:
    """The bindings a code skeleton shows: every field (:func:`field_bindings`) on a task with at
    most :data:`SKELETON_MAX_FIELDS`; above that, the fields the goal names (:func:`goal_fields`)
    and one comment showing the pattern for the others.

    A 1.5B model copies a skeleton whole and, shown no binding, binds the listing's fields in
    order (39 of Crafter's 45 in ``docs/scaling/skeleton_crafter.json``, and all of them when
    the prompt asked for at most 6): what the skeleton binds is what the reply reads.
    """
    fields = program_fields(task)
    if len(fields) <= SKELETON_MAX_FIELDS:
        return field_bindings(task, shapes, source)
    named = goal_fields(task)
    if not named:
        first = fields[0].name
        return f"    # bind only the fields you use, one line each, e.g. {first} = {source}.{first}"
    pattern = f"    # bind another field only if a term needs it, the same way: name = {source}.name"
    return field_bindings(task, shapes, source, names=named) + "\n" + pattern


#: what :func:`task_description` puts in place of the field lines the interface repeats
POINTER = "  (the fields are listed below, with their shapes)"


def task_description(task: Task, interface: str = "fields") -> str:
    """The task's description for a prompt whose ``fields`` interface lists every field with its shape.

    On a task with more than :data:`SKELETON_MAX_FIELDS` fields the description's own line per
    field (``- name: text``, exactly as the field describes itself) would come twice; each run of
    such lines becomes one pointer to the listing. Crafter's prompt is about a quarter shorter, and
    a 1.5B model on 2 cores reads (prefills) ~10-40 tokens/s. Other tasks, and the ``dict``
    interface, get the description unchanged.
    """
    fields = program_fields(task)
    if interface != "fields" or len(fields) <= SKELETON_MAX_FIELDS:
        return task.description
    own = {f"- {f.name}: {f.description}" for f in fields}
    lines: list[str] = []
    for line in task.description.split("\n"):
        if line in own:
            if not lines or lines[-1] != POINTER:
                lines.append(POINTER)
            continue
        lines.append(line)
    return "\n".join(lines)


def bindings_rule(task: Task) -> str:
    """The rule on which names a program may read, as the skeleton shows them (see :func:`skeleton_bindings`)."""
    if len(program_fields(task)) <= SKELETON_MAX_FIELDS:
        return (
            "The state has no fields but those in the skeleton: reading any other is refused before the code runs.\n"
            "  Delete the bindings you do not use."
        )
    return (
        "The state has no fields but those listed above: reading any other is refused before the code runs.\n"
        "  Bind only the fields you use."
    )


def state_bindings_rule(task: Task) -> str:
    """:func:`bindings_rule` as the state-representation prompt words it (one sentence)."""
    if len(program_fields(task)) <= SKELETON_MAX_FIELDS:
        return (
            "The state has no fields but those in the skeleton: reading any other is refused before the code runs\n"
            "(delete the bindings you do not use)."
        )
    return (
        "The state has no fields but those listed above: reading any other is refused before the code runs\n"
        "(bind only the fields you use)."
    )


def reward_interface(
    task: Task,
    allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch"),
    shapes: Shapes | None = None,
    interface: str = "fields",
    entry: str = "compute_reward",
) -> str:
    """The reward function's signature, inputs and outputs, for prompts.

    :param shapes: the task's :func:`batch_shapes` (computed here when not given).
    :param interface: ``fields`` (the skeleton built from the task) or ``dict`` (the earlier prompt).
    :param entry: the function's name (Text2Reward asks for ``compute_dense_reward``).
    """
    shapes = shapes or batch_shapes(task)
    if interface == "dict":
        return _dict_reward_interface(task, allowed_imports, shapes, entry)
    return f"""The fields of a state (float32 tensors batched over B environments; the shape each one has):
{fields_text(task, shapes)}

Write the reward function by completing this skeleton; `state.<name>` is a field before the action,
`next_state.<name>` after it:

```python
import torch

def {entry}(state, action, next_state):
{skeleton_bindings(task, shapes)}
    # ... compute the reward terms from these (and state.<name> where the change matters) ...
    reward = ...  # float tensor [B]: the sum of the terms
    return reward, {{...}}  # dict of every term you added up, each a named [B] tensor
```

{action_text(task, shapes)}
Rules:
- {bindings_rule(task)}
- Every field is a whole batch, not a number: use torch operations (torch.where instead of `if`,
  torch.abs/torch.exp/torch.clamp instead of abs()/math.*), no Python loops over the batch, no in-place
  edits of the inputs. Give torch functions tensors, not Python numbers.
- You may import only: {", ".join(allowed_imports)}. No file, network or process access. The reward must be
  finite for every state.
- {sign_rule(task)}
Reply with the complete function in one ```python block and nothing after it."""


def _dict_reward_interface(task: Task, allowed_imports: list[str] | tuple[str, ...], shapes: Shapes, entry: str) -> str:
    """The earlier reward prompt (dict reads, an example from a made-up task), kept for comparison."""
    return f"""Write the reward function with exactly this signature:

```python
import torch

def {entry}(state, action, next_state):
    # state, next_state: dict of field name -> torch.Tensor, batched over B environments
    # returns (reward, components): reward is a float tensor of shape [B];
    # components is a dict of named [B] tensors, the terms that make up the reward
    ...
    return reward, components
```

The fields of `state` and `next_state` (float32 tensors; the shape each one has):
{fields_text(task, shapes)}

{action_text(task, shapes)}
Every field is a whole batch, not a number: use vectorised torch operations
(torch.where instead of `if`, torch.abs/torch.exp/torch.clamp instead of abs()/math.*),
no Python loops over the batch, no in-place edits of the inputs. You may import only:
{", ".join(allowed_imports)}. No file, network or process access. The reward must be
finite for every state.

The expected style, for a made-up task with fields `x` and `y` (not your task):

```python
import torch

def {entry}(state, action, next_state):
    distance = torch.sqrt(next_state["x"] ** 2 + next_state["y"] ** 2)
    distance_temperature = 0.5
    closeness = torch.exp(-distance / distance_temperature)
    progress = torch.clamp(state["x"].abs() - next_state["x"].abs(), -1.0, 1.0)
    reward = closeness + 0.5 * progress
    return reward, {{"closeness": closeness, "progress": progress}}
```"""


def state_interface(
    task: Task,
    allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch"),
    shapes: Shapes | None = None,
    interface: str = "fields",
) -> str:
    """The state-representation function's signature, for prompts.

    :param shapes: the task's :func:`batch_shapes` (computed here when not given).
    :param interface: ``fields`` (the skeleton built from the task) or ``dict`` (the earlier prompt).
    """
    shapes = shapes or batch_shapes(task)
    if interface == "dict":
        return f"""Write the function with exactly this signature:

```python
import torch

def revise_state(state):
    # state: dict of field name -> torch.Tensor, batched over B environments
    # returns a float tensor [B, k] of k extra features (k >= 1, fixed)
    ...
```

The fields of `state` (float32 tensors; the shape each one has):
{fields_text(task, shapes)}

Use vectorised torch operations only. You may import only: {", ".join(allowed_imports)}."""
    return f"""The fields of a state (float32 tensors batched over B environments; the shape each one has):
{fields_text(task, shapes)}

Write the function by completing this skeleton; it reads each field as `state.<name>`:

```python
import torch

def revise_state(state):
{skeleton_bindings(task, shapes, source="state")}
    # ... compute k >= 1 extra features from these ...
    return torch.stack([...], dim=-1)  # float tensor [B, k]; k fixed
```

{state_bindings_rule(task)} Use vectorised torch operations only, and give torch functions tensors, not
Python numbers. You may import only: {", ".join(allowed_imports)}."""


# -- repair: a short request per failure ----------------------------------------------------------------

#: the rule a failure of each kind broke, said again in the repair request
RULES = {
    "names": "Read only the task's fields listed above, as state.<name> or next_state.<name>, and assign every "
    "variable before you use it.",
    "signature": "Keep the function's name and arguments exactly as given.",
    "syntax": "Write valid Python 3.",
    "forbidden": "Use only the allowed imports and plain Python: no files, processes, dunder names or globals.",
    "exception": "Every field is a [B] (or [B, n]) tensor: use torch operations on whole batches, and give torch "
    "functions tensors, not Python numbers.",
    "invalid_value": "Return a finite float tensor with one value per environment (shape [B]).",
    "timeout": "Keep it to a few vectorised torch operations: no loops.",
    "too_slow": "Keep it to a few vectorised torch operations: no loops.",
}


def repair_messages(
    task: Task,
    source: str,
    error: str,
    kind: str,
    entry: str = "compute_reward",
    shapes: Shapes | None = None,
    role: str = "reward",
    unchanged: bool = False,
) -> list[dict[str, str]]:
    """A short request to fix one program: the fields, the failing function, the error, the rule it broke.

    Not the whole conversation again: a small model fixes a named error in a short prompt
    far more often than it rewrites a function from a long one. A small model also tends to
    hand the function back as it was (measured: 15 of 19 repairs of MountainCar rewards at
    temperature 0.2); ``unchanged`` says the previous reply did that, so this request asks
    for the lines the error points at to change.
    """
    shapes = shapes or batch_shapes(task)
    rule = sign_rule(task) if kind == "vetting" else RULES.get(kind, RULES["exception"])
    fields = "\n".join(f"- {f.name} ({Shapes.text(shapes.fields.get(f.name, f.shape))})" for f in program_fields(task))
    again = (
        "\nYour previous reply returned this function unchanged, so it fails the same way. Rewrite the lines that "
        "cause the error.\n"
        if unchanged
        else ""
    )
    user = f"""A {role} function `{entry}` for this task failed its check before training.

Task goal: {task.goal}
The fields of a state, each a float32 tensor batched over B environments:
{fields}

The function:
{fence(source, "python")}

What went wrong:
{error.strip()[-1500:]}
{again}
{rule}
The function fails as written: reply with the corrected complete function, changed where the error points, in one \
```python block and nothing after it."""
    return [
        {
            "role": "system",
            "content": "You fix Python functions: find the lines that cause the error and rewrite them.",
        },
        {"role": "user", "content": user},
    ]


# -- reflections as markdown (logged under reflection/, rendered by MLflow) ---------------------


def fence(text: str, lang: str = "") -> str:
    """``text`` in a fenced markdown block whose fence no backtick run inside can close."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    ticks = "`" * max(3, longest + 1)
    return f"{ticks}{lang}\n{text.rstrip()}\n{ticks}"


def reply_counts(pairs: list[tuple[Any, Any]]) -> str:
    """``8 sampled, 6 usable, 5 trained`` for ``(candidate, result)`` pairs of one plugin."""
    rejected = sum(bool(c.rejected) for c, _ in pairs)
    trained = sum(bool(r.ok) for _, r in pairs)
    return f"{len(pairs)} sampled, {len(pairs) - rejected} usable, {trained} trained"


def candidate_line(candidate: Any, result: Any, program: Any = None) -> str:
    """One markdown list item: the candidate, the reply it came from, and how it fared."""
    sample = program.meta.get("sample") if program is not None else None
    where = f" (reply {sample})" if sample is not None else ""
    if candidate.rejected:
        kind = program.meta.get("rejected_kind", "") if program is not None else ""
        reason = candidate.rejected.strip().splitlines()[0]
        return f"- `{candidate.id}`{where}: rejected{f' ({kind})' if kind else ''}, not trained: {reason}"
    if result.ok and result.fitness is not None:
        renamed = program.meta.get("renamed_from") if program is not None else None
        note = f" (function `{renamed}` renamed to `{program.entry}`)" if renamed else ""
        fixes = program.meta.get("fixes") if program is not None else None
        note += f" ({len(fixes)} name fix{'es' if len(fixes) != 1 else ''} before it ran)" if fixes else ""
        return f"- `{candidate.id}`{where}: {result.fitness.name} {result.fitness.value:.4g}{note}"
    first = (result.error.strip().splitlines() or [""])[-1][:200]
    return f"- `{candidate.id}`{where}: failed ({result.error_kind or 'error'}){': ' + first if first else ''}"


def summarize_series(values: list[float]) -> str:
    """``[v1, v2, ...], max, mean, min`` with 2 significant decimals (Eureka-style feedback)."""
    if not values:
        return "no values"
    shown = ", ".join(f"{v:.2f}" for v in values)
    return f"[{shown}], Max: {max(values):.2f}, Mean: {sum(values) / len(values):.2f}, Min: {min(values):.2f}"


def sample_evenly(points: list[Any], k: int = 10) -> list[Any]:
    """At most ``k`` items spread evenly over ``points`` (first and last kept)."""
    if len(points) <= k:
        return list(points)
    step = (len(points) - 1) / (k - 1)
    return [points[round(i * step)] for i in range(k)]
