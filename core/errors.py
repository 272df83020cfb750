"""Errors a user can fix, and how they are shown: one paragraph, no traceback wall."""

from __future__ import annotations

import difflib


class UserError(Exception):
    """A mistake the user can fix; printed as one paragraph without a traceback."""


def did_you_mean(name: str, choices: list[str]) -> str:
    """`` Did you mean 'x'?`` when a close match exists, else an empty string."""
    close = difflib.get_close_matches(name, choices, n=1)
    return f" Did you mean '{close[0]}'?" if close else ""
