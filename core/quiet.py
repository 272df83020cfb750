"""Keep third-party chatter (MLflow, litellm, alembic, warnings) out of the user's way."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings


def quiet_third_party() -> None:
    """Lower the log level of libraries that print on every run."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    for name in ("mlflow", "alembic", "LiteLLM", "litellm", "httpx", "urllib3", "numba", "matplotlib"):
        logging.getLogger(name).setLevel(logging.WARNING)
    logging.getLogger("alembic.runtime.migration").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Gym.*")


def import_gym_quietly() -> None:
    """Import the old ``gym`` (if installed) without its deprecation notice on stderr.

    Crafter subclasses ``gym.Env`` when ``gym`` is importable, and ``gym`` 0.26 prints a
    notice on every import; the ``pybullet`` extra installs it.
    """
    if "gym" in sys.modules:
        return
    with contextlib.redirect_stderr(io.StringIO()), contextlib.suppress(ImportError):
        import gym  # noqa: F401
