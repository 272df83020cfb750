"""core/config.py: the reuse key covers every module that shapes a candidate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import core.config


@pytest.fixture
def core_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the core package that ``framework_hash`` reads instead of the real one."""
    root = tmp_path / "core"
    shutil.copytree(core.config.CORE_ROOT, root, ignore=shutil.ignore_patterns("__pycache__", "conf"))
    monkeypatch.setattr(core.config, "CORE_ROOT", root)
    return root


@pytest.mark.parametrize(
    "module",
    [
        "prompting.py",
        "vetting.py",
        "preflight.py",
        "loop.py",
        "codegen.py",
        "llm/client.py",
        "llm/embedded.py",
        "sandbox/host.py",
        "train/ppo.py",
        "envs/classic.py",
        "records.py",
    ],
)
def test_an_edit_to_a_module_that_shapes_candidates_changes_the_key(core_copy: Path, module: str) -> None:
    before = core.config.framework_hash()
    path = core_copy / module
    path.write_text(path.read_text() + "\n# an edit\n")
    assert core.config.framework_hash() != before


def test_an_edit_to_the_report_keeps_the_key(core_copy: Path) -> None:
    before = core.config.framework_hash()
    path = core_copy / "report" / "render.py"
    path.write_text(path.read_text() + "\n# an edit\n")
    assert core.config.framework_hash() == before


def test_a_bad_value_says_where_to_set_it_and_a_third_party_plugin_has_no_yaml_file():
    """A third-party plugin's errors said "Set it in the YAML file", where it ships none."""
    from dataclasses import dataclass

    from core.config import PluginConfig, typed
    from core.errors import UserError

    @dataclass
    class Config(PluginConfig):
        samples: int = 1

        def check(self) -> None:
            super().check()
            if self.samples < 1:
                raise ValueError("samples must be >= 1")

    for node, where in (({"samples": "many"}, "plugins.llm4rl_hello"), ({"samples": 0}, "plugins.llm4rl_hello")):
        with pytest.raises(UserError) as err:
            typed(Config, node, where)
        assert "YAML file" not in str(err.value).replace("has no YAML file here", "")
        assert "on the command line; plugin 'llm4rl_hello' has no YAML file here" in str(err.value)
    with pytest.raises(UserError) as err:
        typed(Config, {"samples": "many"}, "plugins.eureka")  # a shipped plugin: its file is named
    assert "Set it in conf/plugins/eureka.yaml or on the command line, e.g. plugins.eureka.samples=<int>." in str(
        err.value
    )
