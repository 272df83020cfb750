"""The LLM layer: one client over litellm, and the embedded default model.

Plugins get a client from the run (``run.llm``) and never import litellm::

    replies = run.llm.chat(messages, n=4, temperature=0.8, seed=run.seed, tag="eureka")
    text = run.llm.ask("Write a reward function ...", system="You are ...")

``make_client(cfg.llm)`` builds one from the Hydra ``llm`` node; ``python -m core.llm
"PROMPT" [overrides]`` asks the configured model from the command line.
"""

import os

# litellm fetches its price table over the network at import unless told otherwise.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

from core.llm.client import (
    CallRecord,
    LLMClient,
    LLMSettings,
    LLMStats,
    Reply,
    make_client,
)
from core.llm.errors import LLMError

__all__ = ["CallRecord", "LLMClient", "LLMError", "LLMSettings", "LLMStats", "Reply", "make_client"]
