"""Shared test setup. ``make_config`` (the real Hydra config with tracking and caches in
``tmp_path``) comes from the testing kit's pytest plugin, as a third party's suite gets it."""

from __future__ import annotations

import os

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

pytest_plugins = ["core.testing.pytest_plugin"]
