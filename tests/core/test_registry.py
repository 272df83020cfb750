from __future__ import annotations

import pytest

from core import hookimpl
from core.errors import UserError
from core.registry import builtin_plugins, catalogue, check_names, make_plugin_manager

MISSION = {"eureka", "text2reward", "lares", "progress_reward", "rlaif_preference", "envgen", "llm_state_repr", "rl_gpt"}


def test_catalogue_lists_every_mission_plugin_with_role_and_paper():
    plugins = {p.name: p for p in builtin_plugins()}
    assert MISSION <= set(plugins)
    assert plugins["eureka"].module == "plugins.eureka_reward"
    for info in plugins.values():
        assert info.roles, info.name
        assert info.paper.get("title"), info.name
        assert info.module.startswith("plugins."), info.name


def test_unknown_plugin_names_the_available_ones():
    with pytest.raises(UserError) as err:
        check_names(["eurekaa"])
    message = str(err.value)
    assert "Unknown plugin 'eurekaa'" in message
    assert "Did you mean 'eureka'" in message
    for name in MISSION:
        assert name in message


def test_plugin_manager_registers_extra_objects_and_checks_hook_names():
    class Good:
        @hookimpl
        def on_run_start(self, run):
            run.append("seen")

    pm = make_plugin_manager(extra=[Good()])
    seen: list[str] = []
    pm.hook.on_run_start(run=seen)
    assert seen == ["seen"]

    class Misspelt:
        @hookimpl
        def propose_reward(self, run):  # the spec is propose_rewards
            return None

    with pytest.raises(UserError, match="implements 'propose_reward', which is not a hook. Did you mean 'propose_rewards'"):
        make_plugin_manager(extra=[Misspelt()])


def test_catalogue_contains_builtins_first():
    names = list(catalogue())
    assert names[: len(MISSION)] == [p.name for p in builtin_plugins()][: len(MISSION)]
