"""RL training on TorchRL: trainers, the per-step transforms, evaluation."""

from __future__ import annotations

import importlib
from typing import Any, Callable

from core.errors import UserError, did_you_mean

#: trainer name (``trainer.name``) -> (module with a ``train`` function, its config dataclass)
TRAINERS = {
    "ppo": ("core.train.ppo", "PPOConfig"),
    "sac": ("core.train.sac", "SACConfig"),
    "random": ("core.train.random_policy", "RandomConfig"),
}


def get_trainer(name: str) -> tuple[Callable[..., Any], Any]:
    """The ``train`` function and config dataclass of a trainer."""
    if name not in TRAINERS:
        raise UserError(
            f"Unknown trainer '{name}'.{did_you_mean(name, list(TRAINERS))} Available: {', '.join(TRAINERS)}."
        )
    module_name, config_class = TRAINERS[name]
    module = importlib.import_module(module_name)
    return module.train, getattr(module, config_class)
