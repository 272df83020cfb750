"""llm4rl core: hooks, registry, the agent loop, training, tracking, the LLM layer.

What a plugin imports: ``hookimpl`` (the marker for hook implementations),
``PluginConfig`` (the base of its ``Config`` dataclass) and, for type hints, the
contexts ``RunContext``, ``TrainContext`` and ``StepBatch``.
"""

from typing import Any

import pluggy

from core.config import PluginConfig
from core.hookspecs import PROJECT

#: Marker for hook implementations: ``@hookimpl def propose_rewards(self, run, iteration): ...``
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["hookimpl", "PluginConfig", "RunContext", "TrainContext", "StepBatch"]


def __getattr__(name: str) -> Any:  # the contexts import torch: only when asked for
    if name in ("RunContext", "TrainContext", "StepBatch"):
        import core.context

        return getattr(core.context, name)
    raise AttributeError(f"module 'core' has no attribute {name!r}")
