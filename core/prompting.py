"""Prompt text every code-writing method needs: how the core will call the code.

These describe the calling convention of ``core.sandbox`` (argument names, batching,
return values, allowed imports); methods add their own framing around them.
"""

from __future__ import annotations

import re
from typing import Any

from core.envs.task import Task


def action_text(task: Task) -> str:
    """One line describing the action tensor the code receives."""
    described = f" {task.action_description}" if task.action_description else ""
    return f"`action` is a tensor of shape [B, ...] holding each env's action.{described}"


def reward_interface(task: Task, allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch")) -> str:
    """The reward function's signature, inputs and outputs, for prompts."""
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

The fields of `state` and `next_state` (each a float32 tensor, scalars of shape [B]):
{task.schema_text()}

{action_text(task)}
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


def state_interface(task: Task, allowed_imports: list[str] | tuple[str, ...] = ("math", "numpy", "torch")) -> str:
    """The state-representation function's signature, for prompts."""
    return f"""Write the function with exactly this signature:

```python
import torch

def revise_state(state):
    # state: dict of field name -> torch.Tensor, batched over B environments
    # returns a float tensor [B, k] of k extra features (k >= 1, fixed)
    ...
```

The fields of `state` (each a float32 tensor, scalars of shape [B]):
{task.schema_text()}

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
