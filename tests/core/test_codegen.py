"""Extracting code from LLM replies, and precise errors for malformed ones."""

from __future__ import annotations

import pytest

from core.codegen import KINDS, extract_code, extract_function, program_from_reply
from core.records import RewardProgram, StateProgram

ARGS = ["state", "action", "next_state"]
FN = "def compute_reward(state, action, next_state):\n    return helper(state['x'])"
HELPER = "import torch\n\ndef helper(x):\n    return torch.tanh(x)"


@pytest.mark.parametrize(
    "reply",
    [
        f"Here you go:\n```python\n{HELPER}\n\n{FN}\n```\nThis rewards x.",
        f"```py\n{HELPER}\n\n{FN}\n```",
        f"```Python3\n{HELPER}\n\n{FN}\n```",
        f"```\n{HELPER}\n\n{FN}\n```",
        f"~~~python\n{HELPER}\n\n{FN}\n~~~",
        f"Sure!\n```python\n{HELPER}\n\n{FN}\n",  # the fence was never closed
        f"Sure, here it is.\n{HELPER}\n\n{FN}\n\nIt uses tanh to bound the value.",  # no fence
        f"<think>use tanh</think>\n```python\n{HELPER}\n\n{FN}\n```",
    ],
    ids=["python", "py", "Python3", "bare", "tilde", "unterminated", "unfenced", "think"],
)
def test_fence_styles_give_the_function_with_its_helpers(reply: str) -> None:
    result = extract_function(reply, "compute_reward", ARGS)
    assert result.ok, result.error
    assert "def helper(x)" in result.source and "import torch" in result.source
    assert "def compute_reward" in result.source and "This rewards" not in result.source


def test_picks_the_block_defining_the_entry() -> None:
    reply = (
        "Install:\n```bash\npip install torch\n```\nExample state:\n```python\nstate = {'x': 1}\n```\n"
        f"Code:\n```python\n{HELPER}\n\n{FN}\n```"
    )
    result = extract_function(reply, "compute_reward", ARGS)
    assert result.ok and "pip install" not in result.source and "state = {" not in result.source


def test_same_function_repeated_in_two_blocks_is_fine() -> None:
    reply = f"```python\n{FN}\n```\nAgain:\n```python\n{FN}\n```"
    assert extract_function(reply, "compute_reward", ARGS).ok


def test_example_calls_and_main_blocks_are_dropped() -> None:
    reply = (
        f"```python\n{HELPER}\n\n{FN}\n\n"
        "print(compute_reward({}, 0, {}))\nif __name__ == '__main__':\n    compute_reward(1, 2, 3)\n```"
    )
    result = extract_function(reply, "compute_reward", ARGS)
    assert result.ok and "print(" not in result.source and "__main__" not in result.source
    assert len(result.notes) == 2


def test_extract_code_prefers_the_last_python_block() -> None:
    reply = '```python\nx = 1\n```\n```json\n{"a": 1}\n```\n```python\ny = 2\n```'
    assert extract_code(reply) == "y = 2"
    assert extract_code("no code at all") == ""


# -- malformed replies: the error says precisely what is wrong -----------------------------


def test_empty_reply() -> None:
    result = extract_function("", "compute_reward", ARGS)
    assert not result.ok and "empty" in result.error


def test_prose_only() -> None:
    result = extract_function("I would reward the agent for keeping the pole upright.", "compute_reward", ARGS)
    assert not result.ok and "no code" in result.error and "compute_reward" in result.error


def test_function_missing_names_what_was_found() -> None:
    result = extract_function("```python\ndef reward(s, a, n):\n    return 0\n```", "compute_reward", ARGS)
    assert not result.ok and "No function named `compute_reward`" in result.error and "`reward`" in result.error


def test_two_different_definitions() -> None:
    reply = (
        f"```python\n{FN}\n```\nBetter:\n```python\ndef compute_reward(state, action, next_state):\n    return 0\n```"
    )
    result = extract_function(reply, "compute_reward", ARGS)
    assert not result.ok and "defined 2 times" in result.error and "blocks 1, 2" in result.error


def test_two_definitions_in_one_block() -> None:
    result = extract_function(f"```python\n{FN}\n\n{FN}\n```", "compute_reward", ARGS)
    assert not result.ok and "defined 2 times" in result.error


@pytest.mark.parametrize(
    ("header", "found"),
    [
        ("def compute_reward(state):", "def compute_reward(state)"),
        ("def compute_reward(state, action, next_state, info):", "info"),
        ("def compute_reward(state, action, next_state, *, scale):", "scale"),
    ],
)
def test_wrong_signature_says_expected_and_found(header: str, found: str) -> None:
    result = extract_function(f"```python\n{header}\n    return 0\n```", "compute_reward", ARGS)
    assert not result.ok and "wrong signature" in result.error
    assert "def compute_reward(state, action, next_state)" in result.error and found in result.error


def test_compatible_signatures_are_accepted() -> None:
    for header in (
        "def compute_reward(s, a, ns):",
        "def compute_reward(s, a, ns, scale=1.0):",
        "def compute_reward(*args):",
    ):
        assert extract_function(f"```python\n{header}\n    return 0\n```", "compute_reward", ARGS).ok, header


def test_syntax_error_is_located() -> None:
    result = extract_function(
        "```python\ndef compute_reward(state, action, next_state):\n    return (1 +\n```", "compute_reward", ARGS
    )
    assert not result.ok and "SyntaxError in code block 1" in result.error and "line" in result.error


def test_async_entry_is_refused() -> None:
    result = extract_function(
        "```python\nasync def compute_reward(s, a, n):\n    return 0\n```", "compute_reward", ARGS
    )
    assert not result.ok and "async" in result.error


def test_torchscript_decorators_are_dropped() -> None:
    reply = (
        "```python\nfrom typing import Dict, Tuple\nimport torch\n\n@torch.jit.script\n"
        "def compute_reward(state: Dict[str, torch.Tensor], action: torch.Tensor, next_state: Dict[str, torch.Tensor])"
        " -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:\n    r = next_state['x']\n    return r, {'x': r}\n```"
    )
    result = extract_function(reply, "compute_reward", ARGS)
    assert result.ok and "@torch.jit.script" not in result.source and "from typing import" in result.source
    from core.sandbox import check_source

    assert check_source(result.source, "compute_reward", arg_names=ARGS).ok


# -- every failure has a kind; a lone misnamed function can be renamed ------------------------


@pytest.mark.parametrize(
    ("reply", "kind"),
    [
        ("", "empty"),
        ("Reward the agent for balance.", "no_code"),
        ("```python\ndef compute_reward(state, action, next_state):\n    return (1 +\n```", "syntax"),
        ("```python\nx = (1 +\n```", "syntax"),
        ("```python\ndef reward(s):\n    return 0\n```", "no_function"),
        (f"```python\n{FN}\n\n{FN}\n```", "duplicate"),
        ("```python\nasync def compute_reward(s, a, n):\n    return 0\n```", "async"),
        ("```python\ndef compute_reward(s):\n    return 0\n```", "signature"),
    ],
)
def test_every_failure_names_its_kind(reply: str, kind: str) -> None:
    result = extract_function(reply, "compute_reward", ARGS, rename=True)
    assert not result.ok and result.kind == kind and result.kind in KINDS and result.error


def test_a_lone_misnamed_function_is_renamed_only_when_asked() -> None:
    reply = (
        f"```python\n{HELPER}\n\n"
        "def improved_compute_reward(state, action, next_state):\n    return helper(state['x'])\n```"
    )
    assert not extract_function(reply, "compute_reward", ARGS).ok
    result = extract_function(reply, "compute_reward", ARGS, rename=True)
    assert result.ok and result.renamed == "improved_compute_reward"
    assert "def compute_reward(state, action, next_state)" in result.source and "def helper(x)" in result.source
    assert "renamed `improved_compute_reward` to `compute_reward`" in result.notes


def test_two_functions_that_fit_are_not_guessed_between() -> None:
    reply = "```python\ndef reward_a(s, a, n):\n    return 0\n\ndef reward_b(s, a, n):\n    return 1\n```"
    result = extract_function(reply, "compute_reward", ARGS, rename=True)
    assert not result.ok and result.kind == "no_function" and "`reward_a`" in result.error


def test_program_from_reply_keeps_a_rejected_reply_with_its_reason() -> None:
    program = program_from_reply(
        RewardProgram, "Reward balance.", "compute_reward", ARGS, origin="x", meta={"sample": 4}
    )
    assert program.rejected.startswith("The reply contains no code") and program.reply == "Reward balance."
    assert program.meta == {"sample": 4, "rejected_kind": "no_code"} and program.origin == "x" and program.source == ""
    bad = program_from_reply(
        RewardProgram, "```python\ndef compute_reward(s):\n    return 0\n```", "compute_reward", ARGS
    )
    assert bad.rejected and bad.meta["rejected_kind"] == "signature" and "def compute_reward(s)" in bad.source
    good = program_from_reply(
        StateProgram, "```python\ndef features(state):\n    return state['x']\n```", "revise_state", ["state"]
    )
    assert not good.rejected and good.meta["renamed_from"] == "features" and "def revise_state(state)" in good.source


def test_a_reply_whose_entry_never_returns_gets_a_return_and_the_fix_recorded() -> None:
    reply = "```python\ndef compute_reward(state, action, next_state):\n    reward = -next_state.height\n```"
    program = program_from_reply(RewardProgram, reply, "compute_reward", ARGS, state_fields=["height"])
    assert not program.rejected and program.source.rstrip().endswith("return reward")
    assert any("never returned a value" in f for f in program.meta["fixes"])
