"""Every config group option composes, and the composed trainer config builds (catches drift)."""

from __future__ import annotations

import pytest

from core.resources import conf_dir
from core.train import get_trainer

GROUPS = ["env", "trainer", "llm", "executor", "tracking"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (conf_dir() / group).glob("*.yaml"))


@pytest.mark.parametrize("group", GROUPS)
def test_every_group_has_options(group):
    assert _options(group), f"conf/{group}/ is empty"


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_each_option_composes(make_config, group, option):
    cfg = make_config([f"{group}={option}"])
    assert cfg[group] is not None
    assert cfg.trainer.frames > 0
    trainer, config_class = get_trainer(cfg.trainer.get("name", "ppo"))
    built = config_class.from_config({k: v for k, v in cfg.trainer.items() if k != "name"})
    assert built.frames == cfg.trainer.frames


@pytest.mark.parametrize("plugin", sorted(p.stem for p in (conf_dir() / "plugins").glob("*.yaml")))
def test_each_plugin_config_lands_under_its_name(make_config, plugin):
    cfg = make_config([f"+plugins=[{plugin}]"])
    assert list(cfg.plugins) == [plugin]


def test_two_plugins_merge(make_config):
    plugins = sorted(p.stem for p in (conf_dir() / "plugins").glob("*.yaml"))
    if len(plugins) < 2:
        pytest.skip("needs two plugin configs")  # becomes active as plugins land
    cfg = make_config([f"+plugins=[{plugins[0]},{plugins[1]}]"])
    assert set(cfg.plugins) == {plugins[0], plugins[1]}
