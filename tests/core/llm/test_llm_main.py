"""``python -m core.llm``: composing the llm group and answering from the command line."""

from __future__ import annotations

import pytest

from core.llm.__main__ import compose_llm, main
from core.resources import conf_dir

BACKENDS = ["embedded", "openai", "anthropic", "ollama", "vllm"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_file_composes_into_a_client(backend, monkeypatch, tmp_path):
    from core.llm import make_client

    cfg = compose_llm([f"llm={backend}", f"llm.cache_path={tmp_path / 'c.sqlite'}"])
    client = make_client(cfg)  # unknown or missing keys would raise here
    assert client.model == cfg.model


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_key_has_a_comment(backend):
    lines = (conf_dir() / "llm" / f"{backend}.yaml").read_text().splitlines()
    assert lines[0] == "# @package llm"
    keys = [line for line in lines if line and not line.startswith("#")]
    assert keys and all("#" in line for line in keys), [k for k in keys if "#" not in k]


def test_default_is_embedded_and_overrides_apply():
    assert compose_llm([]).model.startswith("embedded/")
    cfg = compose_llm(["llm=openai", "llm.model=gpt-4o", "llm.max_tokens=5"])
    assert (cfg.model, cfg.max_tokens, cfg.api_key_env) == ("gpt-4o", 5, "OPENAI_API_KEY")


def test_cli_prints_reply_and_stats(capsys, tmp_path):
    rc = main(
        [
            "say hi",
            "llm=openai",
            "llm.model=gpt-4o-mini",
            "llm.api_key_env=null",
            "llm.cache=false",
            "+llm.extra.mock_response=hello there",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip() == "hello there"
    assert "1 call(s)" in err and "gpt-4o-mini" in err


def test_cli_missing_key_exits_with_the_env_var(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    rc = main(["hi", "llm=openai", f"llm.cache_path={tmp_path / 'c.sqlite'}"])
    assert rc == 2 and "OPENAI_API_KEY" in capsys.readouterr().err


def test_cli_unknown_backend_lists_the_options(capsys):
    rc = main(["hi", "llm=nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "llm/nope" in err and "openai" in err
