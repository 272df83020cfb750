"""Presets: named budgets (``+preset=quick``) that shrink a run for a first try.

A preset is a config group file ``conf/preset/<name>.yaml`` in Hydra's global package.
Its top-level keys (``trainer.frames``, ...) merge like any config; its plugin knobs sit
under ``preset.plugins.<plugin>`` and :func:`apply_preset` gives them to the plugins the
run enables and to no other, so a preset never enables a plugin, whatever the order of
``+preset=`` and ``+plugins=`` on the command line, and a knob given on the command line
(``plugins.eureka.samples=8``) wins over the preset's.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from omegaconf import DictConfig, OmegaConf, open_dict

#: the key under which a preset keeps its plugin knobs; removed by :func:`apply_preset`
KEY = "preset"
#: the parent-run tag naming the preset a run used
TAG = "llm4rl.preset"

_KNOB = re.compile(r"^\+{0,2}plugins\.([A-Za-z_][\w\-]*)\.([\w.]+)=")


def apply_preset(cfg: DictConfig, overrides: Iterable[str] = ()) -> str | None:
    """Move the preset's plugin knobs (``preset.plugins.<name>.<key>``) into ``cfg.plugins``.

    Only plugins ``cfg.plugins`` already holds (those the run enables) get theirs; a knob
    that ``overrides`` (the run's command-line overrides) set keeps the command line's
    value. The ``preset`` node is removed from ``cfg``.

    :return: the preset's name, or None when the config holds no preset.
    """
    node = cfg.get(KEY)
    if node is None:
        return None
    given = {(m.group(1), m.group(2)) for o in overrides if (m := _KNOB.match(o))}
    knobs = OmegaConf.to_container(node.get("plugins") or {}, resolve=True)
    name = str(node.get("name") or "unnamed")
    with open_dict(cfg):
        enabled = cfg.get("plugins") or {}
        for plugin, values in (knobs or {}).items():  # type: ignore[union-attr]
            if plugin not in enabled:
                continue
            for key, value in _flat(values or {}):
                if (plugin, key) not in given:
                    OmegaConf.update(cfg.plugins[plugin], key, value, merge=True)
        del cfg[KEY]
    return name


def _flat(values: dict, prefix: str = "") -> list[tuple[str, object]]:
    """``{"a": {"b": 1}, "c": 2}`` -> ``[("a.b", 1), ("c", 2)]``."""
    out: list[tuple[str, object]] = []
    for key, value in values.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out
