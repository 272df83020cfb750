"""Shared fixtures: composing the real Hydra config with test-sized budgets."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, open_dict

from core.resources import conf_dir

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")


def compose_config(overrides: list[str], tmp_path: Path) -> DictConfig:
    """The run config for ``overrides``, tracking and caches redirected into ``tmp_path``."""
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        cfg = compose(config_name="config", overrides=overrides)
    with open_dict(cfg):
        cfg.tracking.uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
        cfg.tracking.artifact_location = str(tmp_path / "mlartifacts")
        cfg.cache_dir = str(tmp_path / "cache")
        cfg.progress = False
    return cfg


@pytest.fixture
def make_config(tmp_path: Path):
    """``make_config(["env=cartpole", ...])`` -> a composed, test-isolated DictConfig."""
    return lambda overrides=(): compose_config(list(overrides), tmp_path)
