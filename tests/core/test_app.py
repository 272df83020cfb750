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


@pytest.mark.parametrize("prefix", ["", "+", "++"])
def test_a_plugin_key_its_schema_lacks_is_refused_before_hydra(prefix):
    # Hydra would say "Key 'sample' is not in struct" and suggest '+', which adds a key nobody reads
    with pytest.raises(UserError) as err:
        check_argv(["+plugins=[eureka]", f"{prefix}plugins.eureka.sample=3"])
    message = str(err.value)
    assert message.startswith("Unknown config key 'plugins.eureka.sample'. Did you mean 'samples'?")
    assert "'plugins.eureka' accepts: iterations, final_seeds, samples" in message and "\n" not in message


def test_plugin_keys_of_the_schema_pass():
    check_argv(["+plugins=[eureka]", "plugins.eureka.samples=2", "plugins.eureka.iterations=1,2", "~plugins.eureka.x"])
    check_argv(["-m", "+plugins=[eureka],[]", "plugins.eureka.samples=4"])


def test_a_key_of_a_plugin_not_enabled_is_refused():
    with pytest.raises(UserError, match=r"'plugins.eureka.samples' is set but plugin 'eureka' is not enabled in this run. "
                                        r"Enable it with \+plugins=\[eureka\]"):
        check_argv(["+plugins=[text2reward]", "plugins.eureka.samples=2"])
    with pytest.raises(UserError, match="plugin 'eurka', which does not exist. Did you mean 'eureka'"):
        check_argv(["+plugins=[eureka]", "plugins.eurka.samples=2"])
    check_argv(["--config-name", "my_study", "plugins.eureka.samples=2"])  # that file may enable it


def test_the_summary_names_the_results_store(capsys):
    from core.app import print_summary
    from core.loop import RunSummary

    summary = RunSummary("return", 1.0, 10, 1.0, 1, 0, "rid", "ui", results_store="/x/llm4rl-results.sqlite")
    print_summary(summary)
    assert "results store: /x/llm4rl-results.sqlite (none reused)" in capsys.readouterr().out
    summary.reused = 1
    print_summary(summary)
    assert "1 training(s) reused" in " ".join(capsys.readouterr().out.split())
