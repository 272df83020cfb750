"""The command line: ``python -m core [overrides]`` composes a run with Hydra and runs it."""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override, OverrideType
from hydra.errors import HydraException
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict
from rich.console import Console
from rich.markup import escape

from core.errors import UserError, did_you_mean
from core.preset import TAG as PRESET_TAG, apply_preset
from core.resources import conf_dir

console = Console(stderr=True)

_SETS = (OverrideType.CHANGE, OverrideType.ADD, OverrideType.FORCE_ADD)  # an override that gives a value


def parse_overrides(argv: list[str]) -> list[Override]:
    """The command line's overrides, read by Hydra's own override parser.

    Flags (``-m``, ``--config-name x``) and arguments Hydra's grammar refuses are left
    out: Hydra reports the latter itself, in its own words, when it composes.
    """
    parser = OverridesParser.create()
    found = []
    for arg in argv:
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            continue
        try:
            found.append(parser.parse_override(arg))
        except HydraException:
            continue
    return found


def _values(override: Override) -> list[object]:
    """An override's value, or each value of a sweep (``a,b``, ``choice(...)``)."""
    if override.is_sweep_override():
        return list(override.sweep_iterator())
    return [override.value()]


def _names(value: object) -> list[str]:
    """Plugin names in one value: a list of names, or one name."""
    if value is None:
        return []
    return [str(v) for v in value] if isinstance(value, (list, tuple)) else [str(value)]


def _plugin_lists(argv: list[str]) -> list[Override]:
    """The ``plugins=`` overrides that set the plugin list (``+plugins=[a,b]``, sweeps of lists)."""
    return [o for o in parse_overrides(argv) if o.key_or_group == "plugins" and o.type in _SETS]


def _plugin_key(override: Override) -> tuple[str, str] | None:
    """``(plugin, key)`` of an override that sets ``plugins.<plugin>.<key>`` (not a deletion)."""
    parts = override.key_or_group.split(".", 2)
    if override.type in _SETS and len(parts) == 3 and parts[0] == "plugins" and parts[1] and parts[2]:
        return parts[1], parts[2]
    return None


def requested_plugins(argv: list[str]) -> list[str]:
    """Plugin names in ``+plugins=[a,b]`` / sweep ``+plugins=[a],[b],[]`` overrides."""
    names: list[str] = []
    for override in _plugin_lists(argv):
        for value in _values(override):
            names += [n for n in _names(value) if n not in names]
    return names


def plugin_arms(argv: list[str]) -> list[list[str]] | None:
    """The plugin list of each arm a ``+plugins=`` override sweeps, or None without one.

    ``+plugins=[eureka],[]`` -> ``[["eureka"], []]``; ``+plugins=[a,b]`` -> ``[["a", "b"]]``;
    a bare ``+plugins=a,b`` (Hydra's sweep of single options) -> ``[["a"], ["b"]]``.
    """
    arms: list[list[str]] | None = None
    for override in _plugin_lists(argv):
        arms = (arms or []) + [_names(value) for value in _values(override)]
    return arms


def check_argv(argv: list[str]) -> None:
    """Fail early, in one paragraph, on an unknown plugin or env name or plugin key.

    Runs before Hydra composes the config, whose own messages for these mistakes point
    the wrong way (for an unknown key it suggests ``+plugins.<name>.<key>=...``, which
    would silently add a key nobody reads).
    """
    from core.registry import catalogue, check_names

    known = catalogue()
    requested = requested_plugins(argv)
    check_names(requested, known)
    parsed = parse_overrides(argv)
    for override in parsed:
        found = _plugin_key(override)
        if found:
            name, key = found
            check_plugin_override(name, key, requested, known, _other_config(argv))
            if override.type == OverrideType.ADD:
                arg, value = override.input_line, override.input_line.split("=", 1)[1]  # type: ignore[union-attr]
                raise UserError(
                    f"'{arg}': '+' adds a key, but 'plugins.{name}.{key}' is a field of the plugin's "
                    f"schema; write 'plugins.{name}.{key}={value}' without '+'. In a study whose arms "
                    f"differ in plugins ('+plugins=[{name}],[]'), arms without '{name}' ignore that knob "
                    "and record it (docs/ablations.md, 'Sweeping a plugin's knob')."
                )
    # an unknown option of any config group (env=, trainer=, llm=, +preset=, ...): one paragraph and
    # exit status 2, as for an unknown env or plugin (Hydra's own message exited 1)
    groups = {
        d.name: sorted(p.stem for p in d.glob("*.yaml"))
        for d in conf_dir().iterdir()
        if d.is_dir() and d.name not in ("hydra", "plugins", "study")
    }
    for override in parsed:
        options = groups.get(override.key_or_group)
        if (
            options is None
            or override.package is not None
            or override.type not in (OverrideType.CHANGE, OverrideType.ADD)
        ):
            continue
        group = override.key_or_group
        for name in (str(v) for v in _values(override)):
            if name not in options:
                hint = " Any gymnasium id works with env=gym env.id=<id>." if group == "env" else ""
                raise UserError(
                    f"Unknown {group} '{name}'.{did_you_mean(name, options)} Available {group}s: "
                    f"{', '.join(options)}.{hint}"
                )


def sweep_ready(argv: list[str]) -> list[str]:
    """``argv`` with each plain ``plugins.<name>.<key>=v`` that some arm of a ``+plugins=``
    sweep lacks written ``++plugins.<name>.<key>=v``, so Hydra composes that arm too (it
    refuses a key under a plugin the arm does not load); :func:`ignored_knobs` then drops
    it from that arm's config. Call after :func:`check_argv`, which checked the key.
    """
    arms = plugin_arms(argv)
    if not arms:
        return list(argv)
    lacking = {
        o.input_line
        for o in parse_overrides(argv)
        if o.type == OverrideType.CHANGE and (found := _plugin_key(o)) and any(found[0] not in arm for arm in arms)
    }
    return ["++" + arg if arg in lacking else arg for arg in argv]


#: The parent-run tag that lists the overrides a run ignored (a knob of a plugin it does not run).
IGNORED_TAG = "llm4rl.ignored_overrides"


def ignored_knobs(cfg: DictConfig, overrides: list[str]) -> list[str]:
    """Drop from ``cfg`` the plugin knobs this run's ``overrides`` set for plugins it does not run.

    ``overrides`` are one run's (one arm of a sweep): the knobs of a plugin its
    ``+plugins=[...]`` leaves out are removed from ``cfg.plugins`` (which would otherwise
    hold a node for that plugin) and returned, to be recorded. Without a ``+plugins=``
    override nothing is dropped (the config file decides the plugins).
    """
    arms = plugin_arms(list(overrides))
    if not arms or len(arms) != 1:
        return []
    enabled = set(arms[0])
    ignored = [
        (o, found[0]) for o in parse_overrides(list(overrides)) if (found := _plugin_key(o)) and found[0] not in enabled
    ]
    with open_dict(cfg):
        for name in {name for _, name in ignored}:
            if cfg.get("plugins") is not None and name in cfg.plugins:
                del cfg.plugins[name]
    return [o.input_line.lstrip("+") for o, _ in ignored]  # type: ignore[union-attr]


def _other_config(argv: list[str]) -> bool:
    """Whether the run's config may come from another file (which could enable plugins itself)."""
    return any(a.split("=")[0] in ("--config-name", "-cn", "--config-dir", "-cd", "--config-path", "-cp") for a in argv)


def check_plugin_override(name: str, key: str, requested: list[str], known: dict, other_config: bool = False) -> None:
    """``plugins.<name>.<key>=...``: the plugin must be enabled and ``key`` a field of its schema."""
    from core.config import check_key, config_class
    from core.registry import load_module

    where = f"plugins.{name}"
    if name not in known:
        raise UserError(
            f"'{where}.{key}' sets a key of plugin '{name}', which does not exist."
            f"{did_you_mean(name, [*requested, *known])} "
            f"Plugins enabled in this run: {', '.join(requested) or 'none'}."
        )
    if name not in requested and not other_config:
        raise UserError(
            f"'{where}.{key}' is set but plugin '{name}' is not enabled in this run. Enable it with "
            f"+plugins=[{name}] (or add it to the list you have); in a study, enable it in at least one arm "
            f"('+plugins=[{name}],[]'): arms without it ignore the knob "
            "(docs/ablations.md, 'Sweeping a plugin's knob')."
        )
    check_key(config_class(load_module(known[name])), key, where)


def register_third_party_configs() -> None:
    """Give entry-point plugins without a conf/plugins file a config node: their ``Config`` schema."""
    from core.config import config_class
    from core.registry import entry_point_plugins, load_module

    store = ConfigStore.instance()
    shipped = {p.stem for p in (conf_dir() / "plugins").glob("*.yaml")}
    for info in entry_point_plugins():
        if info.name not in shipped:
            # the schema's defaults as plain values, like a YAML file: a wrong value then fails in
            # core.config.validate as one paragraph, not inside Hydra's composition
            defaults = OmegaConf.to_container(OmegaConf.structured(config_class(load_module(info))))
            store.store(group="plugins", name=info.name, node=defaults, package=f"plugins.{info.name}")


def print_summary(summary, steps: list[str] | None = None) -> None:
    out = Console()
    out.rule("[bold]llm4rl run")
    counts = summary.counts if summary.failed else str(summary.candidates)  # "8 sampled, 6 usable, 5 trained"
    out.print(
        f"fitness ({summary.fitness_name}): [bold]{summary.fitness:.4g}[/bold]  best candidate: {summary.best_id}"
    )
    if summary.final_fitness:
        vals = ", ".join(f"{v:.4g}" for v in summary.final_fitness)
        out.print(f"best candidate over {len(summary.final_fitness)} seeds: {vals}")
    out.print(f"candidates: {counts}  frames: {summary.frames:,}  wall time: {summary.seconds:.1f} s")
    if summary.failed == summary.candidates and summary.first_error:
        out.print("[red]every candidate failed; the first error:[/red]")
        out.print(summary.first_error.strip()[-1200:], markup=False, highlight=False)
    if summary.results_store:
        reused = (
            f"{summary.reused} training(s) reused from an earlier run with the same code, config and seed; "
            "resume=false retrains"
            if summary.reused
            else "none reused"
        )
        out.print(f"results store: {summary.results_store} ({reused})", markup=False, highlight=False)
    if summary.llm:
        llm = summary.llm
        hits = int(llm.get("llm/cache_hits", 0))
        out.print(
            f"LLM: {int(llm.get('llm/calls', 0))} calls, {hits} cache hits, "
            f"{int(llm.get('llm/completion_tokens', 0))} completion tokens"
        )
        if summary.llm_cache:
            earlier = (
                f"{hits} answered from it (replies an earlier run with the same request wrote: no model time); "
                if hits
                else ""
            )
            out.print(
                f"LLM replies kept in {summary.llm_cache}: {earlier}llm.cache_path=<file> uses another, "
                "llm.cache=false none",
                markup=False,
                highlight=False,
                soft_wrap=True,
            )
    for part in summary.contributions:  # what each method's LLM put in; nothing is said in yellow
        role = f" ({part.role})" if part.role else ""
        line = f"{part.plugin}{role}: {part.text}"
        out.print(f"[yellow]warning: {escape(line)}[/yellow]" if part.nothing else escape(line), highlight=False)
    out.print(
        f"MLflow run: {summary.run_id}   look at it: {summary.ui_hint}", markup=False, highlight=False, soft_wrap=True
    )  # a command stays one line
    for line in steps or []:
        out.print(line, markup=False, highlight=False, soft_wrap=True)  # a command stays one line


def check_credentials(cfg: DictConfig) -> None:
    """Refuse, before any run is opened, a run whose plugins need an LLM whose key is not set.

    A run without plugins calls no LLM; a run that replays recorded replies
    (``llm.replay_only``) needs no key either.
    """
    import os

    from core.llm.errors import missing_key

    llm = cfg.get("llm") or {}
    env = llm.get("api_key_env")
    if cfg.get("plugins") and env and not llm.get("replay_only") and not os.environ.get(env):
        raise missing_key(str(llm.get("model")), str(env))


def run_one(cfg: DictConfig) -> float:
    """One run; returns the fitness so that Hydra sweepers (Optuna) can optimise it.

    Kept undecorated and importable so that launchers which ship the task function to
    other processes (``hydra/launcher=ray``) pickle it by reference.
    """
    from core.quiet import quiet_third_party

    quiet_third_party()
    overrides = list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else []
    preset = apply_preset(cfg, overrides)  # +preset=<name>: its plugin knobs to the enabled plugins only
    try:
        check_credentials(cfg)  # before the training stack is imported: a missing key is said in a second or two
    except UserError as err:
        console.print(f"[bold red]error:[/bold red] {escape(str(err))}")
        sys.exit(2)
    from core.loop import run_experiment

    tags = {PRESET_TAG: preset} if preset else {}
    ignored = ignored_knobs(cfg, overrides)
    if ignored:
        tags[IGNORED_TAG] = " ".join(ignored)
        console.print(
            f"ignored in this run, whose plugins do not include theirs: {', '.join(ignored)} (tag {IGNORED_TAG})",
            markup=False,
            highlight=False,
        )
    try:
        summary = run_experiment(cfg, tags=tags)
    except UserError as err:
        console.print(f"[bold red]error:[/bold red] {escape(str(err))}")  # keeps "llm4rl[extra]"
        sys.exit(2)
    from core.progress import next_steps

    print_summary(summary, next_steps(str(cfg.tracking.get("uri", "")), str(cfg.experiment))[:1])
    if summary.failed == summary.candidates and HydraConfig.get().mode == RunMode.RUN:
        sys.exit(1)  # a single run that produced nothing is a failure; a sweep goes on
    return summary.fitness


hydra_main = hydra.main(version_base=None, config_path=str(conf_dir()), config_name="config")(run_one)


def main() -> None:
    from core.quiet import quiet_third_party

    quiet_third_party()
    argv = sys.argv[1:]
    try:
        check_argv(argv)
        register_third_party_configs()
        sys.argv[1:] = sweep_ready(argv)
    except UserError as err:
        console.print(f"[bold red]error:[/bold red] {escape(str(err))}")  # keeps "llm4rl[extra]"
        sys.exit(2)
    sys.argv[0] = str(Path(sys.argv[0]).with_name("core"))
    from core import interrupts

    interrupts.install()
    try:
        hydra_main()
    except KeyboardInterrupt:  # its MLflow runs are ended KILLED on the way out
        console.print(interrupts.RESUME_HINT, markup=False, highlight=False, soft_wrap=True)
        interrupts.leave(130)
    if any(a in ("-m", "--multirun") for a in argv):  # a study: what to do with it next
        from core.progress import next_steps

        Console().rule("[bold]study done")
        for line in next_steps(*study_target(argv)):
            Console().print(line, markup=False, highlight=False, soft_wrap=True)


def study_target(argv: list[str]) -> tuple[str, str]:
    """The tracking URI and experiment a command line's runs went to (its overrides, else the config's)."""
    values = {
        o.key_or_group: o.input_line.split("=", 1)[1] if o.is_sweep_override() else str(o.value())  # type: ignore[union-attr]
        for o in parse_overrides(argv)
        if o.type == OverrideType.CHANGE
    }
    experiment = values.get("experiment") or str(OmegaConf.load(conf_dir() / "config.yaml").get("experiment", "llm4rl"))  # type: ignore[arg-type]
    uri = values.get("tracking.uri")
    if not uri:
        tracking = conf_dir() / "tracking" / f"{values.get('tracking', 'mlflow')}.yaml"
        uri = str(OmegaConf.load(tracking).get("uri", "")) if tracking.is_file() else ""  # type: ignore[arg-type]
    return uri, experiment
