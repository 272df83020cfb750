from __future__ import annotations

import subprocess
import sys

import pytest

from core.app import check_argv, requested_plugins
from core.errors import UserError


def test_requested_plugins_reads_lists_and_sweeps():
    assert requested_plugins(["+plugins=[eureka,envgen]", "env=minecraft"]) == ["eureka", "envgen"]
    assert requested_plugins(["+plugins=[eureka],[text2reward],[]"]) == ["eureka", "text2reward"]
    assert requested_plugins(["seed=1"]) == []


def test_unknown_env_is_reported_with_choices():
    with pytest.raises(UserError, match="Unknown env 'cartpol'.*Did you mean 'cartpole'"):
        check_argv(["env=cartpol"])


@pytest.mark.parametrize(
    "args, expected",
    [
        (["+plugins=[nope]"], "Unknown plugin 'nope'"),
        (["env=nowhere"], "Unknown env 'nowhere'"),
        (["trainer.frames=="], "trainer.frames"),
    ],
)
def test_bad_input_exits_nonzero_with_a_short_message(args, expected):
    proc = subprocess.run([sys.executable, "-m", "core", *args], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert expected in output.replace("\n", " ")
    assert "Traceback" not in output
