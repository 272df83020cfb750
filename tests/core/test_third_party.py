"""Third-party plugins: discovered through entry points, configured, validated, trained, reported.

Nothing is installed into the active environment: :func:`site_dir` copies a fixture
package into ``tmp_path`` beside a ``*.dist-info`` folder (``METADATA`` and
``entry_points.txt`` from its ``pyproject.toml``), which is what ``pip install`` leaves
behind. In-process tests prepend that folder to ``sys.path`` for the test only
(:func:`on_path`); subprocesses get it through ``PYTHONPATH``.

The fixtures:

- ``tests/fixtures/llm4rl_hello``: one module recording which hooks ran.
- ``tests/fixtures/llm4rl_count_bonus``: the package of the third-party trial in issue 13,
  written only with the API of ``docs/writing-a-plugin.md``: ``count_bonus`` (a
  count-based exploration bonus on ``compute_reward``, config ``beta: float``) and
  ``fourier_features`` (random Fourier features on ``represent_state``).
- the smallest plugin of ``docs/writing-a-plugin.md``, extracted from the page, with
  the test file of its section *Testing your plugin*: run by pytest in a subprocess
  from ``tmp_path``, outside the repository, it keeps the contract through the
  installed testing kit (:mod:`core.testing`) alone.

Both fixture packages also keep the shared plugin contract
(:class:`core.testing.PluginContract`).
"""

from __future__ import annotations

import os
import re
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any, Iterator

import pytest
import tomllib

from core.config import validate
from core.errors import UserError
from core.registry import PluginInfo, catalogue, load_module
from core.testing import fakes
from core.testing.cli import run_cli
from core.testing.contract import PluginContract, Recorder, params

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
HELLO = FIXTURES / "llm4rl_hello"
COUNT_BONUS = FIXTURES / "llm4rl_count_bonus"
GUIDE = ROOT / "docs" / "writing-a-plugin.md"

#: plugin name -> the fixture package providing it
PROVIDERS = {"hello": HELLO, "count_bonus": COUNT_BONUS, "fourier_features": COUNT_BONUS}


# -------------------------------------------------------------------------------------
# Putting a package on the path, the way pip would leave it, for one test
# -------------------------------------------------------------------------------------


def site_dir(project: Path, dest: Path) -> Path:
    """``dest`` holding the project's modules and a ``<name>-<version>.dist-info`` built
    from its ``pyproject.toml`` (``[project]`` name/version/entry-points and
    ``[tool.setuptools]`` ``py-modules`` / ``packages``)."""
    meta = tomllib.loads((project / "pyproject.toml").read_text())
    info, tool = meta["project"], meta.get("tool", {}).get("setuptools", {})
    dest.mkdir(parents=True, exist_ok=True)
    for module in tool.get("py-modules", []):
        shutil.copy(project / f"{module}.py", dest / f"{module}.py")
    for package in tool.get("packages", []):
        shutil.copytree(project / package.replace(".", "/"), dest / package.replace(".", "/"), dirs_exist_ok=True)
    dist = dest / f"{info['name'].replace('-', '_')}-{info['version']}.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {info['name']}\nVersion: {info['version']}\n")
    lines = []
    for group, eps in info.get("entry-points", {}).items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dest


@pytest.fixture
def on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """``on_path(project)``: the project importable and its entry points visible in this
    process until the test ends (modules, sys.path and Hydra config nodes restored)."""
    from hydra.core.config_store import ConfigStore

    modules_before = set(sys.modules)
    repo = ConfigStore.instance().repo
    plugin_nodes_before = set(repo.get("plugins", {}))

    def put(project: Path) -> Path:
        site = site_dir(project, tmp_path / "site" / project.name)
        monkeypatch.syspath_prepend(str(site))
        from core.app import register_third_party_configs

        register_third_party_configs()  # what `python -m core` does before composing
        return site

    yield put
    for name in set(sys.modules) - modules_before:
        if name.startswith(("llm4rl_", "my_bonus")):
            del sys.modules[name]
    for name in set(repo.get("plugins", {})) - plugin_nodes_before:
        del repo["plugins"][name]


def env_with(*sites: Path) -> dict[str, str]:
    """The environment for a subprocess that sees ``sites`` (and only them) as installed."""
    env = {k: v for k, v in os.environ.items() if k != "LLM4RL_DISABLE_PLUGIN_AUTOLOAD"}
    env["PYTHONPATH"] = os.pathsep.join([*map(str, sites), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"
    return env


def tiny(tmp_path: Path, frames: int = 1024) -> list[str]:
    """Overrides for a tiny run; :func:`run_cli` in ``tmp_path`` keeps its records there, and
    a sweep's runs go there too."""
    return [
        f"trainer.frames={frames}",
        "trainer.eval_every=0",
        "trainer.eval_episodes=2",
        "executor=inprocess",
        "progress=false",
        "save_policy=false",
        f"hydra.sweep.dir={tmp_path}/multirun",
    ]


# -------------------------------------------------------------------------------------
# The shared contract, for the fixture packages
# -------------------------------------------------------------------------------------


def count_bonus_trained(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    ok = [r for _, r in rec.trained if r.ok and r.metrics.get("count_bonus/cells", 0) > 0]
    return "" if ok else "no training counted a visited cell"


def hello_seen(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    return "" if any(r.ok and r.metrics.get("hello/seen") == 1.0 for _, r in rec.trained) else "on_train_end never ran"


def pytest_generate_tests(metafunc: Any) -> None:
    if "plugin_name" in metafunc.fixturenames:
        metafunc.parametrize("plugin_name", params(list(PROVIDERS), metafunc.function))


class TestFixturePluginsKeepTheContract(PluginContract):
    """The fixture packages pass the same contract as the built-ins."""

    @pytest.fixture
    def info(self, plugin_name: str, on_path: Any) -> PluginInfo:
        on_path(PROVIDERS[plugin_name])
        return catalogue()[plugin_name]

    def evidence(self, info: PluginInfo) -> Any:
        return {"count_bonus": count_bonus_trained, "hello": hello_seen}.get(info.name, super().evidence(info))


# -------------------------------------------------------------------------------------
# Discovery and validation
# -------------------------------------------------------------------------------------


def test_site_dir_is_what_pip_leaves(on_path):
    from importlib.metadata import distribution, entry_points

    on_path(COUNT_BONUS)
    assert distribution("llm4rl-count-bonus").version == "0.1.0"
    eps = {ep.name: ep.value for ep in entry_points(group="llm4rl.plugins")}
    assert eps["count_bonus"] == "llm4rl_count_bonus.count_bonus"
    assert eps["fourier_features"] == "llm4rl_count_bonus.fourier"


def test_the_fixture_is_gone_after_the_test():
    from importlib.metadata import entry_points

    assert not [ep for ep in entry_points(group="llm4rl.plugins") if ep.name in PROVIDERS]
    assert "count_bonus" not in catalogue() and "hello" not in catalogue()


def test_third_party_plugins_are_in_the_catalogue_with_their_distribution(on_path):
    on_path(COUNT_BONUS)
    plugins = catalogue()
    assert plugins["count_bonus"].source == "llm4rl-count-bonus"
    assert plugins["count_bonus"].roles == ["reward"]
    assert plugins["count_bonus"].hooks == ["compute_reward", "on_rollout", "on_train_end"]
    assert plugins["fourier_features"].hooks == ["represent_state"]


def test_bad_config_value_is_refused_in_one_paragraph(on_path, make_config):
    on_path(COUNT_BONUS)
    cfg = make_config(["+plugins=[count_bonus]", "plugins.count_bonus.beta=abc"])
    with pytest.raises(UserError) as err:
        validate(cfg, {"count_bonus": load_module(catalogue()["count_bonus"])})
    message = str(err.value)
    assert "'plugins.count_bonus.beta'" in message and "float" in message and "'abc'" in message
    assert "\n" not in message


def test_a_value_its_check_refuses_is_refused_before_any_work(on_path, make_config):
    on_path(COUNT_BONUS)
    cfg = make_config(["+plugins=[count_bonus]", "plugins.count_bonus.beta=-1"])
    with pytest.raises(UserError, match=r"plugins\.count_bonus.*beta must be >= 0, got -1"):
        validate(cfg, {"count_bonus": load_module(catalogue()["count_bonus"])})


def test_registry_lists_the_third_party_plugin(tmp_path):
    site = site_dir(HELLO, tmp_path / "site")
    out = run_cli(tmp_path, module="core.registry", env=env_with(site), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "hello" in out.stdout
    assert "llm4rl_hello" in out.stdout
    assert "llm4rl-hello" in out.stdout  # the distribution that provides it


def test_cli_refuses_a_bad_value_in_one_paragraph(tmp_path):
    site = site_dir(COUNT_BONUS, tmp_path / "site")
    out = run_cli(
        tmp_path, "+plugins=[count_bonus]", "plugins.count_bonus.beta=abc", *tiny(tmp_path), env=env_with(site)
    )
    assert out.returncode == 2, out.stdout + out.stderr
    text = " ".join(out.stderr.split())
    assert "error: Invalid value for 'plugins.count_bonus.beta': expected float, got 'abc'" in text, out.stderr
    assert "Traceback" not in out.stderr and "\n\n" not in out.stderr.strip()
    assert not (tmp_path / "mlflow.db").exists(), "validation comes before any work"


# -------------------------------------------------------------------------------------
# End to end through the command line (slow)
# -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_enabled_third_party_plugin_hooks_run(tmp_path):
    site = site_dir(HELLO, tmp_path / "site")
    marker = tmp_path / "marker.txt"
    out = run_cli(
        tmp_path,
        "+plugins=[hello]",
        f"plugins.hello.marker={marker}",
        *tiny(tmp_path, 2048),
        env=env_with(site),
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    lines = marker.read_text().splitlines()
    assert lines[0] == "on_run_start"
    assert lines[1].startswith("on_train_end ")
    assert int(lines[1].split()[1]) >= 2048


@pytest.mark.slow
def test_the_trial_package_trains_and_its_config_reaches_mlflow(tmp_path):
    site = site_dir(COUNT_BONUS, tmp_path / "site")
    out = run_cli(
        tmp_path,
        "+plugins=[count_bonus,fourier_features]",
        "plugins.count_bonus.beta=0.2",
        *tiny(tmp_path),
        env=env_with(site),
        timeout=600,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        params = dict(db.execute("SELECT key, value FROM params"))
        metrics = {k for (k,) in db.execute("SELECT DISTINCT key FROM metrics")}
    assert params.get("plugins.count_bonus.beta") == "0.2", sorted(params)
    assert params.get("plugins.fourier_features.features") == "8"
    assert "count_bonus/cells" in metrics and "fitness" in metrics


@pytest.mark.slow
def test_an_ablation_study_and_its_report(tmp_path):
    site = site_dir(COUNT_BONUS, tmp_path / "site")
    env = env_with(site)
    study = run_cli(
        tmp_path,
        "-m",
        "+plugins=[count_bonus],[]",
        "seed=0,1",
        "experiment=bonus_ablation",
        *tiny(tmp_path),
        env=env,
        timeout=600,
    )
    assert study.returncode == 0, study.stdout + study.stderr
    report = run_cli(
        tmp_path,
        "--experiment",
        "bonus_ablation",
        "--uri",
        f"sqlite:///{tmp_path}/mlflow.db",
        "--out",
        str(tmp_path / "report"),
        "--reps",
        "200",
        "--no-log",
        module="core.report",
        env=env,
        timeout=600,
    )
    assert report.returncode == 0, report.stdout + report.stderr
    text = (tmp_path / "report" / "report.md").read_text()
    for arm in ("count_bonus", "baseline"):  # both arms, both seeds finished
        assert re.search(rf"^\| {arm} \| 2/2 \|.*\| complete \|$", text, re.MULTILINE), text


# -------------------------------------------------------------------------------------
# The guide's smallest plugin, as written, as a separate package
# -------------------------------------------------------------------------------------


def guide_files(section: str = "## The smallest plugin") -> dict[str, str]:
    """The files the guide's section shows: each fenced block preceded by a line ``**`path`**``."""
    text = GUIDE.read_text()
    start = text.index(section)
    end = text.find("\n## ", start + len(section))
    body = text[start : end if end > 0 else None]
    found = re.findall(r"^\*\*`([^`]+)`\*\*\s*\n+```[a-z]*\n(.*?)^```", body, re.MULTILINE | re.DOTALL)
    return dict(found)


def test_the_guide_shows_a_complete_package():
    files = guide_files()
    assert "pyproject.toml" in files and any(p.endswith(".py") for p in files), sorted(files)


@pytest.mark.slow
def test_the_guides_smallest_plugin_runs_as_written(tmp_path):
    project = tmp_path / "project"
    for path, code in guide_files().items():
        (project / path).parent.mkdir(parents=True, exist_ok=True)
        (project / path).write_text(code)
    site = site_dir(project, tmp_path / "site")
    name = next(
        iter(tomllib.loads((project / "pyproject.toml").read_text())["project"]["entry-points"]["llm4rl.plugins"])
    )
    listed = run_cli(tmp_path, module="core.registry", env=env_with(site), timeout=120)
    assert name in listed.stdout, listed.stdout + listed.stderr
    out = run_cli(tmp_path, f"+plugins=[{name}]", *tiny(tmp_path), env=env_with(site), timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    with sqlite3.connect(tmp_path / "mlflow.db") as db:
        metrics = {k for (k,) in db.execute("SELECT DISTINCT key FROM metrics")}
    assert "fitness" in metrics


# -------------------------------------------------------------------------------------
# The testing kit from outside the repository: the guide's package and its test file
# -------------------------------------------------------------------------------------


def guide_package(dest: Path) -> Path:
    """The guide's smallest plugin and the test file of its *Testing your plugin*, in ``dest``."""
    for path, code in {**guide_files(), **guide_files("## Testing your plugin")}.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        (dest / path).write_text(code)
    return dest


def run_package_tests(project: Path, site: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """pytest on the package's own ``tests/``, from its folder: llm4rl as installed here, the
    package from ``site``, no trace of this repository's tests (no ``fakes``, no conftest)."""
    env = {k: v for k, v in env_with(site).items() if not k.startswith("PYTEST_")}  # nothing of this run's pytest
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-v", *args, "tests"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=project, env=env)


def test_the_guide_shows_a_test_file_of_the_contract():
    files = guide_files("## Testing your plugin")
    assert list(files) == ["tests/test_my_bonus.py"], sorted(files)
    assert "from core.testing import PluginContract" in files["tests/test_my_bonus.py"]


def test_the_guides_package_keeps_the_contract_from_outside_the_repository(tmp_path):
    """The checks that train nothing: the smoke run is deselected (the slow test below runs it)."""
    project = guide_package(tmp_path / "project")
    site = site_dir(project, tmp_path / "site")
    out = run_package_tests(project, site, "-k", "not smoke")
    assert out.returncode == 0, out.stdout + out.stderr
    for check in (
        "test_imports",
        "test_imports_only_the_plugin_api",
        "test_config_composes_and_validates",
        "test_hooks_match_the_specs",
        "test_docs_page_names_every_config_key",
    ):
        assert f"TestMyBonus::{check} PASSED" in out.stdout, out.stdout
    assert "5 passed, 1 deselected" in out.stdout, out.stdout


@pytest.mark.slow
def test_the_guides_package_passes_the_whole_contract_with_its_smoke_run(tmp_path):
    project = guide_package(tmp_path / "project")
    site = site_dir(project, tmp_path / "site")
    out = run_package_tests(project, site)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "TestMyBonus::test_smoke_run_trains_with_the_llm_output PASSED" in out.stdout, out.stdout
    assert "6 passed" in out.stdout and "skipped" not in out.stdout, out.stdout
