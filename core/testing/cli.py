"""Run the command line as a user does, in a folder of the test's own.

End-to-end tests run ``python -m core ...`` (or ``core.study``, ``core.report``,
``core.registry``) in a subprocess; :func:`run_cli` does it once for all of them: the
same interpreter, the run's records (MLflow store, artifacts, caches, Hydra's output)
inside ``folder`` so a test leaves nothing behind and reads back only its own runs, and
the output as one text. Tests that signal the process (Ctrl-C) or read its output as it
runs use ``subprocess.Popen`` themselves.

    result = run_cli(tmp_path, "+plugins=[eureka]", "plugins.eureka.samples=abc")
    assert result.returncode == 2 and "Invalid value" in result.said
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class CliResult:
    """What a command did: its exit status and what it printed."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        """stdout then stderr."""
        return self.stdout + self.stderr

    @property
    def said(self) -> str:
        """The output with its line breaks and runs of spaces as single spaces (a message
        the console wrapped to its width reads as one line again)."""
        return " ".join(self.output.split())


def run_cli(
    folder: Path | str | None,
    *args: str,
    module: str = "core",
    records: bool = True,
    env: Mapping[str, str] | None = None,
    drop_env: tuple[str, ...] = (),
    timeout: float = 300,
) -> CliResult:
    """``python -m <module> *args`` run in ``folder`` (this process's folder when None).

    :param records: add overrides that keep the run's records in ``folder``
        (``tracking.uri`` ``sqlite:///<folder>/mlflow.db``, ``tracking.artifact_location``
        ``<folder>/art``, ``cache_dir`` ``<folder>/cache``, ``hydra.run.dir`` ``<folder>/out``),
        less any of these keys that ``args`` set (the caller's value stands); a sweep (``-m``)
        writes its runs under ``hydra.sweep.dir``, which callers set. Only for
        ``module="core"``, and only with a ``folder``.
    :param env: the environment (default: this process's), less the variables in ``drop_env``.
    """
    command = [sys.executable, "-m", module, *args]
    if records and folder is not None and module == "core" and "--help" not in args:
        base = Path(folder)
        given = {arg.lstrip("+").split("=", 1)[0] for arg in args if "=" in arg}
        command += [
            f"{key}={value}"
            for key, value in (
                ("tracking.uri", f"sqlite:///{base}/mlflow.db"),
                ("tracking.artifact_location", f"{base}/art"),
                ("cache_dir", f"{base}/cache"),
                ("hydra.run.dir", f"{base}/out"),
            )
            if key not in given
        ]
    environment = {k: v for k, v in (os.environ if env is None else env).items() if k not in drop_env}
    proc = subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=str(folder) if folder is not None else None,
        env=environment,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)
