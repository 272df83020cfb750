"""Configs and the code they configure cannot drift apart.

- Every option of every config group composes, and its trainer / LLM node builds.
- Every plugin: ``conf/plugins/<name>.yaml`` holds exactly its ``Config`` dataclass's
  fields (nested sections too) with the same defaults, and every field is read by code
  (an attribute of that name is read in the plugin module outside the config's
  ``check``, or in ``core/`` for the base fields the core reads).
- The same for ``sandbox:`` (:class:`core.config.SandboxConfig`, read in ``core/``) and
  the top-level keys of ``conf/config.yaml`` (:class:`core.config.RunSettings`).
- Every option of every config group holds only fields of its group's schema (the
  trainer's dataclass, ``LLMSettings``, the executor kind's schema, ``TrackingConfig``,
  the task's constructor), with the schema's defaults where the group has one file.
- A value of the wrong type fails validation with one paragraph naming the key, the
  expected type and the value given.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from core.config import (
    EXECUTORS,
    GROUPS,
    PluginConfig,
    RunSettings,
    SandboxConfig,
    TrackingConfig,
    _options_schema,
    config_class,
    validate,
)
from core.errors import UserError
from core.registry import builtin_plugins, load_module
from core.resources import conf_dir
from core.train import get_trainer

CONFIG_GROUPS = ["env", "trainer", "llm", "executor", "tracking"]
CORE = Path(__file__).resolve().parents[1] / "core"


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


BUILTINS = {p.name: p for p in builtin_plugins() if p.status != "planned"}
PLUGIN_YAMLS = sorted(p.stem for p in (conf_dir() / "plugins").glob("*.yaml"))


# -------------------------------------------------------------------------------------
# helpers: schema fields, YAML values, attribute reads
# -------------------------------------------------------------------------------------


def _hints(cls: type) -> dict[str, Any]:
    import sys

    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _nested(hint: Any) -> type | None:
    """The dataclass a field holds (``Stages``, ``list[Rule]``'s ``Rule``), if any."""
    for candidate in (hint, *typing.get_args(hint)):
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def schema_classes(schema: type) -> set[type]:
    """``schema`` and every dataclass nested in its fields."""
    found = {schema}
    for f in dataclasses.fields(schema):
        inner = _nested(_hints(schema)[f.name])
        if inner is not None and inner not in found:
            found |= schema_classes(inner)
    return found


def field_paths(schema: type, prefix: str = "") -> dict[str, str]:
    """Dotted path -> field name, nested sections included (``stages.boundaries`` -> ``boundaries``)."""
    out = {}
    for f in dataclasses.fields(schema):
        out[prefix + f.name] = f.name
        inner = _nested(_hints(schema)[f.name])
        if inner is not None and not typing.get_args(_hints(schema)[f.name]):  # a section, not a list of records
            out.update(field_paths(inner, f"{prefix}{f.name}."))
    return out


def key_paths(node: Any, schema: type | None, prefix: str = "") -> list[str]:
    """Dotted keys of a YAML mapping, descending where the schema has a section."""
    out = []
    hints = _hints(schema) if schema is not None else {}
    for key, value in node.items():
        out.append(prefix + key)
        hint = hints.get(key)
        inner = _nested(hint) if hint is not None else None
        if isinstance(value, dict) and inner is not None and not typing.get_args(hint):
            out += key_paths(value, inner, f"{prefix}{key}.")
    return out


def defaults(schema: type) -> dict[str, Any]:
    return dataclasses.asdict(schema())


def plugin_yaml(name: str) -> dict[str, Any]:
    """A plugin's YAML values; its Hydra defaults list (e.g. rlingua's ``override /trainer``) is no config key."""
    node = yaml.safe_load((conf_dir() / "plugins" / f"{name}.yaml").read_text()) or {}
    node.pop("defaults", None)
    return node


def config_yaml() -> dict[str, Any]:
    return yaml.safe_load((conf_dir() / "config.yaml").read_text())


def attributes_read(
    source: str, skip_classes: set[str] = frozenset(), skip_methods: tuple[str, ...] = ("check",)
) -> set[str]:
    """Names read as attributes (``x.name``) in ``source``, outside the ``check`` methods of
    the classes ``skip_classes`` (validating a value is not using it)."""
    tree = ast.parse(source)
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name in skip_classes:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name in skip_methods:
                    skipped |= {id(n) for n in ast.walk(item)}
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and id(n) not in skipped}


@cache
def core_reads() -> frozenset[str]:
    names: set[str] = set()
    for path in CORE.rglob("*.py"):
        names |= attributes_read(path.read_text(), {"PluginConfig", "Limits", "RunSettings"})
    return frozenset(names)


def _numeric_field(schema: type) -> tuple[str, str] | None:
    """The first int or float field of ``schema`` and its type name."""
    for f in dataclasses.fields(schema):
        hint = _hints(schema)[f.name]
        if hint in (int, float):
            return f.name, hint.__name__
    return None


# -------------------------------------------------------------------------------------
# config groups
# -------------------------------------------------------------------------------------


@pytest.mark.parametrize("group", CONFIG_GROUPS)
def test_every_group_has_options(group):
    assert _options(group), f"conf/{group}/ is empty"


@pytest.mark.parametrize("group,option", [(g, o) for g in CONFIG_GROUPS for o in _options(g)])
def test_each_option_composes_and_builds(make_config, group, option):
    from core.llm.client import LLMSettings

    cfg = make_config([f"{group}={option}"])
    assert cfg[group] is not None
    trainer, trainer_config = get_trainer(cfg.trainer.get("name", "ppo"))
    built = trainer_config.from_config({k: v for k, v in cfg.trainer.items() if k != "name"})
    built.validate()
    assert built.frames == cfg.trainer.frames > 0
    assert LLMSettings.from_cfg(cfg.llm).model == cfg.llm.model
    settings = validate(cfg, {})
    assert settings.run.seed == cfg.seed
    assert settings.trainer == built and settings.llm == LLMSettings.from_cfg(cfg.llm)


def _group_schema(group: str, node: dict[str, Any]) -> type:
    if group == "trainer":
        return get_trainer(node.get("name", "ppo"))[1]
    if group == "llm":
        from core.llm.client import LLMSettings

        return LLMSettings
    if group == "executor":
        return EXECUTORS[node.get("kind", "local")]
    if group == "tracking":
        return TrackingConfig
    from core.envs import task_class

    return _options_schema(task_class(node["name"]))


@pytest.mark.parametrize("group,option", [(g, o) for g in CONFIG_GROUPS for o in _options(g)])
def test_each_group_option_holds_only_its_schemas_fields(group, option):
    node = yaml.safe_load((conf_dir() / group / f"{option}.yaml").read_text()) or {}
    schema = _group_schema(group, node)
    own = {"trainer": {"name"}, "env": {"name"}}.get(group, set())
    unknown = sorted(set(node) - own - {f.name for f in dataclasses.fields(schema)})
    assert not unknown, f"conf/{group}/{option}.yaml has keys {schema.__name__} does not declare: {unknown}"
    if len(_options(group)) == 1:  # one file: it is the schema's defaults
        expected = defaults(schema)
        assert {k: v for k, v in node.items() if v != expected[k]} == {}, (
            f"conf/{group}/{option}.yaml vs {schema.__name__}"
        )


@pytest.mark.parametrize(
    "overrides,key,type_name",
    [
        (["trainer.frames=abc"], "trainer.frames", "int"),
        (["llm.max_tokens=abc"], "llm.max_tokens", "int"),
        (["executor=ray", "executor.cpus_per_job=abc"], "executor.cpus_per_job", "float"),
        (["tracking.log_plots=abc"], "tracking.log_plots", "bool"),
        (["env.max_episode_steps=abc"], "env.max_episode_steps", "int"),
    ],
)
def test_bad_group_values_are_refused_in_one_paragraph(make_config, overrides, key, type_name):
    with pytest.raises(UserError) as err:
        validate(make_config(overrides), {})
    message = str(err.value)
    assert key in message and type_name in message and "'abc'" in message, message
    assert "\n" not in message.strip()


@pytest.mark.parametrize(
    "override,key,closest",
    [
        ("+executor.worker=2", "executor.worker", "workers"),
        ("+llm.max_token=3", "llm.max_token", "max_tokens"),
        ("+trainer.lrr=0.1", "trainer.lrr", "lr"),
        ("+env.max_episode_step=9", "env.max_episode_step", "max_episode_steps"),
    ],
)
def test_an_unknown_group_key_names_the_closest_one(make_config, override, key, closest):
    with pytest.raises(UserError, match=rf"Unknown config key '{key}'\. Did you mean '{closest}'"):
        validate(make_config([override]), {})


def test_a_value_a_groups_check_refuses_is_one_paragraph(make_config):
    with pytest.raises(
        UserError, match=r"executor.*workers must be 'auto' or a positive number of workers, got 'lots'"
    ):
        validate(make_config(["executor.workers=lots"]), {})


# -------------------------------------------------------------------------------------
# plugins
# -------------------------------------------------------------------------------------


def test_every_builtin_plugin_has_a_config_file():
    assert sorted(BUILTINS) == PLUGIN_YAMLS


@pytest.mark.parametrize("plugin", PLUGIN_YAMLS)
def test_each_plugin_config_lands_under_its_name_and_validates(make_config, plugin):
    cfg = make_config([f"+plugins=[{plugin}]"])
    assert list(cfg.plugins) == [plugin]
    module = load_module(BUILTINS[plugin])
    assert validate(cfg, {plugin: module}).plugins[plugin] == config_class(module)()


@pytest.mark.parametrize("plugin", PLUGIN_YAMLS)
def test_plugin_yaml_holds_exactly_the_schema_with_its_defaults(plugin):
    schema = config_class(load_module(BUILTINS[plugin]))
    assert schema is not PluginConfig, f"{plugin} declares no Config dataclass"
    node = plugin_yaml(plugin)
    assert sorted(key_paths(node, schema)) == sorted(field_paths(schema)), (
        f"conf/plugins/{plugin}.yaml and {schema.__module__}.Config differ in keys"
    )
    expected = defaults(schema)
    different = {k: (node[k], expected[k]) for k in expected if node.get(k) != expected[k]}
    assert not different, f"YAML value vs Config default differ for {plugin}: {different}"


@pytest.mark.parametrize("plugin", PLUGIN_YAMLS)
def test_every_plugin_config_field_is_read_by_code(plugin):
    module = load_module(BUILTINS[plugin])
    schema = config_class(module)
    classes = schema_classes(schema)
    reads = attributes_read(inspect.getsource(module), {c.__name__ for c in classes})
    base = {f.name for f in dataclasses.fields(PluginConfig)}
    unread = [
        path
        for path, name in field_paths(schema).items()
        if name not in reads and not (name in base and name in core_reads())
    ]
    assert not unread, f"{plugin}: no code reads {unread} (an attribute of that name, outside Config.check)"


@pytest.mark.parametrize("plugin", PLUGIN_YAMLS)
def test_a_value_of_the_wrong_type_is_refused_in_one_paragraph(make_config, plugin):
    module = load_module(BUILTINS[plugin])
    found = _numeric_field(config_class(module))
    if found is None:
        pytest.skip(f"{plugin} has no numeric field")
    key, type_name = found
    cfg = make_config([f"+plugins=[{plugin}]", f"plugins.{plugin}.{key}=abc"])
    with pytest.raises(UserError) as err:
        validate(cfg, {plugin: module})
    message = str(err.value)
    assert f"plugins.{plugin}.{key}" in message and type_name in message and "'abc'" in message, message
    assert "\n" not in message.strip()


def test_two_plugins_merge(make_config):
    cfg = make_config([f"+plugins=[{PLUGIN_YAMLS[0]},{PLUGIN_YAMLS[1]}]"])
    assert set(cfg.plugins) == {PLUGIN_YAMLS[0], PLUGIN_YAMLS[1]}


# -------------------------------------------------------------------------------------
# sandbox and the run's own keys
# -------------------------------------------------------------------------------------


def test_sandbox_yaml_holds_exactly_the_schema_with_its_defaults():
    node = config_yaml()["sandbox"]
    assert sorted(node) == sorted(f.name for f in dataclasses.fields(SandboxConfig))
    assert node == defaults(SandboxConfig)


def test_every_sandbox_key_is_read_in_core():
    unread = [f.name for f in dataclasses.fields(SandboxConfig) if f.name not in core_reads()]
    assert not unread, f"sandbox keys no code in core/ reads: {unread}"


def test_top_level_yaml_keys_are_the_run_settings_with_their_defaults():
    node = {k: v for k, v in config_yaml().items() if k != "defaults" and k not in GROUPS}
    assert sorted(node) == sorted(f.name for f in dataclasses.fields(RunSettings))
    expected = defaults(RunSettings)
    different = {
        k: (v, expected[k])
        for k, v in node.items()
        if k != "sandbox" and not (isinstance(v, str) and v.startswith("${")) and v != expected[k]
    }
    assert not different, f"conf/config.yaml vs RunSettings defaults: {different}"


def test_every_run_setting_is_read_in_core():
    unread = [f.name for f in dataclasses.fields(RunSettings) if f.name not in core_reads()]
    assert not unread, f"top-level keys no code in core/ reads: {unread}"


@pytest.mark.parametrize(
    "override,key,type_name",
    [
        ("seed=abc", "config.seed", "int"),
        ("sandbox.cpu_s=abc", "sandbox.cpu_s", "float"),
        ("sandbox.per_row_fallback=abc", "sandbox.per_row_fallback", "bool"),
    ],
)
def test_bad_core_values_are_refused_in_one_paragraph(make_config, override, key, type_name):
    with pytest.raises(UserError) as err:
        validate(make_config([override]), {})
    message = str(err.value)
    assert key in message and type_name in message and "'abc'" in message, message
    assert "\n" not in message.strip()


def test_an_unknown_plugin_key_names_the_closest_one(make_config):
    cfg = make_config(["+plugins=[eureka]", "+plugins.eureka.sample=3"])
    with pytest.raises(UserError, match=r"plugins\.eureka\.sample.*Did you mean 'samples'"):
        validate(cfg, {"eureka": load_module(BUILTINS["eureka"])})
