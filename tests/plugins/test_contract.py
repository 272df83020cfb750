"""Every registered plugin keeps the plugin contract (:mod:`contract`).

The plugins are the catalogue's: the built-ins of ``registry.yaml`` and any third-party
plugin installed under the entry-point group ``llm4rl.plugins``. Each gets the same
checks: it imports, keeps no module-level state, its config composes and validates, its
hooks match the specs (and, for a built-in, its registry entry), a built-in's docs page
names its config keys, and a tiny in-process run with the shared fake LLM trains with
what the LLM wrote. Smoke runs over ~20 s are marked ``slow``.
"""

from __future__ import annotations

from typing import Any

import pytest

from core.registry import PluginInfo, catalogue
from core.testing.contract import PluginContract, params

PLUGINS = [name for name, info in catalogue().items() if info.implemented]


def pytest_generate_tests(metafunc: Any) -> None:
    if "plugin_name" in metafunc.fixturenames:
        metafunc.parametrize("plugin_name", params(PLUGINS, metafunc.function))


@pytest.fixture
def info(plugin_name: str) -> PluginInfo:
    return catalogue()[plugin_name]


class TestPluginContract(PluginContract):
    """Built-in and installed third-party plugins."""


def test_every_builtin_plugin_is_checked():
    from core.registry import builtin_plugins

    assert {p.name for p in builtin_plugins() if p.status != "planned"} <= set(PLUGINS)
