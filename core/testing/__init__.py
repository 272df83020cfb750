"""llm4rl's testing kit: the plugin contract and the fake LLM, installed with the package.

As pytest ships ``pytester`` for plugin authors, llm4rl ships the checks its built-in
plugins pass, so that a third-party package runs the same ones::

    import pytest

    from core.testing import PluginContract, plugin_info


    class TestMyBonus(PluginContract):
        @pytest.fixture
        def info(self):
            return plugin_info("my_bonus")

- :mod:`core.testing.contract`: :class:`PluginContract` (imports, only ``core.plugin``
  from the framework, no module-level state, config composes and validates, hooks match
  the specs, a tiny run trains with the LLM's output), :func:`plugin_info`, :func:`params`.
- :mod:`core.testing.fakes`: the fake LLM (:class:`ScriptedLLM` for a unit test,
  :func:`install_fake_litellm` + :data:`FAKE_LLM_OVERRIDES` for a whole run) and the
  contexts a hook receives (:func:`make_run`, :func:`make_train`, :func:`plugin_object`).
- :mod:`core.testing.pytest_plugin`: the ``make_config`` fixture for a suite's other
  tests (``pytest_plugins = ["core.testing.pytest_plugin"]`` in its root conftest; the
  contract carries its own).

The kit needs pytest, a test dependency: ``pip install llm4rl[test]``. Nothing else under
``core`` imports it. The names below load on first access (the contract and the fakes
import torch and the LLM client; the pytest plugin loads with a suite's conftest).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

try:
    import pytest
except ImportError as err:
    raise ImportError("core.testing needs pytest, a test dependency of llm4rl: pip install 'llm4rl[test]'") from err

# the contract's checks are plain asserts: pytest explains them as in a test module (before they import)
pytest.register_assert_rewrite("core.testing.contract", "core.testing.fakes")

if TYPE_CHECKING:
    from core.testing.contract import (
        EVIDENCE as EVIDENCE,
        PPO_TINY as PPO_TINY,
        SMOKE as SMOKE,
        SMOKE_BASE as SMOKE_BASE,
        PluginContract as PluginContract,
        Recorder as Recorder,
        Smoke as Smoke,
        params as params,
        plugin_info as plugin_info,
        some_training_succeeded as some_training_succeeded,
    )
    from core.testing.fakes import (
        CUT_OFF as CUT_OFF,
        FAKE_LLM_OVERRIDES as FAKE_LLM_OVERRIDES,
        MARK as MARK,
        FakeLiteLLM as FakeLiteLLM,
        Logged as Logged,
        ScriptedLLM as ScriptedLLM,
        answer as answer,
        install_fake_litellm as install_fake_litellm,
        make_run as make_run,
        make_train as make_train,
        plugin_object as plugin_object,
        settings_for as settings_for,
    )
    from core.testing.pytest_plugin import compose_config as compose_config

#: public name -> the submodule defining it
_EXPORTS = {
    **dict.fromkeys(
        [
            "PluginContract",
            "Recorder",
            "Smoke",
            "params",
            "plugin_info",
            "some_training_succeeded",
            "SMOKE",
            "SMOKE_BASE",
            "PPO_TINY",
            "EVIDENCE",
        ],
        "core.testing.contract",
    ),
    **dict.fromkeys(
        [
            "ScriptedLLM",
            "FakeLiteLLM",
            "Logged",
            "answer",
            "install_fake_litellm",
            "make_run",
            "make_train",
            "plugin_object",
            "settings_for",
            "CUT_OFF",
            "FAKE_LLM_OVERRIDES",
            "MARK",
        ],
        "core.testing.fakes",
    ),
    "compose_config": "core.testing.pytest_plugin",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'core.testing' has no attribute {name!r}")
