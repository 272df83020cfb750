"""Where the shipped data lives: the Hydra configs and the plugin catalogue.

In a wheel the ``conf/`` folder is installed as ``core/conf/`` (package data); in a
source checkout or an editable install it is the top-level ``conf/`` beside ``core/``.
"""

from __future__ import annotations

from pathlib import Path

_PACKAGE = Path(__file__).resolve().parent


def conf_dir() -> Path:
    """The folder holding ``config.yaml`` and the config groups."""
    installed = _PACKAGE / "conf"
    if (installed / "config.yaml").is_file():
        return installed
    return _PACKAGE.parent / "conf"


def registry_path() -> Path:
    """The catalogue of built-in plugins (``registry.yaml``)."""
    return conf_dir() / "registry.yaml"
