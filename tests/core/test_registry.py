from __future__ import annotations

import pytest

from core import hookimpl
from core.errors import UserError
from core.hookspecs import hookspec
from core.registry import builtin_plugins, catalogue, check_names, make_plugin_manager

MISSION = {
    "eureka",
    "text2reward",
    "lares",
    "progress_reward",
    "rlaif_preference",
    "envgen",
    "llm_state_repr",
    "rl_gpt",
}


def test_catalogue_lists_every_mission_plugin_with_role_and_paper():
    plugins = {p.name: p for p in builtin_plugins()}
    assert MISSION <= set(plugins)
    assert plugins["eureka"].module == "plugins.eureka_reward"
    for info in plugins.values():
        assert info.roles, info.name
        assert info.paper.get("title"), info.name
        assert info.status in ("implemented", "planned"), info.name
        if info.status != "planned":
            assert info.module.startswith("plugins."), info.name


#: every method the paper index describes, by the name of its entry
INDEX = MISSION | {
    "ellm",
    "plan4mc",
    "saycan",
    "rlingua",
    "lgts",
    "quadruped_llm",
    "calm",
    "language_to_rewards",
    "state2explanation",
    "octopus",
}
ROLES = {"reward", "state", "action", "planning", "environment", "preference"}


def test_the_whole_paper_index_is_in_the_registry_with_a_role_each():
    plugins = {p.name: p for p in builtin_plugins()}
    assert INDEX <= set(plugins), sorted(INDEX - set(plugins))
    assert all(set(p.roles) <= ROLES for p in plugins.values())
    assert {r for p in plugins.values() for r in p.roles} == ROLES  # every role of the taxonomy is represented


def test_planned_entries_need_no_module_are_listed_and_refused_clearly(capsys):
    from core.registry import main, taxonomy_text

    planned = [p for p in builtin_plugins() if p.status == "planned"]
    assert planned and any(not p.module for p in planned)
    for info in planned:
        assert not info.implemented and not info.installed
    with pytest.raises(UserError, match="'lgts' is planned but not implemented yet"):
        check_names(["lgts"])
    text = taxonomy_text(catalogue().values())
    planning = next(line for line in text.splitlines() if line.strip().startswith("planning"))
    done, left = planning.split("|")
    assert "plan4mc" in done and "ellm" in done and "lgts" in left and "octopus" in left
    assert main([]) == 0
    out = capsys.readouterr().out
    assert "By role" in out and "lgts" in out


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

    with pytest.raises(
        UserError, match="implements 'propose_reward', which is not a hook. Did you mean 'propose_rewards'"
    ):
        make_plugin_manager(extra=[Misspelt()])


class Owner:
    """A plugin that adds a hook of its own (``HOOKSPECS``) and asks it."""

    class HOOKSPECS:
        @hookspec(firstresult=True)
        def pick_colour(self, run, options):
            """The colour to use, of ``options``; stops at the first non-None."""

    @hookimpl
    def on_run_start(self, run):
        run.append(self.hook.pick_colour(run=run, options=["red", "blue"]))


class Answers:
    @hookimpl(optionalhook=True)  # loads without the owner too
    def pick_colour(self, options):
        return options[-1]


def test_a_plugin_adds_its_own_hook_which_other_plugins_answer():
    owner = Owner()
    pm = make_plugin_manager(extra=[owner, Answers()])
    owner.hook = pm.hook
    seen: list[str] = []
    pm.hook.on_run_start(run=seen)
    assert seen == ["blue"]
    make_plugin_manager(extra=[Answers()])  # the owner is not in this run: the answer waits unused

    class Misspelt:
        @hookimpl
        def pick_colour(self, option):
            return None

    with pytest.raises(UserError, match="'pick_colour' takes argument.*'option'.*Did you mean 'options'"):
        make_plugin_manager(extra=[Owner(), Misspelt()])
    with pytest.raises(UserError, match="implements 'pick_colour', which is not a hook"):
        make_plugin_manager(extra=[Misspelt()])


def test_the_core_specs_hold_only_hooks_the_core_calls():
    """``label_preferences`` is rlaif_preference's own hook: the plugin adds it, the core spec does not hold it."""
    from core import hookspecs
    from plugins import rlaif_preference

    assert not hasattr(hookspecs, "label_preferences")
    pm = make_plugin_manager(modules={"rlaif_preference": rlaif_preference})
    assert pm.hook.label_preferences.spec.opts["firstresult"]
    assert "label_preferences" in {c.name for c in pm.get_hookcallers(pm.get_plugin("rlaif_preference"))}


def test_catalogue_contains_builtins_first():
    names = list(catalogue())
    assert names[: len(MISSION)] == [p.name for p in builtin_plugins()][: len(MISSION)]


def test_a_method_named_like_a_hook_without_the_marker_is_warned_about():
    class Forgot:
        def propose_rewards(self, run, iteration):  # no @hookimpl: pluggy would never call it
            return []

        @hookimpl
        def on_run_start(self, run):
            return None

    with pytest.warns(UserWarning, match="propose_rewards named like hook.*not marked @hookimpl"):
        make_plugin_manager(extra=[Forgot()])


def test_the_catalogue_flags_a_plugin_whose_hooks_fail_validation_and_fits_100_columns(tmp_path, monkeypatch, capsys):
    from core import registry

    (tmp_path / "misspelt_plugin.py").write_text(
        '"""A plugin with a misspelt hook."""\nfrom core import hookimpl\n\n\n'
        "@hookimpl\ndef propose_reward(run):\n    return []\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    extra = registry.PluginInfo(name="misspelt", module="misspelt_plugin", roles=["reward"], source="tests")
    real = registry.catalogue
    monkeypatch.setattr(registry, "catalogue", lambda: {**real(), "misspelt": extra})
    assert registry.main(["--width", "100"]) == 1  # a plugin fails validation: the exit status says so
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if line.lstrip().startswith("misspelt"))
    assert "invalid" in row and "eureka" in out and "plugins.eureka_reward" in out  # module names whole
    flat = " ".join(out.split())  # the problem is wrapped at the width
    assert "misspelt: Plugin 'misspelt'" in flat and "Did you mean 'propose_rewards'" in flat
    assert max(len(line) for line in out.splitlines()) <= 100


def test_registry_help_explains_the_command(capsys):
    from core.registry import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0 and "List the llm4rl plugins" in capsys.readouterr().out
