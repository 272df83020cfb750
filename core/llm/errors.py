"""The one error the LLM layer raises: a short, actionable paragraph."""

from __future__ import annotations

from core.errors import UserError


class LLMError(UserError):
    """An LLM call failed in a way the user can act on (key, server, model, limits).

    The message is one paragraph that names what to change: the env var to set, the
    ``llm.*`` key to fix, or the package to install.
    """
