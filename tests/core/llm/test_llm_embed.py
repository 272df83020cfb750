"""LLMClient.embed: unit vectors per text, cached in memory and on disk, the embedded model's embedding server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.llm import LLMError, embedded, make_client
from core.llm.client import import_litellm


class FakeEmbedding:
    """Stands in for ``litellm.embedding``: a vector per text from its characters, counted; can fail."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        self.fail_with: list[BaseException] = []

    def __call__(self, **kwargs: Any) -> Any:
        from litellm.types.utils import EmbeddingResponse

        self.calls.append(kwargs)
        if self.fail_with:
            raise self.fail_with.pop(0)
        data = [
            {"object": "embedding", "index": i, "embedding": [float(len(t)), float(sum(map(ord, t)) % 7) + 1.0, 3.0]}
            for i, t in enumerate(kwargs["input"])
        ]
        return EmbeddingResponse(model=kwargs["model"], data=list(reversed(data)))  # out of order: sorted by index


@pytest.fixture
def fake_embedding(monkeypatch: pytest.MonkeyPatch) -> FakeEmbedding:
    backend = FakeEmbedding()
    monkeypatch.setattr(import_litellm(), "embedding", backend)
    return backend


def _cfg(tmp_path: Path, **kw: Any) -> dict[str, Any]:
    return {
        "model": "openai/fake-model",
        "api_key_env": None,
        "retries": 1,
        "backoff_s": 0.0,
        "cache_path": str(tmp_path / "cache.sqlite"),
        **kw,
    }


def _want(text: str) -> np.ndarray:
    v = np.array([len(text), sum(map(ord, text)) % 7 + 1.0, 3.0])
    return v / np.linalg.norm(v)


def test_embed_gives_unit_rows_in_order_and_asks_each_text_once(tmp_path, fake_embedding):
    client = make_client(_cfg(tmp_path))
    out = client.embed(["collect wood", "eat cow", "collect wood"])
    assert out.shape == (3, 3) and out.dtype == np.float32
    np.testing.assert_allclose(
        out, np.stack([_want("collect wood"), _want("eat cow"), _want("collect wood")]), atol=1e-6
    )
    (call,) = fake_embedding.calls
    assert call["input"] == ["collect wood", "eat cow"] and call["model"] == "openai/fake-model"  # duplicates once
    again = client.embed(["eat cow", "place table"])
    assert fake_embedding.calls[1]["input"] == ["place table"]  # only the new text
    np.testing.assert_allclose(again[0], out[1])
    s = client.embed_stats
    assert (s.calls, s.texts, s.cache_hits, s.requests, s.errors) == (2, 5, 1, 2, 0)
    assert client.stats.calls == 0 and client.stats.requests == 0  # chat figures untouched


def test_embeddings_persist_in_the_response_cache_and_replay_without_the_backend(tmp_path, fake_embedding):
    make_client(_cfg(tmp_path)).embed(["collect wood"])
    fresh = make_client(_cfg(tmp_path, replay_only=True))
    np.testing.assert_allclose(fresh.embed(["collect wood"])[0], _want("collect wood"), atol=1e-6)
    assert len(fake_embedding.calls) == 1
    with pytest.raises(LLMError, match="replay_only: no recorded embedding"):
        fresh.embed(["place table"])
    other = make_client(_cfg(tmp_path))
    other.embed(["collect wood"], model="openai/another-embedder")  # another model: not the cached vector
    assert fake_embedding.calls[-1]["model"] == "openai/another-embedder"


def test_a_model_without_embeddings_is_a_clear_error_and_transient_errors_retry(tmp_path, fake_embedding):
    litellm = import_litellm()
    client = make_client(_cfg(tmp_path, cache=False))
    fake_embedding.fail_with = [litellm.exceptions.RateLimitError("slow down", llm_provider="openai", model="x")]
    assert client.embed(["a"]).shape == (1, 3) and len(fake_embedding.calls) == 2  # one retry
    fake_embedding.fail_with = [
        litellm.exceptions.BadRequestError("not an embedding model", model="x", llm_provider="openai")
    ]
    with pytest.raises(LLMError, match="name an embedding model"):
        client.embed(["b"])
    assert client.embed_stats.errors == 1


def test_a_zero_vector_is_refused(tmp_path, monkeypatch):
    from litellm.types.utils import EmbeddingResponse

    monkeypatch.setattr(
        import_litellm(),
        "embedding",
        lambda **kw: EmbeddingResponse(model="m", data=[{"index": 0, "embedding": [0.0, 0.0]}]),
    )
    with pytest.raises(LLMError, match="zero or non-finite"):
        make_client(_cfg(tmp_path, cache=False)).embed(["x"])


def test_the_embedded_model_embeds_in_process(tmp_path, monkeypatch):
    asked: list[tuple[str, list[str]]] = []
    monkeypatch.setattr(
        embedded, "embed", lambda name, texts: asked.append((name, list(texts))) or [[1.0, 1.0]] * len(texts)
    )
    monkeypatch.setattr(import_litellm(), "embedding", lambda **kw: pytest.fail("the embedded model went to litellm"))
    client = make_client({"model": "embedded/qwen2.5-coder-1.5b-instruct", "cache_path": str(tmp_path / "c.sqlite")})
    out = client.embed(["sleep"])
    assert asked == [("qwen2.5-coder-1.5b-instruct", ["sleep"])]
    np.testing.assert_allclose(out, [[2**-0.5, 2**-0.5]], atol=1e-6)


def test_embedding_server_wraps_each_text_in_the_template_and_orders_the_vectors(monkeypatch):
    requests: list[dict[str, Any]] = []

    class Server:
        def handle_embeddings(self, request):
            requests.append(request)
            return {"data": [{"index": 1, "embedding": [0.0, 2.0]}, {"index": 0, "embedding": [1.0, 0.0]}]}

    monkeypatch.setattr(embedded, "get_embedder", lambda name: Server())
    assert embedded.embed("m", ["eat cow", "sleep"]) == [[1.0, 0.0], [0.0, 2.0]]
    assert requests[0]["input"] == [embedded.EMBED_TEMPLATE.format("eat cow"), embedded.EMBED_TEMPLATE.format("sleep")]

    class Broken:
        def handle_embeddings(self, request):
            return {"error": {"message": "input is too large"}}

    monkeypatch.setattr(embedded, "get_embedder", lambda name: Broken())
    with pytest.raises(LLMError, match="input is too large"):
        embedded.embed("m", ["x"])
    assert embedded.embed("m", []) == []


def test_embedder_params_pool_the_last_token_of_a_short_sequence(tmp_path):
    import xllamacpp

    params = embedded.embedder_params(tmp_path / "m.gguf", 2)
    assert params.embedding and params.pooling_type == xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_LAST
    assert params.n_ubatch == embedded.EMBED_MAX_TOKENS and params.n_parallel == embedded.EMBED_SLOTS
    assert params.cpuparams.n_threads == 2 and params.model.path == str(tmp_path / "m.gguf")


def test_forked_child_drops_the_parents_embedding_server(monkeypatch):
    sentinel = object()
    monkeypatch.setattr(embedded, "_embedder", sentinel)
    monkeypatch.setattr(embedded, "_orphans", [])
    monkeypatch.setattr(embedded, "_embedder_info", {"name": "x"})
    old = embedded._embed_lock
    embedded._embedder_after_fork_in_child()
    try:
        assert embedded._embedder is None and embedded._embedder_info == {} and embedded._orphans == [sentinel]
    finally:
        monkeypatch.setattr(embedded, "_embed_lock", old)


@pytest.mark.slow
def test_real_embedded_model_puts_a_paraphrase_nearer_than_another_event(tmp_path):
    client = make_client(
        {
            "model": "embedded/qwen2.5-coder-1.5b-instruct",
            "cache_path": str(tmp_path / "c.sqlite"),
            "n_threads": 1,
            "show_progress": False,
        }
    )
    v = client.embed(["collect wood", "chop down a tree", "drink water"])
    assert v.shape[0] == 3 and np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert float(v[0] @ v[1]) > float(v[0] @ v[2])
    assert embedded.embedder_info()["name"] == "qwen2.5-coder-1.5b-instruct"
