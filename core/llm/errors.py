"""The one error the LLM layer raises: a short, actionable paragraph."""

from __future__ import annotations

from core.errors import UserError


class LLMError(UserError):
    """An LLM call failed in a way the user can act on (key, server, model, limits).

    The message is one paragraph that names what to change: the env var to set, the
    ``llm.*`` key to fix, or the package to install.
    """


class ReplayMiss(LLMError):
    """``llm.replay_only`` found no recorded reply for a request: the run cannot be replayed."""


def missing_key(model: str, env: str) -> LLMError:
    """The error for a model whose API key variable is not set (raised before any run is opened)."""
    return LLMError(
        f"The model '{model}' needs an API key, but the environment variable {env} is not set. Set it "
        f"(export {env}=...), point llm.api_key_env at the variable that holds your key, or use the "
        "offline default `llm=embedded`, which needs no key."
    )
