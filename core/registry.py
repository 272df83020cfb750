"""Plugin discovery: the built-in catalogue, third-party entry points, the plugin manager.

Built-in plugins are listed in ``registry.yaml``; third-party packages declare an entry
point in the group ``llm4rl.plugins`` (``name = "package.module"``). Setting
``LLM4RL_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points.

``python -m core.registry`` prints the catalogue.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Collection, Iterable

import pluggy
import yaml

from core import hookspecs
from core.config import PluginConfig, Settings, config_class
from core.errors import UserError, did_you_mean
from core.resources import registry_path

ENTRY_POINT_GROUP = "llm4rl.plugins"
AUTOLOAD_ENV = "LLM4RL_DISABLE_PLUGIN_AUTOLOAD"


@dataclass
class PluginInfo:
    """One catalogue entry."""

    name: str
    module: str = ""  # a planned entry may have none yet
    roles: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    paper: dict[str, str] = field(default_factory=dict)
    status: str = "implemented"
    source: str = "builtin"  # "builtin" or the distribution that provides it

    @property
    def installed(self) -> bool:
        """Whether the module can be imported here."""
        if not self.module:
            return False
        try:
            return importlib.util.find_spec(self.module) is not None
        except ModuleNotFoundError:
            return False

    @property
    def implemented(self) -> bool:
        return self.status != "planned" and self.installed


def builtin_plugins() -> list[PluginInfo]:
    """The entries of ``registry.yaml``."""
    data = yaml.safe_load(registry_path().read_text())
    return [PluginInfo(**entry) for entry in data.get("plugins", [])]


def entry_point_plugins() -> list[PluginInfo]:
    """Plugins that installed packages declare under ``llm4rl.plugins``."""
    if os.environ.get(AUTOLOAD_ENV):
        return []
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        module = importlib.import_module(ep.value)
        found.append(
            PluginInfo(
                name=ep.name,
                module=ep.value,
                roles=list(getattr(module, "ROLES", [])),
                hooks=sorted(_hookimpl_names(getattr(module, "Plugin", module))),
                paper=dict(getattr(module, "PAPER", {})),
                source=ep.dist.name if ep.dist else "entry point",
            )
        )
    return found


def catalogue() -> dict[str, PluginInfo]:
    """Every known plugin by name: built-ins first, then third-party ones."""
    plugins: dict[str, PluginInfo] = {}
    for info in [*builtin_plugins(), *entry_point_plugins()]:
        plugins.setdefault(info.name, info)
    return plugins


def check_names(names: Iterable[str], known: dict[str, PluginInfo] | None = None) -> None:
    """Raise a UserError for a plugin name that is unknown or not implemented."""
    known = catalogue() if known is None else known
    for name in names:
        if name not in known:
            available = ", ".join(sorted(known))
            raise UserError(
                f"Unknown plugin '{name}'.{did_you_mean(name, list(known))} "
                f"Available plugins: {available}. "
                "`python -m core.registry` lists them with their roles and papers."
            )
        info = known[name]
        if not info.implemented:
            why = "is planned but not implemented yet" if info.status == "planned" else "cannot be imported"
            ready = ", ".join(sorted(n for n, i in known.items() if i.implemented)) or "none"
            where = f" ({info.module})" if info.module else ""
            raise UserError(f"Plugin '{name}'{where} {why}. Plugins ready to use: {ready}.")


def load_module(info: PluginInfo) -> ModuleType:
    return importlib.import_module(info.module)


def load_plugins(names: Iterable[str]) -> dict[str, ModuleType]:
    """The modules of the named plugins, in order (names checked against the catalogue)."""
    names = list(names)
    known = catalogue()
    check_names(names, known)
    return {name: load_module(known[name]) for name in names}


def plugin_object(module: ModuleType, config: PluginConfig) -> object:
    """What to register for one run: a new ``Plugin(config)`` if the module has a class, else the module.

    A plugin that keeps state is a class named ``Plugin`` whose ``@hookimpl`` methods
    hold its hooks; each run gets its own instance, so two runs in one process share
    nothing. A module of plain ``@hookimpl`` functions is registered as it is (stateless).
    """
    cls = getattr(module, "Plugin", None)
    if cls is None:
        return module
    if not isinstance(cls, type):
        raise UserError(f"{module.__name__}.Plugin must be a class whose @hookimpl methods are the plugin's hooks.")
    return cls(config)


def make_plugin_manager(
    settings: Settings | None = None,
    modules: dict[str, ModuleType] | None = None,
    extra: Iterable[object] = (),
) -> pluggy.PluginManager:
    """A plugin manager with the hook specs and one run's plugin objects registered.

    :param settings: the run's validated settings (each plugin's typed config); None
        registers the plugins with their default configs.
    :param modules: enabled plugin name -> module (:func:`load_plugins`); default: the
        plugins ``settings`` names.
    :param extra: further plugin objects to register (tests, embedding applications).
    :raises UserError: for a hook name that is no spec or an argument a spec lacks,
        with the closest names.

    A plugin that owns a hook (it alone calls it, others may answer it) declares the spec
    itself: a ``HOOKSPECS`` class of ``@hookspec`` functions in its module, added here
    before any plugin registers (as pytest's ``pytest_addhooks``).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if modules is None:
        modules = load_plugins(settings.plugins if settings is not None else ())
    for name, source in [*modules.items(), *((None, obj) for obj in extra)]:
        _add_hooks(pm, source, name)
    for name, module in modules.items():
        config = settings.plugins.get(name) if settings is not None else None
        if config is None:
            config = config_class(module)()
        _register(pm, plugin_object(module, config), name)
    for obj in extra:
        _register(pm, obj, None)
    try:
        pm.check_pending()  # a misspelt hook name fails here, not silently
    except pluggy.PluginValidationError as err:
        raise UserError(_explain_validation(err, pm, pm.get_name(err.plugin))) from None
    return pm


def _add_hooks(pm: pluggy.PluginManager, source: object, name: str | None) -> None:
    """Add the hook specs ``source`` declares in its ``HOOKSPECS`` class, if any."""
    specs = getattr(source, "HOOKSPECS", None)
    if specs is None:
        return
    try:
        pm.add_hookspecs(specs)
    except ValueError as err:  # no marked spec in it, or a hook another plugin declared already
        raise UserError(f"Plugin '{name or source}': its HOOKSPECS cannot be added: {err}") from None


def _register(pm: pluggy.PluginManager, obj: object, name: str | None) -> None:
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as err:
        raise UserError(_explain_validation(err, pm, name)) from None
    unmarked = unmarked_hooks(obj, pm)
    if unmarked:  # pluggy registers only marked methods: these would never be called
        import warnings

        warnings.warn(
            f"Plugin '{name or obj}' has {', '.join(unmarked)} named like hook(s) but not marked "
            "@hookimpl, so they are never called; mark them with `@hookimpl` (from core.plugin).",
            UserWarning,
            stacklevel=3,
        )


def _explain_validation(err: pluggy.PluginValidationError, pm: pluggy.PluginManager, name: str | None = None) -> str:
    """One paragraph for pluggy's complaint about a plugin's hooks, with the closest names."""
    spec_args = _spec_args(pm)
    specs = sorted(spec_args)
    obj = err.plugin
    where = getattr(obj, "__name__", None) or f"{type(obj).__module__}.{type(obj).__qualname__}"
    plugin = f"'{name}' ({where})" if name and not name.isdigit() else where  # pluggy names unnamed objects by id
    for hook in _hookimpl_names(obj):
        if hook not in specs:
            return (
                f"Plugin {plugin} implements '{hook}', which is not a hook.{did_you_mean(hook, specs)} "
                f"Hooks: {', '.join(specs)} (core/hookspecs.py documents each)."
            )
    text = str(err)
    found = re.search(r"for hook '(\w+)'", text)
    for hook in [found.group(1)] if found else [h for h in _hookimpl_names(obj) if h in text]:
        args = spec_args.get(hook, [])
        bad = [a for a in inspect.signature(getattr(obj, hook)).parameters if a not in args and a != "self"]
        hint = "".join(did_you_mean(a, args) for a in bad)
        return (
            f"Plugin {plugin}: hook '{hook}' takes argument(s) {', '.join(repr(b) for b in bad)} that the spec "
            f"does not pass.{hint} '{hook}' passes: {', '.join(args)} (take any subset of them)."
        )
    return f"Plugin {plugin} does not match the hook specs: {' '.join(text.split())}"


def _spec_args(pm: pluggy.PluginManager | None = None) -> dict[str, list[str]]:
    """Every hook with a spec, name -> the arguments it passes: the core's, and (given ``pm``)
    those its plugins added."""
    if pm is None:
        return {
            n: list(inspect.signature(f).parameters)
            for n, f in vars(hookspecs).items()
            if hasattr(f, f"{hookspecs.PROJECT}_spec")
        }
    # the relay holds a caller per hook name, a spec-less one for each name only implemented
    return {n: list(c.spec.argnames) for n, c in vars(pm.hook).items() if c.spec is not None}


def _hookimpl_names(obj: object) -> list[str]:
    return [n for n in dir(obj) if not n.startswith("__") and _is_hookimpl(getattr(obj, n, None))]


def call_each(pm: pluggy.PluginManager, name: str, skip: Collection[str] = (), **kwargs: Any) -> list[tuple[str, Any]]:
    """Call a broadcast hook once per plugin that implements it; ``(plugin name, result)`` for each.

    pluggy's own call drops None results, so its list of results cannot be paired with
    the plugins that gave them. Here each plugin gets a call of its own, through pluggy
    (:func:`call_plugin`), so wrappers wrap each plugin's result and tracing sees every
    call. The pairs keep pluggy's call order (last registered first), None results included.
    ``skip``: plugins not called at all (e.g. those whose ``iterations`` are over).
    """
    impls = _implementations(pm, name)
    plugins = dict.fromkeys(impl.plugin_name for impl in impls if impl.plugin_name not in skip)  # in order, once each
    return [(plugin, _call_one(pm, name, impls, plugin, kwargs)) for plugin in plugins]


def call_first(pm: pluggy.PluginManager, name: str, skip: Collection[str] = (), **kwargs: Any) -> Any:
    """Call a ``firstresult`` hook through pluggy, leaving out the plugins named in ``skip``."""
    if not skip:
        return getattr(pm.hook, name)(**kwargs)
    left_out = [plugin for plugin in (pm.get_plugin(n) for n in skip) if plugin is not None]
    return pm.subset_hook_caller(name, left_out)(**kwargs)


def call_plugin(pm: pluggy.PluginManager, name: str, plugin: str, **kwargs: Any) -> Any:
    """One plugin's result of a broadcast hook (None when it has no implementation of it).

    The hook is called through pluggy with every other plugin's implementation left out
    (:meth:`pluggy.PluginManager.subset_hook_caller`): the wrappers (``@hookimpl(wrapper=True)``,
    whichever plugin holds them) wrap this plugin's call, never a bare ``impl.function``.
    """
    impls = _implementations(pm, name)
    if not any(impl.plugin_name == plugin for impl in impls):
        return None
    return _call_one(pm, name, impls, plugin, kwargs)


def _implementations(pm: pluggy.PluginManager, name: str) -> list[pluggy.HookImpl]:
    """The hook's implementations other than wrappers, in pluggy's call order."""
    return [impl for impl in reversed(getattr(pm.hook, name).get_hookimpls()) if not (impl.wrapper or impl.hookwrapper)]


def _call_one(
    pm: pluggy.PluginManager, name: str, impls: list[pluggy.HookImpl], plugin: str, kwargs: dict[str, Any]
) -> Any:
    others = {impl.plugin for impl in impls if impl.plugin_name != plugin}
    results = pm.subset_hook_caller(name, others)(**kwargs)
    if len(results) > 1:  # only a wrapper can add results to one implementation's call
        raise UserError(
            f"Hook '{name}' gave {len(results)} results for plugin '{plugin}' alone: a wrapper of a "
            "broadcast hook must return the list it got, with at most one result in it."
        )
    return results[0] if results else None


def _is_hookimpl(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, f"{hookspecs.PROJECT}_impl")


def hook_problem(info: PluginInfo) -> str:
    """What is wrong with a plugin's hooks ("" when nothing): a name that is no hook, an
    argument a spec does not pass, or a method named like a hook without ``@hookimpl``."""
    if not info.installed:
        return "not installed"
    try:
        module = load_module(info)
        pm = make_plugin_manager(None, {info.name: module})
    except UserError as err:
        return str(err)
    except Exception as err:  # an import error of a third-party plugin is its problem, shown
        return f"{type(err).__name__}: {err}"
    unmarked = unmarked_hooks(plugin_object(module, config_class(module)()), pm)
    return f"{', '.join(unmarked)} look(s) like hooks but lack @hookimpl" if unmarked else ""


def unmarked_hooks(obj: object, pm: pluggy.PluginManager | None = None) -> list[str]:
    """Methods of a plugin object named like a hook spec but not marked ``@hookimpl`` (pluggy ignores them);
    the specs are the core's, and those ``pm``'s plugins added when it is given."""
    return sorted(n for n in _spec_args(pm) if callable(getattr(obj, n, None)) and not _is_hookimpl(getattr(obj, n)))


def print_catalogue(width: int = 100) -> int:
    """Print the catalogue as a table (plugin, module, roles, hooks, paper) that fits ``width``
    columns, the problems of plugins whose hooks fail validation, and the taxonomy; returns
    the number of such plugins."""
    from rich.console import Console
    from rich.table import Table

    infos = list(catalogue().values())
    problems = {i.name: hook_problem(i) for i in infos if i.status != "planned"}
    from rich import box

    table = Table(
        title="llm4rl plugins (+plugins=[NAME,...] enables them in a run)",
        title_justify="left",
        box=box.SIMPLE_HEAD,
        pad_edge=False,
    )
    # a third-party plugin's name carries the distribution that provides it
    labels = {i.name: i.name if i.source == "builtin" else f"{i.name} ({i.source})" for i in infos}
    table.add_column("plugin", no_wrap=True, min_width=max(len(label) for label in labels.values()))
    table.add_column("module", no_wrap=True, min_width=max(len(i.module) for i in infos))
    table.add_column("role(s)", min_width=11, max_width=12)
    table.add_column("hooks", no_wrap=True, min_width=7)
    table.add_column("paper", no_wrap=True, overflow="ellipsis", max_width=30)
    for info in infos:
        title = info.paper.get("title", "").split(":")[0]
        acronym = re.search(r"\(([A-Z][A-Za-z0-9-]+)\)", title)
        title = acronym.group(1) if acronym else title
        title += f", {info.paper['venue']}" if info.paper.get("venue") else ""
        if info.status == "planned" or not info.installed:
            check = "planned" if info.status == "planned" else "not installed"
        else:
            check = "ok" if not problems[info.name] else "[red]invalid[/red]"
        table.add_row(labels[info.name], info.module, ", ".join(info.roles), check, title)
    console = Console(width=width)
    console.print(table)
    bad = {n: p for n, p in problems.items() if p and p != "not installed"}
    for name, problem in bad.items():
        console.print(f"[red]{name}[/red]: {problem}", highlight=False)
    console.print(taxonomy_text(infos, width), highlight=False)
    console.print(
        "hooks: ok = every hook implementation matches core/hookspecs.py.\n"
        "A plugin's page: docs/plugins/NAME.md; its settings: conf/plugins/NAME.yaml.",
        highlight=False,
    )
    return len(bad)


def taxonomy_text(infos: Iterable[PluginInfo], width: int = 100) -> str:
    """Per role of the taxonomy: the methods implemented and those still planned."""
    import textwrap

    infos = list(infos)
    roles = sorted({r for i in infos for r in i.roles})
    lines = ["By role (implemented | planned):"]
    for role in roles:
        done = [i.name for i in infos if role in i.roles and i.implemented]
        left = [i.name for i in infos if role in i.roles and not i.implemented]
        line = f"  {role:<12} {', '.join(done) or '-'} | {', '.join(left) or '-'}"
        lines += textwrap.wrap(line, width=width, subsequent_indent=" " * 15)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``python -m core.registry``: the catalogue; exit status 1 if a plugin's hooks fail validation."""
    import argparse
    import shutil

    parser = argparse.ArgumentParser(
        prog="python -m core.registry",
        description="List the llm4rl plugins: built-ins (registry.yaml) and installed third-party ones "
        "(entry point group llm4rl.plugins), with their roles, papers and whether their hooks "
        "match the hook specs.",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=min(100, shutil.get_terminal_size((100, 24)).columns),
        help="columns of the table (default: the terminal's, at most 100)",
    )
    args = parser.parse_args(argv)
    return 1 if print_catalogue(max(60, args.width)) else 0


if __name__ == "__main__":
    raise SystemExit(main())
