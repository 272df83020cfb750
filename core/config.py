"""Typed configs: the schema of a run's keys, each plugin's schema, one validation step.

Hydra composes the YAML files under ``conf/``; :func:`validate` then checks the result
against dataclasses before any work starts (no MLflow run, no LLM call, no training):
the run's own keys (:class:`RunSettings`), the sandbox limits (:class:`SandboxConfig`),
the trainer's settings and every enabled plugin's config (a :class:`PluginConfig`
subclass the plugin declares as ``Config``). A wrong type, an unknown key or a value a
plugin's ``check`` refuses becomes one :class:`core.errors.UserError` paragraph naming
the key, what was expected and what was given.

The YAML files keep the defaults users read and edit; ``tests/test_configs.py`` checks
that every YAML key is a schema field with the same default, and that code reads it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from core.errors import UserError, did_you_mean


@dataclass
class PluginConfig:
    """The base of every plugin's config: the keys the core itself reads.

    A plugin declares ``Config`` as a subclass with its own fields (a type, a default
    and a comment each); ``conf/plugins/<name>.yaml`` holds the same keys for users.
    """

    iterations: int = 1  # outer rounds this plugin proposes in; the run has as many as its largest plugin
    final_seeds: int = 0  # after the loop, retrain the best candidate on this many more seeds

    def check(self) -> None:
        """Refuse values that have the right type but cannot work (``ValueError``).

        Called once after the types are checked; override and call ``super().check()``.
        """
        if self.iterations < 0:
            raise ValueError(f"iterations must be >= 0, got {self.iterations}")
        if self.final_seeds < 0:
            raise ValueError(f"final_seeds must be >= 0, got {self.final_seeds}")


@dataclass
class SandboxConfig:
    """Limits for LLM-written code (``sandbox:``; see ``docs/sandbox.md``)."""

    allowed_imports: list[str] = field(default_factory=lambda: ["math", "numpy", "torch"])  # modules programs may import
    cpu_s: float = 10.0  # CPU seconds a candidate's worker may use beyond the time its calls took (start-up and probes included)
    wall_s: float = 20.0  # wall-clock seconds to start a worker and probe a program
    memory_mb: int = 4096  # address space the worker may map beyond what its imports mapped (RLIMIT_AS)
    call_timeout_s: float = 1.0  # wall-clock limit of one call (module body, probe, training step); past it the worker is killed
    max_procs: int = 16  # processes/threads the worker's unprivileged user may have
    max_output_chars: int = 10_000  # what print() in LLM code may write before it is cut off
    per_row_fallback: bool = True  # accept code written for one state, not a batch (runs once per row)
    max_time_share: float = 0.5  # most of a candidate's training wall time its programs may take (too_slow beyond)
    time_share_grace_s: float = 5.0  # program seconds per candidate before max_time_share applies
    static_check: bool = True  # the AST check before anything runs; false only to test the worker's isolation alone

    def check(self) -> None:
        for name in ("cpu_s", "wall_s", "call_timeout_s", "max_time_share"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.time_share_grace_s < 0:
            raise ValueError(f"time_share_grace_s must be >= 0, got {self.time_share_grace_s}")
        for name in ("memory_mb", "max_procs", "max_output_chars"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def limits(self) -> Any:
        """The :class:`core.sandbox.Limits` these settings describe."""
        from core.sandbox import Limits

        return Limits(
            cpu_s=self.cpu_s,
            wall_s=self.wall_s,
            memory_mb=self.memory_mb,
            max_procs=self.max_procs,
            call_timeout_s=self.call_timeout_s,
            max_output_chars=self.max_output_chars,
            per_row_fallback=self.per_row_fallback,
            max_time_share=self.max_time_share,
            time_share_grace_s=self.time_share_grace_s,
            static_check=self.static_check,
        )

    @property
    def imports(self) -> tuple[str, ...]:
        return tuple(self.allowed_imports)


@dataclass
class VettingConfig:
    """Reward vetting and repair before training (``vetting:``; see ``core/vetting.py``, ``core/preflight.py``)."""

    enabled: bool = True  # run every reward program on reference episodes before it trains; reject one that ranks failure above success or pays for prolonging
    episodes: int = 8  # reference episodes of each kind: random, and the task's known controller where it has one
    max_steps: int = 1000  # steps per reference episode at most
    repair: int = 2  # rounds of repair for a program that fails its check, probe or vetting: a short request with the error (0: never)

    def check(self) -> None:
        if self.episodes < 1:
            raise ValueError(f"episodes must be >= 1, got {self.episodes}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.repair < 0:
            raise ValueError(f"repair must be >= 0, got {self.repair}")


@dataclass
class CodeConfig:
    """How LLM code is asked for and repaired (``code:``; see ``docs/llm.md``)."""

    interface: str = "fields"  # fields: a skeleton from the task's fields, names checked before anything runs; dict: the earlier prompt, for comparison
    repair_temperature: float = 0.2  # sampling temperature of a repair request (a short one: the function, the error, the rule)
    retry_temperature: float = 0.8  # temperature of a repair round after a reply that returned the function unchanged
    repair_max_tokens: int = 768  # cap on a repair reply
    stop_at_code_end: bool = True  # end every code reply at the close of its first code block (the prose after it is never used)

    def check(self) -> None:
        from core.prompting import INTERFACES

        if self.interface not in INTERFACES:
            raise ValueError(f"interface must be one of {', '.join(INTERFACES)}, got {self.interface!r}")
        if self.repair_temperature < 0 or self.retry_temperature < 0:
            raise ValueError(f"repair_temperature and retry_temperature must be >= 0, got {self.repair_temperature} "
                             f"and {self.retry_temperature}")
        if self.repair_max_tokens < 1:
            raise ValueError(f"repair_max_tokens must be >= 1, got {self.repair_max_tokens}")


@dataclass
class RunSettings:
    """The run's own top-level keys (``conf/config.yaml``); groups are checked by their owners."""

    seed: int = 0  # seeds training, evaluation and LLM sampling
    experiment: str = "llm4rl"  # MLflow experiment name
    run_name: str | None = None  # MLflow parent-run name; None -> "<plugins>-<env>-s<seed>"
    resume: bool = True  # reuse trainings finished by an identical earlier run (same code, config, seed)
    results_store: str | None = None  # sqlite file of finished trainings; None -> beside the tracking store
    final_seeds: int = 0  # retrain the best candidate on this many more seeds (a plugin may ask for more)
    save_policy: bool = True  # save each candidate's policy weights as an MLflow artifact
    progress: bool = True  # rich progress bars
    cache_dir: str = ""  # LLM replies and plugin libraries
    sandbox: SandboxConfig = field(default_factory=SandboxConfig)
    vetting: VettingConfig = field(default_factory=VettingConfig)
    code: CodeConfig = field(default_factory=CodeConfig)

    def check(self) -> None:
        self.vetting.check()
        self.code.check()


#: top-level keys that are config groups, checked by the code that owns them
GROUPS = ("env", "trainer", "llm", "executor", "tracking", "plugins", "hydra")


@dataclass
class Settings:
    """A validated run config: the raw config plus its typed parts."""

    config: DictConfig  # the composed config, read-only
    run: RunSettings
    plugins: dict[str, PluginConfig]  # enabled plugin -> its validated config

    @property
    def sandbox(self) -> SandboxConfig:
        return self.run.sandbox

    @property
    def iterations(self) -> int:
        """Outer iterations: the largest ``iterations`` of the enabled plugins (1 without any)."""
        return max((p.iterations for p in self.plugins.values()), default=1) or 1

    @property
    def final_seeds(self) -> int:
        return max([self.run.final_seeds, *(p.final_seeds for p in self.plugins.values())])

    @classmethod
    def of(cls, config: Mapping[str, Any] | DictConfig | None = None, plugins: Mapping[str, PluginConfig] | None = None) -> Settings:
        """Settings from a partial config (defaults for what it omits) and ready plugin configs.

        For code that trains outside a composed run: tests, benchmarks, notebooks. One
        default differs from a run's: ``save_policy`` is false unless given, since
        outside a run no tracker uploads the saved file and removes it from the temp folder.
        """
        node = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config or {}))
        own = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in GROUPS}
        own.setdefault("save_policy", False)
        run = typed(RunSettings, OmegaConf.create(own), "config")
        return cls(config=node, run=run, plugins=dict(plugins or {}))


def config_class(module: Any) -> type[PluginConfig]:
    """A plugin module's config schema: its ``Config`` (a PluginConfig subclass) or the base."""
    cls = getattr(module, "Config", None)
    if cls is None:
        legacy = getattr(module, "CONFIG", None)
        if legacy:
            raise UserError(
                f"Plugin module {module.__name__} declares its config as a CONFIG mapping. Declare a dataclass "
                "`Config(core.PluginConfig)` instead, one typed field with a default per key "
                "(docs/writing-a-plugin.md, 'Typed config')."
            )
        return PluginConfig
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls) and issubclass(cls, PluginConfig)):
        raise UserError(f"{module.__name__}.Config must be a dataclass subclassing core.PluginConfig.")
    return cls


def typed(schema: type, node: Any, where: str) -> Any:
    """``node`` checked against the dataclass ``schema``; returns a schema instance.

    :raises UserError: one paragraph naming the key, the expected type and the value.
    """
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), node if node is not None else {})
        obj = OmegaConf.to_object(merged)
    except (ValidationError, ConfigKeyError) as err:
        raise UserError(_explain(err, schema, where)) from None
    except OmegaConfBaseException as err:  # pragma: no cover - other OmegaConf errors
        raise UserError(f"Invalid config under '{where}': {err}") from None
    check = getattr(obj, "check", None)
    if callable(check):
        try:
            check()
        except ValueError as err:
            raise UserError(f"Invalid value under '{where}': {err}. Fix it in the YAML file or on the command line.") from None
    return obj


def check_key(schema: type, dotted: str, where: str) -> None:
    """Refuse a dotted key that ``schema`` (a dataclass, nested ones included) does not declare.

    For overrides checked before Hydra composes the config (``plugins.<name>.<key>=...``).

    :raises UserError: naming the key, the closest field and the fields there are.
    """
    cls: Any = schema
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return  # below a mapping or list field: any key
        names = [f.name for f in dataclasses.fields(cls)]
        section = ".".join([where, *parts[:i]])
        if part not in names:
            raise UserError(
                f"Unknown config key '{section}.{part}'.{did_you_mean(part, names)} '{section}' accepts: "
                f"{', '.join(names)}. A plugin's keys are the fields of its Config schema; '+' cannot add one."
            )
        cls = _hints(cls).get(part)


def _explain(err: OmegaConfBaseException, schema: type, where: str) -> str:
    key = getattr(err, "full_key", None) or getattr(err, "key", None) or ""
    path = f"{where}.{key}" if key else where
    if isinstance(err, ConfigKeyError) or "not in" in str(err) or "Key '" in str(err):
        *parents, name = str(key).split(".")
        section, cls = where, schema  # the (nested) dataclass the unknown key was put in
        for part in parents:
            inner = _hints(cls).get(part)
            if not (isinstance(inner, type) and dataclasses.is_dataclass(inner)):
                break
            section, cls = f"{section}.{part}", inner
        fields_ = [f.name for f in dataclasses.fields(cls)]
        return (
            f"Unknown config key '{path}'.{did_you_mean(name, fields_)} "
            f"'{section}' accepts: {', '.join(fields_)}."
        )
    expected = _field_type(schema, str(key))
    value = getattr(err, "value", None)
    return (
        f"Invalid value for '{path}': expected {expected}, got {value!r} ({type(value).__name__}). "
        f"Set it in the YAML file or on the command line, e.g. {path}=<{expected}>."
    )


def _field_type(schema: type, dotted: str) -> str:
    cls: Any = schema
    hint: Any = None
    for part in dotted.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            break
        hints = _hints(cls)
        hint = hints.get(part)
        cls = hint
    if hint is None:
        return "a valid value"
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _hints(cls: type) -> dict[str, Any]:
    import typing

    try:
        return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))
    except Exception:  # pragma: no cover - unresolvable annotations
        return {}


def validate(config: DictConfig, plugin_modules: Mapping[str, Any]) -> Settings:
    """Check a composed run config before any work; return its typed :class:`Settings`.

    :param plugin_modules: enabled plugin name -> its imported module (for ``Config``).
    :raises UserError: on the first problem, as one paragraph.
    """
    own = {k: v for k, v in OmegaConf.to_container(config, resolve=True).items() if k not in GROUPS}
    run = typed(RunSettings, OmegaConf.create(own), "config")
    plugins_node = config.get("plugins") or {}
    unknown = [name for name in plugins_node if name not in plugin_modules]
    if unknown:  # a plugin's key set without enabling it (e.g. a sweep arm without the plugin)
        name = unknown[0]
        raise UserError(
            f"'plugins.{name}' is set but plugin '{name}' is not enabled in this run. Enable it with "
            f"+plugins=[{name}]; in a study whose arms differ in plugins, set it as plugins.{name}.<key>=... "
            f"with '{name}' in at least one arm (docs/ablations.md, 'Sweeping a plugin's knob')."
        )
    plugins = {name: typed(config_class(module), plugins_node.get(name), f"plugins.{name}") for name, module in plugin_modules.items()}
    _check_trainer(config.get("trainer"))
    return Settings(config=config, run=run, plugins=plugins)


def _check_trainer(node: Any) -> None:
    if node is None:
        return
    from core.train import get_trainer

    _, cls = get_trainer(str(node.get("name", "ppo")))
    try:
        cfg = cls.from_config({k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k != "name"})
        cfg.validate()
    except (ValueError, TypeError) as err:
        raise UserError(f"Invalid trainer config: {err}") from None


# -------------------------------------------------------------------------------------
# Code fingerprints: what decides a training's result besides its config
# -------------------------------------------------------------------------------------


def source_hash(module: Any) -> str:
    """sha256 of a module's source: every ``.py`` file of its package, or its one file."""
    files = _source_files(module)
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    if not files:  # no source on disk (e.g. built in a test): its version, if any
        digest.update(str(getattr(module, "__version__", module.__name__)).encode())
    return digest.hexdigest()[:16]


def _source_files(module: Any) -> list[Path]:
    try:
        path = Path(inspect.getfile(module))
    except (TypeError, OSError):
        return []
    if path.name == "__init__.py":
        return sorted(path.parent.rglob("*.py"))
    return [path] if path.exists() else []


#: core modules that only present results: editing them changes no candidate, so reuse survives it
PRESENTATION = ("report", "plots.py", "run_page.py", "progress.py", "quiet.py", "__main__.py")


def framework_hash() -> str:
    """sha256 of every core module that shapes what a candidate is and how it trains.

    That is all of ``core/`` (prompts, code extraction and checks, vetting, preflight,
    the loop, the LLM layer, the sandbox, the trainers and tasks, records) except the
    modules in :data:`PRESENTATION`, which only show results. A finished training or
    study cell is reused only under the same hash, so a fix to any of them retrains.
    """
    import core

    root = Path(core.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in PRESENTATION or rel.name == "__main__.py":
            continue
        digest.update(rel.as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
