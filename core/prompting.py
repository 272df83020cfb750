"""Prompt text every code-writing method needs: how the core will call the code.

These describe the calling convention of ``core.sandbox`` (argument names, batching,
return values, allowed imports); methods add their own framing around them.
"""

from __future__ import annotations

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
