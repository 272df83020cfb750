"""llm4rl core: hooks, registry, the agent loop, training, tracking, the LLM layer.

A plugin imports from :mod:`core.plugin`, the plugin API. This package also gives
``hookimpl`` (the marker for hook implementations) and ``PluginConfig`` (the base of a
plugin's ``Config`` dataclass) without importing torch; the contexts ``RunContext``,
``TrainContext`` and ``StepBatch`` load on first access.
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
