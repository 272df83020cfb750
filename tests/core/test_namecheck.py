"""core/namecheck.py: the names a program reads, checked against the task before anything runs."""

from __future__ import annotations

from core.namecheck import add_missing_return, check_names, state_arguments
from core.sandbox.policy import SAFE_BUILTIN_NAMES

FIELDS = ["cart_position", "cart_velocity", "pole_angle", "pole_angular_velocity"]


def check(source: str, **kwargs):
    return check_names(source, FIELDS, available=SAFE_BUILTIN_NAMES, **kwargs)


def test_known_fields_read_every_way_pass_unchanged():
    source = (
        "def compute_reward(state, action, next_state):\n"
        "    a = next_state.pole_angle + state['cart_position'] + state.get('cart_velocity', 0)\n"
        "    return a, {k: v for k, v in state.items()}\n"
    )
    out = check(source)
    assert out.ok and out.source == source and not out.fixes


def test_a_field_with_one_close_match_is_renamed_and_the_fix_recorded():
    source = (
        "def compute_reward(state, action, next_state):\n    return next_state.pole_angel + state['Cart_Position']\n"
    )
    out = check(source)
    assert out.ok and "next_state.pole_angle + state['cart_position']" in out.source
    assert len(out.fixes) == 2 and "`pole_angel`" in out.fixes[0]


def test_an_unknown_field_is_refused_with_the_valid_ones():
    out = check("def compute_reward(state, action, next_state):\n    return state['x'] + next_state.tip_height\n")
    assert not out.ok and len(out.errors) == 2
    assert "`x` is not a field of this task" in out.errors[0]
    assert "The state has exactly these fields: cart_position, cart_velocity" in out.message(FIELDS)


def test_several_close_fields_are_offered_not_guessed():
    out = check_names("def f(state):\n    return state.ab\n", ["abc", "abd"], available=SAFE_BUILTIN_NAMES)
    assert not out.ok and not out.fixes and "`abc`" in out.errors[0] and "`abd`" in out.errors[0]


def test_a_name_never_assigned_is_refused_and_a_bare_field_gets_a_hint():
    out = check(
        "import torch\ndef compute_reward(state, action, next_state):\n"
        "    reward = closeness + pole_angle\n    return reward\n"
    )
    assert not out.ok
    assert "`closeness` is used but never assigned" in out.errors[0]
    assert "write `next_state.pole_angle`" in out.errors[1]


def test_names_bound_anywhere_and_builtins_pass():
    source = (
        "import torch\nimport math as m\n\ndef helper(x, *rest, scale=1.0, **kw):\n    return x * scale\n\n"
        "def compute_reward(state, action, next_state):\n"
        "    total = sum(helper(v) for v in [state.pole_angle])\n"
        "    try:\n        y = m.pi\n    except ValueError as err:\n        y = 0.0\n"
        "    for i in range(2):\n        total = total + i\n"
        "    return torch.as_tensor(total) + (z := 1.0) + y + float(len(state)), {}\n"
    )
    assert check(source).ok


def test_a_python_number_given_to_a_torch_function_is_wrapped():
    source = (
        "import torch\ndef compute_reward(state, action, next_state):\n"
        "    temperature = 0.5\n"
        "    return torch.exp(temperature) * torch.maximum(state.pole_angle, 0.0) + torch.sqrt(-1 * 2.0)\n"
    )
    out = check(source)
    assert out.ok and len(out.fixes) == 3
    assert "torch.exp(torch.tensor(temperature))" in out.source
    assert "torch.maximum(state.pole_angle, torch.tensor(0.0))" in out.source
    assert "torch.sqrt(torch.tensor(-1 * 2.0))" in out.source
    compile(out.source, "<fixed>", "exec")


def test_a_usual_module_used_but_never_imported_gets_its_import_once():
    source = (
        "from __future__ import annotations\n"
        "def compute_reward(state, action, next_state):\n"
        "    up = math.cos(next_state.pole_angle) + np.pi + math.pi\n"
        "    return torch.as_tensor(up), {}\n"
    )
    out = check(source)
    assert out.ok, out.errors
    assert out.source.splitlines()[:4] == [
        "from __future__ import annotations",
        "import math",
        "import numpy as np",
        "import torch",
    ]
    assert len(out.fixes) == 3 and "`math` (line 3) used but never imported" in out.fixes[0]
    namespace: dict = {}
    exec(compile(out.source, "<fixed>", "exec"), namespace)
    assert "compute_reward" in namespace
    assert not check(source, fix=False).ok  # without fixes the unbound names are refused


def test_an_unusual_module_name_is_still_refused():
    out = check("def compute_reward(state, action, next_state):\n    return scipy.special.expit(state.pole_angle)\n")
    assert not out.ok and "`scipy` is used but never assigned" in out.errors[0] and not out.fixes


def test_without_fix_nothing_is_changed():
    out = check("def compute_reward(state, action, next_state):\n    return next_state.pole_angel\n", fix=False)
    assert not out.ok and "did you mean `pole_angle`?" in out.errors[0]


def test_the_state_arguments_are_what_the_function_calls_them():
    assert state_arguments(
        "def compute_reward(s, a, n):\n    pass\n", "compute_reward", ["state", "action", "next_state"]
    ) == ("s", "n")
    assert state_arguments("def act(obs):\n    pass\n", "act", ["state"]) == ("obs",)
    out = check_names(
        "def compute_reward(s, a, n):\n    return s['nope']\n",
        FIELDS,
        state_args=state_arguments(
            "def compute_reward(s, a, n):\n    return s['nope']\n", "compute_reward", ["state", "action", "next_state"]
        ),
    )
    assert not out.ok


def test_code_that_does_not_parse_is_left_to_the_syntax_check():
    assert check("def compute_reward(:\n").ok


def test_state_device_is_not_a_field_read():
    out = check(
        "import torch\n\ndef compute_reward(state, action, next_state):\n"
        "    return torch.zeros(1, device=state.device)\n"
    )
    assert out.ok and not out.fixes


def test_an_entry_that_never_returns_returns_its_last_reward_name():
    source = (
        "def compute_reward(state, action, next_state):\n"
        "    upright = next_state.pole_angle.abs()\n"
        "    total_reward = 1.0 - upright\n"
        "    total_reward += 0.1\n"
        "    def helper(x):\n"
        "        return x\n"
        "\n"
        "HELPER = 1\n"
    )
    fixed, note = add_missing_return(source, "compute_reward")
    assert note and "`return total_reward` added" in note
    assert "    total_reward += 0.1\n    def helper(x):\n        return x\n    return total_reward\n" in fixed
    namespace: dict = {}
    exec(fixed, namespace)
    assert (
        namespace["compute_reward"](None, None, type("S", (), {"pole_angle": __import__("torch").tensor(0.5)})()) == 0.6
    )


def test_an_entry_that_returns_or_names_nothing_fitting_is_left_alone():
    returns = "def compute_reward(s, a, n):\n    reward = 1\n    if reward:\n        return reward\n"
    assert add_missing_return(returns, "compute_reward") == (returns, None)
    unnamed = "def compute_reward(s, a, n):\n    value = 1\n"
    assert add_missing_return(unnamed, "compute_reward") == (unnamed, None)
    assert add_missing_return("def act(obs):\n    action = 2", "act")[0].endswith("    action = 2\n    return action\n")
    assert add_missing_return("def act(obs) return", "act") == ("def act(obs) return", None)
    one_line = "def act(obs): action = 2\n"
    assert add_missing_return(one_line, "act") == (one_line, None)
    tabbed, _ = add_missing_return("def act(obs):\n\taction = 2\n", "act")
    assert tabbed == "def act(obs):\n\taction = 2\n\treturn action\n"
