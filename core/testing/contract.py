"""The contract every plugin keeps, as one test class (like TorchRL's shared transform tests).

:class:`PluginContract` holds the checks; a test module subclasses it and provides the
fixture ``info`` (a :class:`core.registry.PluginInfo`, the plugin's catalogue entry:
:func:`plugin_info`). The repository's ``tests/plugins/test_contract.py`` runs it for
every registered plugin (built-ins from ``registry.yaml`` and any installed third-party
one); a third-party package runs it for its own plugins, from its own tests
(``docs/writing-a-plugin.md``, *Testing your plugin*). The class carries the
``make_config`` fixture it uses, so a test module needs no conftest or plugin to run it.

A plugin keeps the contract when:

- its module imports, has a docstring, declares its config as a ``Config`` dataclass
  (or none: the :class:`core.PluginConfig` base) and keeps no mutable state at module
  level (no ``global``, no module-level dict/list/set or instance of its own classes);
- it imports the framework through :mod:`core.plugin` only (``from core import hookimpl,
  PluginConfig`` too), a static check of its source with no exception, built-in or not;
- ``+plugins=[name]`` composes with Hydra and the result validates (its defaults are
  its schema's defaults);
- its hooks register against the specs, and a built-in implements exactly the hooks its
  ``registry.yaml`` entry lists;
- a built-in has ``docs/plugins/<name>.md`` naming every config key; a third-party
  plugin explains each key its ``Config`` declares (a comment on its line, or the
  class's docstring naming it);
- a tiny run (one iteration, ~1k frames, in-process, the shared fake LLM of
  :mod:`core.testing.fakes`) trains a candidate with what the LLM wrote (:data:`EVIDENCE`
  for the built-ins; a plugin the kit does not know passes when every candidate trained,
  and its test class may override :meth:`PluginContract.smoke` and
  :meth:`PluginContract.evidence`).

:data:`SMOKE` and :data:`EVIDENCE` are the built-ins' entries,
keyed by their names; a third-party plugin is checked without them.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import pytest

from core import PluginConfig, hookimpl
from core.config import config_class, validate
from core.records import Candidate, IterationResult, TrainResult
from core.registry import PluginInfo, catalogue, load_module, make_plugin_manager
from core.testing import fakes
from core.testing.pytest_plugin import compose_config

#: the built-ins' pages, in a source checkout (a wheel ships no docs)
DOCS = Path(__file__).resolve().parents[2] / "docs" / "plugins"

#: every smoke run: one process, a tiny budget, no policy files, the fake LLM
SMOKE_BASE = [
    "executor=inprocess",
    "trainer.frames=1024",
    "trainer.eval_every=0",
    "trainer.eval_episodes=2",
    "save_policy=false",
    "progress=false",
    "tracking.log_plots=false",
    *fakes.FAKE_LLM_OVERRIDES,
]
#: PPO shrunk further (the default trainer); a smoke run on SAC sets its own
PPO_TINY = ["trainer.epochs=2", "trainer.minibatch=128", "trainer.hidden=[32]"]


@dataclass
class Smoke:
    """How to run one plugin tiny: extra overrides (its knobs shrunk) and whether it is slow (> ~20 s)."""

    overrides: list[str] = field(default_factory=list)
    slow: bool = True
    trainer: list[str] = field(default_factory=lambda: list(PPO_TINY))  # the trainer's shrinking overrides


#: per built-in plugin (measured ~8-15 s each, LaRes ~30 s); others get ``Smoke()`` on CartPole
#: with ``iterations``/``samples`` set to 1, marked slow
SMOKE: dict[str, Smoke] = {
    "eureka": Smoke(["plugins.eureka.samples=1"], slow=False),
    "text2reward": Smoke(["plugins.text2reward.samples=1", "plugins.text2reward.few_shot=false"], slow=False),
    "llm_state_repr": Smoke(
        ["plugins.llm_state_repr.samples=1", "plugins.llm_state_repr.lipschitz_samples=512"], slow=False
    ),
    "rl_gpt": Smoke(["plugins.rl_gpt.rollouts=1", "plugins.rl_gpt.critic_rounds=0"], slow=False),
    "progress_reward": Smoke(
        [
            "plugins.progress_reward.reference.episodes=4",
            "plugins.progress_reward.reference.states=16",
            "plugins.progress_reward.rounds.states=4",
        ],
        slow=False,
    ),
    "rlaif_preference": Smoke(
        [
            "plugins.rlaif_preference.label_every=256",
            "plugins.rlaif_preference.label_budget=4",
            "plugins.rlaif_preference.segment_len=8",
            "plugins.rlaif_preference.finish_s=2",
        ],
        slow=False,
    ),
    "envgen": Smoke(
        ["env=minecraft", "trainer.num_envs=4", "trainer.rollout_steps=64", "plugins.envgen.num_envs=1"], slow=False
    ),
    "ellm": Smoke(["env=minecraft", "env.max_episode_steps=100", "trainer.num_envs=4", "trainer.rollout_steps=64"]),
    "plan4mc": Smoke(["env=minecraft", "env.max_episode_steps=100", "trainer.num_envs=4", "trainer.rollout_steps=64"]),
    "saycan": Smoke(["plugins.saycan.blocking=true", "plugins.saycan.max_queries=32"], slow=False),
    "rlingua": Smoke(
        ["env=pendulum"],
        trainer=[
            "trainer.frames=400",
            "trainer.init_random_frames=100",  # SAC: the plugin's config
            "trainer.batch_size=32",
            "trainer.hidden=[32,32]",
            "trainer.eval_episodes=1",
        ],
    ),
    "lares": Smoke(
        ["env=pendulum", "plugins.lares.population=2", "plugins.lares.elites=1", "plugins.lares.llm_freq=300"],
        trainer=[
            "trainer=sac",
            "trainer.frames=600",
            "trainer.init_random_frames=100",
            "trainer.batch_size=32",
            "trainer.hidden=[32,32]",
            "trainer.eval_episodes=1",
        ],
    ),
}


# -------------------------------------------------------------------------------------
# What the smoke run saw
# -------------------------------------------------------------------------------------


class Recorder:
    """Registered beside the plugin: keeps every iteration's candidates and results."""

    def __init__(self) -> None:
        self.iterations: list[IterationResult] = []

    @hookimpl
    def on_iteration_end(self, run: Any, result: IterationResult) -> None:
        self.iterations.append(result)

    @property
    def trained(self) -> list[tuple[Candidate, TrainResult]]:
        return [(c, r) for it in self.iterations for c, r in zip(it.candidates, it.results)]

    def report(self) -> str:
        """Each candidate's outcome, shown when a check fails."""
        return "\n".join(f"{c.id}: ok={r.ok} {r.error_kind} {r.error.strip()[-600:]}" for c, r in self.trained)


def _llm_written(part: Any, origin: str) -> bool:
    program = getattr(part, "program", part)
    return program is not None and program.origin == origin and fakes.MARK in program.source


def trained_llm_reward(name: str) -> Callable[[Recorder, fakes.FakeLiteLLM], str]:
    def check(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
        ok = [c for c, r in rec.trained if r.ok and _llm_written(c.reward, name)]
        return "" if ok else f"no candidate trained with a reward program {name} extracted from the LLM's reply"

    return check


def trained_llm_state(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    ok = [
        c
        for c, r in rec.trained
        if r.ok
        and _llm_written(c.state, "llm_state_repr")
        and fakes.MARK in c.state.meta.get("intrinsic", "") + c.state.source  # type: ignore[union-attr]
    ]
    return "" if ok else "no candidate trained with the LLM's revise_state/intrinsic_reward pair"


def trained_llm_macros(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    used = [
        r
        for c, r in rec.trained
        if r.ok
        and any(_llm_written(m, "rl_gpt") for m in c.macros)
        and any(r.metrics.get(f"macros/{m.name}_calls", 0) > 0 for m in c.macros)
    ]
    return "" if used else "no candidate trained with (and called) a macro-action the LLM wrote"


def trained_llm_envs(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    ok = [c for c, r in rec.trained if r.ok and any(e.name.startswith("fake_env_") for e in c.envs)]
    return "" if ok else "no candidate trained on an env config the LLM wrote"


def used_progress_scores(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    judged = [r for _, r in rec.trained if r.ok and r.metrics.get("judge/llm_calls", 0) > 0]
    if not judged:
        return "the progress judge's LLM scores were never used in training"
    if not any(
        r.metrics.get("llm/changed_share", 0.0) > 0.5 and r.metrics.get("judge/progress_std", 0.0) > 0 for r in judged
    ):
        return "the judge's LLM term changed too few steps, or did not vary (llm/changed_share, judge/progress_std)"
    return ""


def used_preference_labels(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    labelled = [r for _, r in rec.trained if r.ok and r.metrics.get("preference/labels", 0) > 0]
    if not labelled:
        return "no preference label from the LLM reached the reward model"
    return ""


def used_skill_scores(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    covered = [
        r
        for _, r in rec.trained
        if r.ok and r.metrics.get("saycan/queries", 0) > 0 and r.metrics.get("action_prior/rows", 0) > 0
    ]
    return "" if covered else "no skill score of the LLM reached the policy's action distribution"


#: plugin -> a check that the smoke run trained with the LLM's output ("" = it did)
EVIDENCE: dict[str, Callable[[Recorder, fakes.FakeLiteLLM], str]] = {
    "eureka": trained_llm_reward("eureka"),
    "text2reward": trained_llm_reward("text2reward"),
    "lares": trained_llm_reward("lares"),
    "llm_state_repr": trained_llm_state,
    "rl_gpt": trained_llm_macros,
    "envgen": trained_llm_envs,
    "progress_reward": used_progress_scores,
    "rlaif_preference": used_preference_labels,
    "saycan": used_skill_scores,
}


def some_training_succeeded(rec: Recorder, llm: fakes.FakeLiteLLM) -> str:
    """The check for plugins the suite does not know: every candidate trained."""
    if not rec.trained or not all(r.ok for _, r in rec.trained):
        return "not every candidate trained"
    return ""


# -------------------------------------------------------------------------------------
# Static checks
# -------------------------------------------------------------------------------------


def module_state(module: Any) -> list[str]:
    """Module-level mutable state in a plugin's source: ``global`` statements, and
    module-level names bound to an empty dict/list/set or to an instance of a class the
    module defines (a per-process singleton)."""
    tree = ast.parse(inspect.getsource(module))
    classes = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    found = [f"line {n.lineno}: global {', '.join(n.names)}" for n in ast.walk(tree) if isinstance(n, ast.Global)]
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            value = node.value
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = ", ".join(ast.unparse(t) for t in targets)
            empty = isinstance(value, (ast.Dict, ast.List, ast.Set)) and not getattr(
                value, "keys", getattr(value, "elts", None)
            )
            made = (
                isinstance(value, ast.Call)
                and isinstance(value.func, ast.Name)
                and (value.func.id in classes or value.func.id in ("dict", "list", "set", "defaultdict", "deque"))
            )
            if empty or made:
                found.append(f"line {node.lineno}: {names} = {ast.unparse(value)}")
    return found


#: what ``from core import ...`` may name in a plugin (the package's light entry point)
FROM_CORE = frozenset({"hookimpl", "PluginConfig"})


def is_core(module: str) -> bool:
    return module == "core" or module.startswith("core.")


def plugin_sources(module: Any) -> dict[str, str]:
    """The plugin's source: its module, or every ``.py`` file of its package."""
    if hasattr(module, "__path__"):  # a package: what its submodules import counts too
        root = Path(module.__file__).parent
        return {str(f.relative_to(root.parent)): f.read_text() for f in sorted(root.rglob("*.py"))}
    return {Path(inspect.getsourcefile(module) or module.__name__).name: inspect.getsource(module)}


def core_imports(source: str) -> list[str]:
    """The imports of the framework in ``source`` other than :mod:`core.plugin` (and
    ``from core import hookimpl, PluginConfig``), as ``line N: <statement>``. Nested and
    ``TYPE_CHECKING`` imports count; relative imports are the plugin's own."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and is_core(node.module):
            ok = node.module == "core.plugin" or (
                node.module == "core" and all(a.name in FROM_CORE for a in node.names)
            )
        elif isinstance(node, ast.Import):
            ok = all(not is_core(a.name) or a.name == "core.plugin" for a in node.names)
        else:
            continue
        if not ok:
            found.append((node.lineno, f"line {node.lineno}: {ast.unparse(node)}"))
    return [text for _, text in sorted(found)]  # ast.walk goes breadth first


def config_fields(module: Any) -> list[str]:
    return [f.name for f in dataclasses.fields(config_class(module))]


def undocumented_keys(module: Any) -> list[str]:
    """The keys a plugin's ``Config`` declares itself (not :class:`core.PluginConfig`'s) that
    neither a comment on their line nor the class's docstring (as ``name``) explains."""
    cls = config_class(module)
    own = [name for name in vars(cls).get("__annotations__", {}) if not name.startswith("_")]
    if not own:
        return []
    lines = inspect.getsource(cls).splitlines()
    doc = inspect.getdoc(cls) or ""

    def explained(name: str) -> bool:
        declared = [line for line in lines if line.strip().startswith(f"{name}:")]
        return f"``{name}``" in doc or f"`{name}`" in doc or any("#" in line for line in declared)

    return [name for name in own if not explained(name)]


# -------------------------------------------------------------------------------------
# The contract
# -------------------------------------------------------------------------------------


class PluginContract:
    """Subclass with a fixture ``info`` (the plugin's :class:`PluginInfo`), usually from a
    ``plugin_name`` parametrized by the module's ``pytest_generate_tests`` (:func:`params`)."""

    @pytest.fixture
    def make_config(self, tmp_path: Path) -> Callable[..., Any]:
        """:mod:`core.testing.pytest_plugin`'s fixture, carried by the class: a third party's
        test module that subclasses the contract runs without a conftest."""
        return lambda overrides=(): compose_config(list(overrides), tmp_path)

    def builtin(self, info: PluginInfo) -> bool:
        return info.source == "builtin"

    def test_imports(self, info: PluginInfo) -> None:
        module = load_module(info)
        assert (module.__doc__ or "").strip(), f"{info.module} has no module docstring (paper, method)"
        schema = config_class(module)
        assert issubclass(schema, PluginConfig)
        cls = getattr(module, "Plugin", None)
        if cls is not None:
            assert inspect.isclass(cls), f"{info.module}.Plugin must be a class"
            params = list(inspect.signature(cls).parameters)
            assert params[:1] == ["config"], f"{info.module}.Plugin(config) takes the typed config, got {params}"
        assert not module_state(module), f"{info.module} keeps state at module level:\n" + "\n".join(
            module_state(module)
        )

    def test_imports_only_the_plugin_api(self, info: PluginInfo) -> None:
        found = [
            f"{name} {line}"
            for name, source in plugin_sources(load_module(info)).items()
            for line in core_imports(source)
        ]
        assert not found, (
            f"{info.module} imports framework internals; import it from core.plugin "
            "(the plugin API, docs/writing-a-plugin.md):\n" + "\n".join(found)
        )

    def test_config_composes_and_validates(self, info: PluginInfo, make_config: Any) -> None:
        module = load_module(info)
        cfg = make_config([f"+plugins=[{info.name}]"])
        assert list(cfg.plugins) == [info.name]
        assert sorted(cfg.plugins[info.name]) == sorted(config_fields(module)), (
            "the composed keys are the schema's fields"
        )
        settings = validate(cfg, {info.name: module})
        typed = settings.plugins[info.name]
        assert isinstance(typed, config_class(module))
        assert typed == config_class(module)(), "the composed defaults are the schema's defaults"

    def test_hooks_match_the_specs(self, info: PluginInfo) -> None:
        module = load_module(info)
        pm = make_plugin_manager(None, {info.name: module})
        plugin = pm.get_plugin(info.name)
        implemented = {caller.name for caller in pm.get_hookcallers(plugin) or []}
        assert implemented, f"{info.name} implements no hook"
        if self.builtin(info):
            assert implemented == set(info.hooks), (
                f"registry.yaml lists {sorted(info.hooks)} for {info.name}; it implements {sorted(implemented)}"
            )

    def test_docs_page_names_every_config_key(self, info: PluginInfo) -> None:
        if not self.builtin(info):
            undocumented = undocumented_keys(load_module(info))
            assert not undocumented, (
                f"{info.name}'s Config explains none of {undocumented}: give each a comment on its line "
                "or name it in the class's docstring (a third-party plugin documents itself)"
            )
            return
        if not DOCS.is_dir():
            pytest.skip("the built-ins' pages are in a source checkout, not in an installed package")
        page = DOCS / f"{info.name}.md"
        assert page.exists(), f"{page} is missing"
        text = page.read_text()
        missing = [
            k for k in config_fields(load_module(info)) if not any(f in text for f in (f"`{k}`", f"`{k}.", f"| {k} "))
        ]
        assert not missing, f"{page.name} does not name the config keys {missing}"

    def smoke(self, info: PluginInfo) -> Smoke:
        if info.name in SMOKE:
            return SMOKE[info.name]
        fields_ = config_fields(load_module(info))
        knobs = [f"plugins.{info.name}.{k}=1" for k in ("iterations", "samples") if k in fields_]
        return Smoke(knobs)

    def evidence(self, info: PluginInfo) -> Callable[[Recorder, fakes.FakeLiteLLM], str]:
        return EVIDENCE.get(info.name, some_training_succeeded)

    def test_smoke_run_trains_with_the_llm_output(
        self, info: PluginInfo, make_config: Any, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        from core.loop import run_experiment

        smoke = self.smoke(info)
        llm = fakes.install_fake_litellm(monkeypatch)
        overrides = [
            f"+plugins=[{info.name}]",
            f"plugins.{info.name}.iterations=1",
            *SMOKE_BASE,
            *smoke.trainer,
            *smoke.overrides,
        ]
        cfg = make_config(overrides)
        recorder = Recorder()
        summary = run_experiment(cfg, extra_plugins=(recorder,))
        assert recorder.trained, "nothing was trained"
        assert summary.failed < summary.candidates, recorder.report()
        problem = self.evidence(info)(recorder, llm)
        assert not problem, problem + "\n" + recorder.report()
        # every request the plugin made, from the loop or from inside a training, is in the run's totals
        assert summary.llm.get("llm/requests", 0.0) == len(llm.calls), (summary.llm, len(llm.calls))


def params(names: list[str], function: Callable[..., Any]) -> list[Any]:
    """``pytest.param`` per plugin name for the contract's ``plugin_name``; the smoke run
    of a plugin whose :data:`SMOKE` entry is slow (or that the suite does not know) is
    marked ``slow``. Call it from a test module's ``pytest_generate_tests``."""
    smoke = function.__name__.startswith("test_smoke")
    return [
        pytest.param(n, id=n, marks=[pytest.mark.slow] if smoke and SMOKE.get(n, Smoke()).slow else []) for n in names
    ]


def plugin_info(name: str) -> PluginInfo:
    """The catalogue's entry for the plugin ``name``: what a contract test's ``info`` fixture
    returns. A plugin that is not installed fails the test with how to install it."""
    plugins = catalogue()
    if name not in plugins:
        pytest.fail(
            f"no plugin {name!r} in the catalogue: install its package (pip install -e . in its folder) "
            "so that its entry point in the group llm4rl.plugins is seen",
            pytrace=False,
        )
    return plugins[name]
