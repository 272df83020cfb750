"""Prompt text every code-writing method needs: how the core will call the code.

These describe the calling convention of ``core.sandbox`` (argument names, batching,
return values, allowed imports); methods add their own framing around them. The shapes
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
        low=tuple(float(x) for x in space.low.reshape(-1)) if box else (),
        high=tuple(float(x) for x in space.high.reshape(-1)) if box else (),
    )


def action_text(task: Task, shapes: Shapes | None = None) -> str:
    """What the ``action`` argument holds: dtype, shape and meaning, as training passes it."""
    shapes = shapes or batch_shapes(task)
    described = f" {task.action_description}" if task.action_description else ""
    shape = Shapes.text(shapes.action)
    if shapes.actions:
        return (f"`action` is an {shapes.action_dtype} tensor of shape {shape} (one action index per env, "
                f"0..{shapes.actions - 1}; no trailing dimension).{described}")
    bounds = ""
    if shapes.low and len(set(shapes.low)) == 1 and len(set(shapes.high)) == 1:
        bounds = f" within [{shapes.low[0]:g}, {shapes.high[0]:g}]"
    return (f"`action` is a {shapes.action_dtype} tensor of shape {shape}: the policy's sample, which may lie "
            f"outside the bounds{bounds} (the env clips it before stepping).{described}")


def fields_text(task: Task, shapes: Shapes | None = None) -> str:
    """One line per state field with the shape the code receives (``[B]`` or ``[B, 3]``)."""
    shapes = shapes or batch_shapes(task)
    lines = []
    for f in task.state_fields:
        unit = f", unit {f.unit}" if f.unit else ""
        lines.append(f"- {f.name} ({Shapes.text(shapes.fields[f.name])}{unit}): {f.description}")
    return "\n".join(lines)


def reward_interface(task: Task, allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch"),
                     shapes: Shapes | None = None) -> str:
    """The reward function's signature, inputs and outputs, for prompts.

    :param shapes: the task's :func:`batch_shapes` (computed here when not given).
    """
    shapes = shapes or batch_shapes(task)
    return f"""Write the reward function with exactly this signature:

```python
import torch

def compute_reward(state, action, next_state):
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

def compute_reward(state, action, next_state):
    distance = torch.sqrt(next_state["x"] ** 2 + next_state["y"] ** 2)
    distance_temperature = 0.5
    closeness = torch.exp(-distance / distance_temperature)
    progress = torch.clamp(state["x"].abs() - next_state["x"].abs(), -1.0, 1.0)
    reward = closeness + 0.5 * progress
    return reward, {{"closeness": closeness, "progress": progress}}
```"""


def state_interface(task: Task, allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch"),
                    shapes: Shapes | None = None) -> str:
    """The state-representation function's signature, for prompts.

    :param shapes: the task's :func:`batch_shapes` (computed here when not given).
    """
    shapes = shapes or batch_shapes(task)
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
    sample = (program.meta.get("sample") if program is not None else None)
    where = f" (reply {sample})" if sample is not None else ""
    if candidate.rejected:
        kind = program.meta.get("rejected_kind", "") if program is not None else ""
        reason = candidate.rejected.strip().splitlines()[0]
        return f"- `{candidate.id}`{where}: rejected{f' ({kind})' if kind else ''}, not trained: {reason}"
    if result.ok and result.fitness is not None:
        renamed = program.meta.get("renamed_from") if program is not None else None
        note = f" (function `{renamed}` renamed to `{program.entry}`)" if renamed else ""
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
