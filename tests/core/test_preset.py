"""Presets (``+preset=quick``): their plugin knobs reach the enabled plugins only, whatever the
order on the command line, and a knob given on the command line wins; an unknown option of any
config group is refused like an unknown env, with exit status 2."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from core.app import check_argv
from core.errors import UserError
from core.preset import KEY, apply_preset
from core.resources import conf_dir
from core.testing.cli import run_cli


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(conf_dir()), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


@pytest.mark.parametrize("order", ["preset first", "plugins first"])
def test_the_quick_preset_shrinks_the_headline_run_whatever_the_order(order):
    args = ["+preset=quick", "+plugins=[eureka,envgen]"]
    cfg = _compose(*(args if order == "preset first" else args[::-1]), "env=minecraft")
    assert apply_preset(cfg, args) == "quick"
    assert KEY not in cfg
    assert cfg.trainer.frames == 8192 and cfg.trainer.eval_episodes == 4 and cfg.vetting.repair == 1
    assert cfg.plugins.eureka.iterations == 1 and cfg.plugins.eureka.samples == 4
    assert cfg.plugins.envgen.iterations == 1 and cfg.plugins.envgen.num_envs == 2
    assert cfg.plugins.eureka.max_tokens == 1024  # what the preset does not set keeps the plugin's default


def test_a_preset_never_enables_a_plugin_and_the_command_line_wins():
    cfg = _compose("+preset=quick", "+plugins=[eureka]")  # envgen's knobs are in the preset, envgen is not enabled
    apply_preset(cfg, ["+preset=quick", "+plugins=[eureka]"])
    assert set(cfg.plugins) == {"eureka"}
    args = ["+preset=quick", "+plugins=[eureka]", "plugins.eureka.samples=8", "trainer.frames=1000"]
    cfg = _compose(*args)
    apply_preset(cfg, args)
    assert cfg.plugins.eureka.samples == 8 and cfg.trainer.frames == 1000
    cfg = _compose("+preset=quick")  # no plugin: the budget alone
    apply_preset(cfg, [])
    assert not cfg.plugins and cfg.trainer.frames == 8192
    plain = _compose()
    assert apply_preset(plain, []) is None and OmegaConf.to_container(plain) == OmegaConf.to_container(_compose())


@pytest.mark.parametrize(
    "arg, said",
    [
        ("+preset=quik", "Unknown preset 'quik'. Did you mean 'quick'?"),
        ("trainer=ppp", "Unknown trainer 'ppp'. Did you mean 'ppo'?"),
        ("llm=opnai", "Unknown llm 'opnai'. Did you mean 'openai'?"),
    ],
)
def test_an_unknown_option_of_any_group_is_refused_before_hydra(arg, said):
    with pytest.raises(UserError) as err:
        check_argv([arg])
    assert str(err.value).startswith(said)


def test_an_unknown_group_option_exits_2_like_an_unknown_env():
    """Hydra's own message for trainer=ppp exited 1, ours for env=nowhere 2: the same error, one status."""
    for arg in ("trainer=ppp", "env=nowhere"):
        proc = run_cli(None, arg, timeout=120)
        assert proc.returncode == 2, proc.stderr
        assert "Traceback" not in proc.stderr


def test_help_names_the_preset():
    proc = run_cli(None, "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "+preset=quick" in proc.stdout.split("== Config groups")[0]  # in the usage, with the headline
    assert "preset: quick" in proc.stdout.split("== Config groups")[1]
