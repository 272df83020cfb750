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
from typing import Any, Iterable

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
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if modules is None:
        modules = load_plugins(settings.plugins if settings is not None else ())
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
        raise UserError(_explain_validation(err, pm.get_name(err.plugin))) from None
    return pm


def _register(pm: pluggy.PluginManager, obj: object, name: str | None) -> None:
    try:
        pm.register(obj, name=name)
    except pluggy.PluginValidationError as err:
        raise UserError(_explain_validation(err, name)) from None


def _explain_validation(err: pluggy.PluginValidationError, name: str | None = None) -> str:
    """One paragraph for pluggy's complaint about a plugin's hooks, with the closest names."""
    specs = sorted(n for n in dir(hookspecs) if hasattr(getattr(hookspecs, n), f"{hookspecs.PROJECT}_spec"))
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
        spec_args = list(inspect.signature(getattr(hookspecs, hook)).parameters)
        bad = [a for a in inspect.signature(getattr(obj, hook)).parameters if a not in spec_args and a != "self"]
        hint = "".join(did_you_mean(a, spec_args) for a in bad)
        return (
            f"Plugin {plugin}: hook '{hook}' takes argument(s) {', '.join(repr(b) for b in bad)} that the spec "
            f"does not pass.{hint} '{hook}' passes: {', '.join(spec_args)} (take any subset of them)."
        )
    return f"Plugin {plugin} does not match the hook specs: {' '.join(text.split())}"


def _hookimpl_names(obj: object) -> list[str]:
    return [n for n in dir(obj) if not n.startswith("__") and _is_hookimpl(getattr(obj, n, None))]


def call_each(caller: Any, **kwargs: Any) -> list[tuple[str, Any]]:
    """Call every implementation of a broadcast hook; ``(plugin name, result)`` for each.

    pluggy's own call drops None results, so a list of results cannot be paired with
    the plugins that gave them; this keeps the pairing (None results included), in
    pluggy's call order (last registered first).
    """
    out = []
    for impl in reversed(caller.get_hookimpls()):
        args = [kwargs[name] for name in impl.argnames]
        out.append((impl.plugin_name, impl.function(*args)))
    return out


def _is_hookimpl(obj: Any) -> bool:
    return callable(obj) and hasattr(obj, f"{hookspecs.PROJECT}_impl")


def print_catalogue(enabled: Iterable[str] = ()) -> None:
    """Print the catalogue as a table: name, installed, enabled, roles, status, paper."""
    from rich.console import Console
    from rich.table import Table

    enabled = set(enabled)
    table = Table(title="llm4rl plugins", show_lines=False)
    for column in ("plugin", "module", "installed", "enabled", "role(s)", "status", "paper"):
        table.add_column(column, overflow="fold")
    for info in catalogue().values():
        paper = info.paper.get("title", "")
        if info.paper.get("venue"):
            paper += f" ({info.paper['venue']})"
        status = "implemented" if info.implemented else ("planned" if info.status == "planned" else "missing")
        table.add_row(
            info.name,
            info.module,
            "yes" if info.installed else "no",
            "yes" if info.name in enabled else "no",
            ", ".join(info.roles),
            status if info.source == "builtin" else f"{status} ({info.source})",
            paper,
        )
    console = Console(width=max(120, Console().width))
    console.print(table)
    console.print(taxonomy_text(catalogue().values()), highlight=False)


def taxonomy_text(infos: Iterable[PluginInfo]) -> str:
    """Per role of the taxonomy: the methods implemented and those still planned."""
    infos = list(infos)
    roles = sorted({r for i in infos for r in i.roles})
    lines = ["By role (implemented | planned):"]
    for role in roles:
        done = [i.name for i in infos if role in i.roles and i.implemented]
        left = [i.name for i in infos if role in i.roles and not i.implemented]
        lines.append(f"  {role:<12} {', '.join(done) or '-'} | {', '.join(left) or '-'}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    enabled = [a for a in args if not a.startswith("-")]
    print_catalogue(enabled)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
