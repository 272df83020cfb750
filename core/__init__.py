"""llm4rl core: hooks, registry, the agent loop, training, tracking, the LLM layer."""

import pluggy

from core.hookspecs import PROJECT

#: Marker for hook implementations: ``@hookimpl def propose_rewards(run, iteration): ...``
hookimpl = pluggy.HookimplMarker(PROJECT)

__all__ = ["hookimpl"]
