"""Plugin and config mistakes stop a run before any work, in one paragraph with the closest name.

Before any work means: no MLflow run (not even the tracking store), no LLM call, no
training. Each case goes through :func:`core.loop.run_experiment`, the entry point
that ``python -m core`` calls; the command line is checked for the mistakes made there.
"""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf, open_dict

from core.errors import UserError
from core.loop import run_experiment
from core.testing.cli import run_cli

MISSPELT_HOOK = """
    from core import hookimpl


    class Plugin:
        def __init__(self, config):
            self.config = config

        @hookimpl
        def compute_rewards(self, train, batch):  # the hook is compute_reward
            return None
"""

UNKNOWN_ARGUMENT = """
    from core import hookimpl


    @hookimpl
    def on_train_end(train, results):  # the spec passes `result`
        pass
"""


def _fails_before_any_work(cfg, tmp_path) -> str:
    """The run's UserError text, after checking it is one paragraph and nothing was recorded."""
    with pytest.raises(UserError) as err:
        run_experiment(cfg)
    message = str(err.value)
    assert "\n" not in message and message.endswith("."), message
    assert not (tmp_path / "mlflow.db").exists(), "a run was recorded before validation failed"
    assert not (tmp_path / "mlartifacts").exists()
    return message


def test_a_misspelt_hook_name(local_plugins, tiny_run, tmp_path):
    local_plugins("typo", MISSPELT_HOOK)
    cfg = tiny_run()
    with open_dict(cfg):
        cfg.plugins = {"typo": {}}
    message = _fails_before_any_work(cfg, tmp_path)
    assert "Plugin 'typo' (llm4rl_test_typo.Plugin) implements 'compute_rewards', which is not a hook." in message
    assert "Did you mean 'compute_reward'?" in message


def test_an_argument_the_spec_lacks(local_plugins, tiny_run, tmp_path):
    local_plugins("args", UNKNOWN_ARGUMENT)
    cfg = tiny_run()
    with open_dict(cfg):
        cfg.plugins = {"args": {}}
    message = _fails_before_any_work(cfg, tmp_path)
    assert "Plugin 'args' (llm4rl_test_args): hook 'on_train_end' takes argument(s) 'results'" in message
    assert "Did you mean 'result'?" in message and "passes: train, result" in message


def test_a_bad_config_value(tiny_run, tmp_path):
    message = _fails_before_any_work(tiny_run("+plugins=[eureka]", "plugins.eureka.samples=abc"), tmp_path)
    assert "Invalid value for 'plugins.eureka.samples': expected int, got 'abc' (str)." in message


def test_a_value_the_plugin_refuses(tiny_run, tmp_path):
    message = _fails_before_any_work(tiny_run("+plugins=[eureka]", "plugins.eureka.iterations=-1"), tmp_path)
    assert "plugins.eureka" in message and "iterations must be >= 0, got -1" in message


@pytest.mark.parametrize(
    "where, key, expected",
    [
        ("plugins.eureka", "sample", "Unknown config key 'plugins.eureka.sample'. Did you mean 'samples'?"),
        ("", "sedd", "Unknown config key 'config.sedd'. Did you mean 'seed'?"),
        ("sandbox", "cpu_seconds", "Unknown config key 'config.sandbox.cpu_seconds'. Did you mean 'cpu_s'?"),
    ],
)
def test_an_unknown_config_key(tiny_run, tmp_path, where, key, expected):
    """A key the schema lacks, as a YAML file or an experiment config would add it."""
    cfg = tiny_run("+plugins=[eureka]")
    with open_dict(cfg):
        node = OmegaConf.select(cfg, where) if where else cfg
        node[key] = 3
    message = _fails_before_any_work(cfg, tmp_path)
    assert expected in message


# -- the command line ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, expected",
    [
        (
            ["+plugins=[eureka]", "plugins.eureka.samples=abc"],
            "Invalid value for 'plugins.eureka.samples': expected int, got 'abc'",
        ),
        (
            ["+plugins=[eureka]", "plugins.eureka.sample=3"],
            "Unknown config key 'plugins.eureka.sample'. Did you mean 'samples'?",
        ),
        (
            ["+plugins=[eureka]", "+plugins.eureka.sample=3"],
            "Unknown config key 'plugins.eureka.sample'. Did you mean 'samples'?",
        ),
        (
            ["plugins.eureka.samples=3"],
            "'plugins.eureka.samples' is set but plugin 'eureka' is not enabled in this run",
        ),
    ],
)
def test_the_command_line_says_it_in_one_paragraph(tmp_path, args, expected):
    proc = run_cli(tmp_path, *args)
    output = proc.output
    assert proc.returncode == 2, output
    assert output.count("error:") == 1 and "Traceback" not in output, output
    assert "not in struct" not in output and "+plugins.eureka" not in output.replace(args[-1], "")
    assert expected in " ".join(output.split()), output
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "art").exists()
