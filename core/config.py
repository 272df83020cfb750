"""Typed configs: the schema of every part of a run's config, one validation step.

Hydra composes the YAML files under ``conf/``; :func:`validate` then checks the result
against dataclasses before any work starts (no MLflow run, no LLM call, no training),
once, in the process that starts the run:

- the run's own keys (:class:`RunSettings`), with the sandbox's limits
  (:class:`SandboxConfig`, which is :class:`core.sandbox.Limits`);
- each config group: ``trainer`` (the trainer's own dataclass, ``core.train.TRAINERS``),
  ``llm`` (:class:`core.llm.client.LLMSettings`), ``executor`` (:class:`ExecutorConfig`,
  :class:`RayExecutorConfig`), ``tracking`` (:class:`TrackingConfig`) and ``env``
  (:class:`EnvConfig`: the task's constructor is its schema);
- every enabled plugin's config (a :class:`PluginConfig` subclass the plugin declares
  as ``Config``).

A wrong type, an unknown key or a value a ``check`` refuses becomes one
:class:`core.errors.UserError` paragraph naming the key, what was expected and what was
given. The result, :class:`Settings`, is what workers get: a typed record, not a config
to check again.

The schemas are not attached to the YAML files through Hydra's ``ConfigStore`` and
defaults lists: Hydra would then refuse a bad value while composing, with its own
message, before this one-paragraph check could name the key and the fix. The YAML files
keep the defaults users read and edit; ``tests/test_configs.py`` checks that every YAML
key is a schema field (with the same default where the group has one file) and that code
reads it.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hashlib
import inspect
import json
import sys
from dataclasses import MISSING, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from core.errors import UserError, did_you_mean
from core.sandbox.reports import Limits


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


#: the run's ``sandbox:`` section: the sandbox's own limits, declared once (``core/sandbox/reports.py``)
SandboxConfig = Limits


@dataclass
class VettingConfig:
    """Reward vetting and repair before training (``vetting:``; see ``core/vetting.py``, ``core/preflight.py``)."""

    # run every reward program on reference episodes before it trains; reject one that ranks
    # failure above success or pays for prolonging
    enabled: bool = True
    episodes: int = 8  # reference episodes of each kind: random, and the task's known controller where it has one
    max_steps: int = 1000  # steps per reference episode at most
    # rounds of repair for a program that fails its check, probe or vetting: a short request
    # with the error (0: never)
    repair: int = 2

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

    # fields: a skeleton from the task's fields, names checked before anything runs; dict: the
    # earlier prompt, for comparison
    interface: str = "fields"
    # sampling temperature of a repair request (a short one: the function, the error, the rule)
    repair_temperature: float = 0.2
    retry_temperature: float = 0.8  # temperature of a repair round after a reply that returned the function unchanged
    repair_max_tokens: int = 768  # cap on a repair reply
    # end every code reply at the close of its first code block (the prose after it is never used)
    stop_at_code_end: bool = True

    def check(self) -> None:
        from core.prompting import INTERFACES

        if self.interface not in INTERFACES:
            raise ValueError(f"interface must be one of {', '.join(INTERFACES)}, got {self.interface!r}")
        if self.repair_temperature < 0 or self.retry_temperature < 0:
            raise ValueError(
                f"repair_temperature and retry_temperature must be >= 0, got {self.repair_temperature} "
                f"and {self.retry_temperature}"
            )
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
        for name in ("sandbox", "vetting", "code"):
            try:
                getattr(self, name).check()
            except ValueError as err:
                raise ValueError(f"{name}.{err}") from None


# -------------------------------------------------------------------------------------
# Config groups: executor, tracking, env (trainer and llm: their owners' dataclasses)
# -------------------------------------------------------------------------------------


@dataclass
class ExecutorConfig:
    """Where candidate trainings run (``executor: local`` and ``inprocess``; see ``docs/scaling.md``)."""

    kind: str = "local"  # local: this machine, in-process or a process pool; ray: Ray tasks (RayExecutorConfig)
    # jobs trained at once: auto sizes each batch to the idle cores; a number; 1: always in-process
    workers: int | str = "auto"

    def check(self) -> None:
        if self.workers != "auto" and not (isinstance(self.workers, int) and self.workers >= 1):
            raise ValueError(f"workers must be 'auto' or a positive number of workers, got {self.workers!r}")


@dataclass
class RayExecutorConfig(ExecutorConfig):
    """Candidate trainings as Ray tasks (``executor: ray``; ``conf/executor/ray.yaml``, ``core/ray_executor.py``)."""

    kind: str = "ray"
    address: str | None = None  # None: start a local Ray on this machine; "auto" or "ray://head:10001": join a cluster
    num_cpus: int | None = None  # local Ray only: CPUs it may use (None: the cores this process may use)
    cpus_per_job: float = 1.0  # CPUs reserved per candidate training (trainer.threads should match)
    worker_niceness: int | None = 0  # local Ray only: nice value of its workers (None keeps Ray's own, 15)
    warm: bool = True  # start and import the training stack in one worker per CPU before the first jobs
    max_retries: int = 0  # Ray retries of a job whose worker died (a failed training is a result, not retried)
    dashboard: bool = False  # start Ray's dashboard with a local instance
    log_to_driver: bool = False  # forward workers' stdout/stderr to this terminal
    env_vars: dict[str, str] = field(default_factory=dict)  # extra environment variables for the workers

    def check(self) -> None:
        super().check()
        if self.cpus_per_job <= 0:
            raise ValueError(f"cpus_per_job must be > 0, got {self.cpus_per_job}")
        if self.num_cpus is not None and self.num_cpus < 1:
            raise ValueError(f"num_cpus must be >= 1 or null, got {self.num_cpus}")
        if self.max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {self.max_retries}")


#: ``executor.kind`` -> its schema
EXECUTORS: dict[str, type[ExecutorConfig]] = {"local": ExecutorConfig, "ray": RayExecutorConfig}


def executor_config(node: Any) -> ExecutorConfig:
    """The ``executor`` node typed (a typed record is returned as it is).

    :raises UserError: for an unknown kind or a bad value, as one paragraph.
    """
    if isinstance(node, ExecutorConfig):
        return node
    kind = str((node or {}).get("kind", "local"))
    if kind not in EXECUTORS:
        raise UserError(
            f"Unknown executor kind '{kind}'.{did_you_mean(kind, list(EXECUTORS))} "
            "Use executor=local, executor=inprocess or executor=ray."
        )
    return typed(EXECUTORS[kind], node, "executor")


@dataclass
class TrackingConfig:
    """Where results are recorded (``tracking: mlflow``; see ``docs/mlflow.md``)."""

    uri: str = "sqlite:///mlflow.db"  # any MLflow tracking URI (http://host:5000, file:...)
    artifact_location: str | None = "./mlartifacts"  # where new experiments store artifacts
    log_plots: bool = True  # learning curves as PNG artifacts


@dataclass
class EnvConfig:
    """The task a run trains on (``env:``): its name and its options.

    A task's options are the arguments of its class's constructor: that signature is the
    schema (:func:`env_config` types each option by its annotation), so the two cannot drift.
    """

    name: str  # task name (core.envs.BUILTIN_TASKS, or one a plugin registers)
    options: dict[str, Any] = field(default_factory=dict)  # the node's other keys: the task's constructor arguments

    def node(self) -> dict[str, Any]:
        """The env node as :func:`core.envs.make_task` takes it."""
        return {"name": self.name, **self.options}


def env_config(node: Any, tasks: Mapping[str, type] | None = None) -> EnvConfig:
    """The ``env`` node typed against its task's constructor.

    ``tasks``: tasks plugins contribute (``register_tasks``). A name that is neither built
    in nor in ``tasks`` keeps its options as given: a plugin's task, checked when it is made.

    :raises UserError: for a missing name, an unknown option or a value of the wrong type.
    """
    if isinstance(node, EnvConfig):
        return node
    options = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else (node or {}))  # type: ignore[arg-type]
    name = options.pop("name", None)
    if not name:
        raise UserError("The env config has no 'name'. Select a task with env=<name> (conf/env/).")
    from core.envs import BUILTIN_TASKS, task_class

    if str(name) not in BUILTIN_TASKS and str(name) not in (tasks or {}):
        return EnvConfig(str(name), options)
    schema = _options_schema(task_class(str(name), dict(tasks or {})))
    if schema is None:  # the constructor takes **kwargs: any option
        return EnvConfig(str(name), options)
    obj = typed(schema, options, "env")
    return EnvConfig(str(name), {key: getattr(obj, key) for key in options})


def _options_schema(cls: type) -> type | None:
    """A dataclass of ``cls``'s constructor arguments (None when it takes ``**kwargs``).

    Types OmegaConf cannot check (a callable, a record) become ``Any``.
    """
    import typing

    params = [p for name, p in inspect.signature(cls.__init__).parameters.items() if name not in ("self", "name")]  # type: ignore[misc]
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    try:
        hints = typing.get_type_hints(cls.__init__)  # type: ignore[misc]
    except Exception:  # pragma: no cover - unresolvable annotations
        hints = {}
    specs: list[Any] = []
    for p in params:
        if p.kind in (inspect.Parameter.VAR_POSITIONAL,):
            continue
        hint = _checkable(hints.get(p.name, Any))
        if p.default is None and hint is not Any:
            hint = hint | None
        default = (
            field(default=MISSING)
            if p.default is inspect.Parameter.empty
            else (
                field(default_factory=functools.partial(copy.deepcopy, p.default))
                if isinstance(p.default, (list, dict))
                else field(default=p.default)
            )
        )
        specs.append((p.name, hint, default))
    schema = dataclasses.make_dataclass(f"{cls.__name__}Options", specs)
    schema.__module__ = __name__
    return schema


def _checkable(hint: Any) -> Any:
    """``hint`` when it is one OmegaConf checks (a scalar, optionally None), else ``Any``."""
    import types
    import typing

    scalars = (int, float, bool, str)
    if hint in scalars:
        return hint
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = typing.get_args(hint)
        if all(a in scalars or a is type(None) for a in args):
            return hint
    return Any


#: top-level keys that are config groups, each typed by its own schema
GROUPS = ("env", "trainer", "llm", "executor", "tracking", "plugins", "hydra")


@dataclass
class Settings:
    """A validated run config: the raw config plus its typed parts.

    Validated once, where the run starts (:func:`validate`); a worker that trains the
    run's candidates gets this record as it is (it pickles), not the config to check again.
    """

    config: DictConfig  # the composed config, read-only
    run: RunSettings
    plugins: dict[str, PluginConfig]  # enabled plugin -> its validated config
    # the trainer's config (core.train: PPOConfig, SACConfig, RandomConfig); None without a trainer node
    trainer: Any = None
    trainer_name: str = "ppo"  # trainer.name: which trainer reads it
    llm: Any = None  # core.llm.client.LLMSettings; None without an llm node
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)
    tracking: TrackingConfig | None = None  # None without a tracking node
    env: EnvConfig | None = None  # None without an env node

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
    def of(
        cls, config: Mapping[str, Any] | DictConfig | None = None, plugins: Mapping[str, PluginConfig] | None = None
    ) -> Settings:
        """Settings from a partial config (defaults for what it omits) and ready plugin configs.

        For code that trains outside a composed run: tests, benchmarks, notebooks. One
        default differs from a run's: ``save_policy`` is false unless given, since
        outside a run no tracker uploads the saved file and removes it from the temp folder.
        """
        node = config if isinstance(config, DictConfig) else OmegaConf.create(dict(config or {}))
        own = {k: v for k, v in OmegaConf.to_container(node, resolve=True).items() if k not in GROUPS}  # type: ignore[union-attr]
        own.setdefault("save_policy", False)
        run = typed(RunSettings, OmegaConf.create(own), "config")
        return cls(config=node, run=run, plugins=dict(plugins or {}), **groups(node))


def groups(config: DictConfig) -> dict[str, Any]:
    """The typed records of the config groups ``config`` has (:class:`Settings`' fields).

    :raises UserError: on the first bad value, as one paragraph.
    """
    out: dict[str, Any] = {}
    trainer = config.get("trainer")
    if trainer is not None:
        out["trainer_name"], out["trainer"] = trainer_config(trainer)
    if config.get("llm") is not None:
        from core.llm.client import LLMSettings

        out["llm"] = typed(LLMSettings, config.llm, "llm")
    if config.get("executor") is not None:
        out["executor"] = executor_config(config.executor)
    if config.get("tracking") is not None:
        out["tracking"] = typed(TrackingConfig, config.tracking, "tracking")
    if config.get("env") is not None:
        out["env"] = env_config(config.env)
    return out


def trainer_config(node: Any) -> tuple[str, Any]:
    """``(trainer name, its typed config)`` from the ``trainer`` node.

    The schema is the trainer's own config dataclass (``core.train.TRAINERS``); after the
    types, its ``from_config`` applies its adjustments and ``validate`` its checks.

    :raises UserError: for an unknown trainer or a bad value, as one paragraph.
    """
    from core.train import get_trainer

    values = dict(OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else node)  # type: ignore[arg-type]
    name = str(values.pop("name", "ppo"))
    values.pop("_target_", None)
    _, cls = get_trainer(name)
    obj = typed(cls, values, "trainer")
    try:
        return name, cls.from_config({f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)})
    except (ValueError, TypeError) as err:
        raise UserError(
            f"Invalid trainer config: {err}. Fix it in conf/trainer/{name}.yaml or on the command line "
            f"(trainer.<key>=<value>)."
        ) from None


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
        if isinstance(node, DictConfig):  # resolved in place: a merge cuts interpolations to the root (${cache_dir})
            node = OmegaConf.to_container(node, resolve=True)
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
            raise UserError(f"Invalid value under '{where}': {err}. Fix it {where_to_set(where)}.") from None
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
        return f"Unknown config key '{path}'.{did_you_mean(name, fields_)} '{section}' accepts: {', '.join(fields_)}."
    expected = _field_type(schema, str(key))
    value = getattr(err, "value", None)
    return (
        f"Invalid value for '{path}': expected {expected}, got {value!r} ({type(value).__name__}). "
        f"Set it {where_to_set(where)}, e.g. {path}=<{expected}>."
    )


def where_to_set(where: str) -> str:
    """Where a user sets a key under ``where``, in words: the YAML file that holds it, or, for a
    plugin that ships no ``conf/plugins/<name>.yaml`` (a third-party plugin's defaults are its
    ``Config``'s), the command line."""
    from core.resources import conf_dir

    parts = where.split(".")
    if parts[0] == "plugins" and len(parts) > 1:
        if not (conf_dir() / "plugins" / f"{parts[1]}.yaml").is_file():
            return (
                f"on the command line; plugin '{parts[1]}' has no YAML file here (its defaults are its Config class's)"
            )
        return f"in conf/plugins/{parts[1]}.yaml or on the command line"
    return "in the YAML file or on the command line"


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
    own = {k: v for k, v in OmegaConf.to_container(config, resolve=True).items() if k not in GROUPS}  # type: ignore[union-attr]
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
    plugins = {
        name: typed(config_class(module), plugins_node.get(name), f"plugins.{name}")
        for name, module in plugin_modules.items()
    }
    return Settings(config=config, run=run, plugins=plugins, **groups(config))


# -------------------------------------------------------------------------------------
# Run identity: what a run computes, apart from where and how it is recorded
# -------------------------------------------------------------------------------------

#: config keys left out of a run's identity: where and how a run is recorded, not what it computes
BOOKKEEPING = (
    "hydra",
    "run_name",
    "experiment",
    "cache_dir",
    "progress",
    "resume",
    "results_store",
    "save_policy",
    "tracking",
    "executor",
)
LLM_BOOKKEEPING = ("cache_path", "show_progress", "n_threads", "replay_only")  # llm.* keys that do not change a reply


def digest(obj: Any) -> str:
    """A short, stable hash of a JSON-able value (keys sorted; other values by their ``str``)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:20]


def config_key(config: DictConfig) -> str:
    """A hash of what a run computes: its resolved config without the bookkeeping keys.

    A study keys its cells by it; the LLM client scopes a run's replies by it, so that a
    replay finds the reply recorded at the same place of the same run.
    """
    container: dict[str, Any] = OmegaConf.to_container(config, resolve=True)  # type: ignore[assignment]
    for key in BOOKKEEPING:
        container.pop(key, None)
    for key in LLM_BOOKKEEPING:
        (container.get("llm") or {}).pop(key, None)
    return digest(container)


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


#: the core package's folder, which :func:`framework_hash` reads (a test points it at a copy)
CORE_ROOT = Path(__file__).parent


def framework_hash() -> str:
    """sha256 of every core module that shapes what a candidate is and how it trains.

    That is all of ``core/`` (prompts, code extraction and checks, vetting, preflight,
    the loop, the LLM layer, the sandbox, the trainers and tasks, records) except the
    modules in :data:`PRESENTATION`, which only show results. A finished training or
    study cell is reused only under the same hash, so a fix to any of them retrains.
    """
    root = CORE_ROOT
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if rel.parts[0] in PRESENTATION or rel.name == "__main__.py":
            continue
        digest.update(rel.as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]
