"""The plugin API (:mod:`core.plugin`): what it exports, and that the built-ins import nothing else.

The surface is written out below on purpose: adding, removing or renaming an export
fails here until :data:`SURFACE` (and ``docs/writing-a-plugin.md``) say so.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import core.plugin
from core.testing.contract import core_imports

ROOT = Path(__file__).resolve().parents[2]
GUIDE = ROOT / "docs" / "writing-a-plugin.md"

#: every name core.plugin exports, by group (the groups of its docstring and of the guide)
SURFACE = {
    "hooks and config": ["hookimpl", "hookspec", "PluginConfig", "SandboxConfig"],
    "contexts": ["RunContext", "TrainContext", "StepBatch", "ActionPrior"],
    "records": [
        "Program",
        "RewardProgram",
        "StateProgram",
        "MacroAction",
        "EnvConfig",
        "StartPolicy",
        "Plan",
        "PlanStep",
        "Candidate",
        "Fitness",
        "TrainResult",
        "IterationResult",
    ],
    "the task": ["Task", "Trajectory", "VectorStep", "task_steps"],
    "errors": ["UserError", "LLMError", "SandboxError"],
    "LLM code": [
        "extract_code",
        "extract_function",
        "program_from_reply",
        "without_prelude",
        "check_names",
        "state_arguments",
        "SAFE_BUILTIN_NAMES",
    ],
    "prompting": [
        "Shapes",
        "batch_shapes",
        "action_text",
        "fields_text",
        "field_bindings",
        "program_fields",
        "sign_rule",
        "task_description",
        "reward_interface",
        "state_interface",
        "interface_of",
        "code_options",
        "repair_messages",
        "fence",
        "reply_counts",
        "candidate_line",
        "summarize_series",
        "sample_evenly",
    ],
    "the LLM in the background": ["warm_up", "BackgroundCalls", "ask_in_batches"],
    "plans and goals": ["goal_names", "match_goal", "newly_achieved", "check_plan", "PlanFollower"],
    "the sandbox": [
        "prepare_reward",
        "prepare_state",
        "probe_batch",
        "run_isolated",
        "validate_state",
        "normalize_reward",
        "SandboxReport",
    ],
    "training pieces": ["MacroSet", "Population", "Member", "population_settings"],
    "progress": ["make_progress"],
}
EXPORTS = [name for group in SURFACE.values() for name in group]


def test_the_surface_is_the_announced_one():
    exported = list(core.plugin.__all__)
    assert len(exported) == len(set(exported)), "core.plugin.__all__ names something twice"
    added, removed = sorted(set(exported) - set(EXPORTS)), sorted(set(EXPORTS) - set(exported))
    assert not added and not removed, (
        f"the plugin API changed: added {added}, removed {removed}. If that is meant, update SURFACE here "
        "and the list in docs/writing-a-plugin.md."
    )


def test_every_export_resolves():
    missing = [name for name in core.plugin.__all__ if getattr(core.plugin, name, None) is None]
    assert not missing, f"core.plugin.__all__ names what it does not have: {missing}"
    namespace: dict[str, object] = {}
    exec("from core.plugin import *", namespace)
    assert set(core.plugin.__all__) <= set(namespace)


def test_nothing_public_is_left_out_of_all():
    """A name the module has but ``__all__`` does not list would be API by accident."""
    public = {n for n in vars(core.plugin) if not n.startswith("_") and n != "annotations"}
    assert public == set(core.plugin.__all__), sorted(public ^ set(core.plugin.__all__))


def test_the_guide_lists_every_export():
    text = GUIDE.read_text()
    missing = [name for name in EXPORTS if f"`{name}`" not in text]
    assert not missing, f"docs/writing-a-plugin.md does not list {missing}"


def test_core_itself_stays_light():
    """``from core import hookimpl, PluginConfig`` imports neither torch nor the API module."""
    code = (
        "import sys; from core import PluginConfig, hookimpl; "
        "print(sorted(m for m in ('torch', 'core.plugin') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_the_builtins_import_only_the_plugin_api():
    """What ``grep "from core\\." plugins/`` would show: core.plugin only, no exception."""
    found = {p.name: core_imports(p.read_text()) for p in sorted((ROOT / "plugins").glob("*.py"))}
    assert not any(found.values()), {k: v for k, v in found.items() if v}


def test_the_static_check_refuses_internals():
    source = (
        "from core import PluginConfig, hookimpl\nfrom core.plugin import RewardProgram\n"
        "import core.plugin\nfrom . import helpers\n"
        "def f():\n    from core.sandbox import prepare_reward\n"
        "from core import sandbox\nimport core.train.sac\nfrom core.train.sac import SACConfig\n"
    )
    refused = [
        "line 6: from core.sandbox import prepare_reward",
        "line 7: from core import sandbox",
        "line 8: import core.train.sac",
        "line 9: from core.train.sac import SACConfig",
    ]
    assert core_imports(source) == refused
