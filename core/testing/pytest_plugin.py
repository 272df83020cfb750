"""The testing kit's pytest plugin: the ``make_config`` fixture, for a test suite's own tests.

Opt in from the suite's root ``conftest.py``, as pytest's own ``pytester`` is enabled::

    pytest_plugins = ["core.testing.pytest_plugin"]

(this repository's ``tests/conftest.py`` does). :class:`core.testing.PluginContract`
does not need it: the contract carries the same fixture. It is not registered through a
``pytest11`` entry point on purpose: pytest would then load it in every run of any
environment where llm4rl is installed, and rewrite the asserts of every module of the
distribution (all of ``core`` and ``plugins``), changing the framework's own namespaces
and errors under test. Loading it is cheap: Hydra and the framework are imported when a
test asks for the fixture.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable

import pytest


def compose_config(overrides: list[str], tmp_path: Path) -> Any:
    """The run config (a ``DictConfig``) for ``overrides``, tracking and caches redirected
    into ``tmp_path``. Installed third-party plugins get their config node first, as
    ``python -m core`` gives them, so ``+plugins=[name]`` composes for them too."""
    from hydra import compose, initialize_config_dir
    from omegaconf import open_dict

    from core.app import register_third_party_configs
    from core.resources import conf_dir

    register_third_party_configs()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.tracking.uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        cfg.tracking.artifact_location = str(tmp_path / "mlartifacts")
        cfg.cache_dir = str(tmp_path / "cache")
        cfg.progress = False
    return cfg


@pytest.fixture
def make_config(tmp_path: Path) -> Callable[[Iterable[str]], Any]:
    """``make_config(["env=cartpole", ...])`` -> a composed, test-isolated DictConfig."""

    def make(overrides: Iterable[str] = ()) -> Any:
        return compose_config(list(overrides), tmp_path)

    return make


def pytest_configure(config: pytest.Config) -> None:
    # contract.params marks long smoke runs slow; a suite using the plugin gets the marker declared
    config.addinivalue_line("markers", "slow: a long end-to-end run (llm4rl's plugin contract marks long smoke runs)")
