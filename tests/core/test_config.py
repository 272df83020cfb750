"""core/config.py: the reuse key covers every module that shapes a candidate."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

import core
import core.config


@pytest.fixture
def core_copy(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A copy of the core package that ``framework_hash`` reads instead of the real one."""
    root = tmp_path / "core"
    shutil.copytree(Path(core.__file__).parent, root, ignore=shutil.ignore_patterns("__pycache__", "conf"))
    monkeypatch.setattr(core, "__file__", str(root / "__init__.py"))
    return root


@pytest.mark.parametrize("module", ["prompting.py", "vetting.py", "preflight.py", "loop.py", "codegen.py",
                                    "llm/client.py", "llm/embedded.py", "sandbox/host.py", "train/ppo.py",
                                    "envs/classic.py", "records.py"])
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
