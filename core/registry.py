"""Plugin discovery: the built-in catalogue, third-party entry points, the plugin manager.

Built-in plugins are listed in ``registry.yaml``; third-party packages declare an entry
point in the group ``llm4rl.plugins`` (``name = "package.module"``). Setting
``LLM4RL_DISABLE_PLUGIN_AUTOLOAD=1`` skips entry points.

``python -m core.registry`` prints the catalogue.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from types import ModuleType
from typing import Any, Iterable

import pluggy
import yaml

from core import hookspecs
from core.errors import UserError, did_you_mean
from core.resources import registry_path

ENTRY_POINT_GROUP = "llm4rl.plugins"
AUTOLOAD_ENV = "LLM4RL_DISABLE_PLUGIN_AUTOLOAD"


@dataclass
class PluginInfo:
    """One catalogue entry."""

    name: str
    module: str
    roles: list[str] = field(default_factory=list)
    hooks: list[str] = field(default_factory=list)
    paper: dict[str, str] = field(default_factory=dict)
    status: str = "implemented"
    source: str = "builtin"  # "builtin" or the distribution that provides it

    @property
    def installed(self) -> bool:
        """Whether the module can be imported here."""
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
                hooks=sorted(n for n in dir(module) if _is_hookimpl(getattr(module, n))),
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
            raise UserError(f"Plugin '{name}' ({info.module}) {why}. Plugins ready to use: {ready}.")


def load_module(info: PluginInfo) -> ModuleType:
    return importlib.import_module(info.module)


def plugin_defaults(info: PluginInfo) -> dict[str, Any]:
    """A third-party plugin's default config: its module's ``CONFIG`` mapping, if any."""
    return dict(getattr(load_module(info), "CONFIG", {}) or {})


def make_plugin_manager(enabled: Iterable[str], extra: Iterable[object] = ()) -> pluggy.PluginManager:
    """A plugin manager with the hook specs and the enabled plugins registered.

    :param enabled: plugin names (checked against the catalogue).
    :param extra: further plugin objects to register (tests, embedding applications).
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    names = list(enabled)
    known = catalogue()
    check_names(names, known)
    for name in names:
        pm.register(load_module(known[name]), name=name)
    for obj in extra:
        pm.register(obj)
    pm.check_pending()  # a misspelt hook name fails here, not silently
    return pm


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
    Console(width=max(120, Console().width)).print(table)


def main(argv: list[str] | None = None) -> int:
    import sys

    args = sys.argv[1:] if argv is None else argv
    enabled = [a for a in args if not a.startswith("-")]
    print_catalogue(enabled)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
