"""Live progress of LLM calls: streamed token counts from the embedded model and litellm backends."""

from __future__ import annotations

import pytest

from core.llm import embedded, make_client
from core.llm.client import CallProgress, import_litellm


class Seen:
    """An ``on_progress`` that keeps (tokens, done) of every report."""

    def __init__(self) -> None:
        self.reports: list[tuple[int, bool]] = []
        self.calls: list[CallProgress] = []

    def __call__(self, call: CallProgress) -> None:
        self.reports.append((call.tokens, call.done))
        if call not in self.calls:
            self.calls.append(call)


class StreamingBackend:
    """``litellm.completion`` of a backend that streams: with ``stream=True`` an iterator of
    chunks (one token each, per choice), else the whole reply."""

    def __init__(self, words: int = 6) -> None:
        self.words = words
        self.calls: list[dict] = []

    def __call__(self, **kwargs):
        from litellm.types.utils import Choices, Message, ModelResponse, Usage

        self.calls.append(kwargs)
        n = int(kwargs.get("n") or 1)
        words = [f"w{i} " for i in range(self.words)]
        if not kwargs.get("stream"):
            return ModelResponse(
                choices=[
                    Choices(index=j, finish_reason="stop", message=Message(role="assistant", content="".join(words)))
                    for j in range(n)
                ],
                model=kwargs["model"],
                usage=Usage(prompt_tokens=3, completion_tokens=self.words * n, total_tokens=3 + self.words * n),
            )
        return self._stream(kwargs, words, n)

    def _stream(self, kwargs, words, n):
        from litellm.types.utils import Delta, ModelResponseStream, StreamingChoices, Usage

        for word in words:
            for j in range(n):
                yield ModelResponseStream(
                    choices=[StreamingChoices(index=j, delta=Delta(content=word))], model=kwargs["model"]
                )
        yield ModelResponseStream(
            choices=[StreamingChoices(index=j, delta=Delta(), finish_reason="stop") for j in range(n)],
            model=kwargs["model"],
        )
        last = ModelResponseStream(choices=[], model=kwargs["model"])
        last.usage = Usage(prompt_tokens=3, completion_tokens=self.words * n, total_tokens=3 + self.words * n)
        yield last


def test_a_litellm_backend_streams_and_every_token_is_reported(monkeypatch, llm_cfg):
    backend = StreamingBackend()
    monkeypatch.setattr(import_litellm(), "completion", backend)
    seen = Seen()
    client = make_client({**llm_cfg, "max_n": 2}, on_progress=seen)
    client.PROGRESS_EVERY_S = 0.0  # every token, for the test
    replies = client.chat([{"role": "user", "content": "q"}], n=2, seed=1, tag="eureka/propose")
    assert backend.calls[0]["stream"] is True
    assert [r.text for r in replies] == ["w0 w1 w2 w3 w4 w5 "] * 2
    assert sum(r.completion_tokens for r in replies) == 12 and client.stats.completion_tokens == 12
    (call,) = seen.calls
    assert call.tag == "eureka/propose" and call.samples == 2 and call.max_tokens == llm_cfg["max_tokens"]
    tokens = [t for t, done in seen.reports if not done]
    assert tokens[0] == 0 and tokens == sorted(tokens) and 12 in tokens  # counted up as they came
    assert seen.reports[-1] == (12, True)
    # the same replies from the cache: no backend call, no progress line
    again = make_client({**llm_cfg, "max_n": 2}, on_progress=seen)
    assert [r.text for r in again.chat([{"role": "user", "content": "q"}], n=2, seed=1)] == [r.text for r in replies]
    assert len(backend.calls) == 1 and len(seen.calls) == 1


def test_without_a_watcher_nothing_streams(monkeypatch, llm_cfg):
    backend = StreamingBackend()
    monkeypatch.setattr(import_litellm(), "completion", backend)
    client = make_client(llm_cfg)
    assert client.chat([{"role": "user", "content": "q"}])[0].text == "w0 w1 w2 w3 w4 w5 "
    assert "stream" not in backend.calls[0]


def test_a_backend_that_cannot_stream_is_asked_whole(monkeypatch, llm_cfg):
    def no_stream(**kwargs):
        if kwargs.get("stream"):
            raise ValueError("this server does not stream")
        return StreamingBackend()(**kwargs)

    monkeypatch.setattr(import_litellm(), "completion", no_stream)
    seen = Seen()
    client = make_client(llm_cfg, on_progress=seen)
    assert client.chat([{"role": "user", "content": "q"}])[0].text == "w0 w1 w2 w3 w4 w5 "
    assert seen.reports[-1] == (6, True)  # the whole reply's tokens, when it came
    assert client.chat([{"role": "user", "content": "r"}])[0].text  # not tried again
    assert client._stream_ok is False


def test_a_server_that_answers_a_stream_whole_is_asked_again_not_read_as_empty(llm_cfg):
    """An OpenAI-compatible server that ignores ``stream`` sends JSON: the SDK reads no chunk
    from it. That must not become an empty reply (and be cached as one)."""
    import json
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
    from threading import Thread

    asked: list[bool] = []

    class Whole(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # the handler's API
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            asked.append(bool(body.get("stream")))
            data = json.dumps(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "created": 0,
                    "model": "m",
                    "choices": [
                        {"index": i, "message": {"role": "assistant", "content": f"reply {i}"}, "finish_reason": "stop"}
                        for i in range(int(body.get("n") or 1))
                    ],
                    "usage": {"prompt_tokens": 2, "completion_tokens": 4, "total_tokens": 6},
                }
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Whole)
    Thread(target=server.serve_forever, daemon=True).start()
    try:
        seen = Seen()
        client = make_client(
            {
                **llm_cfg,
                "model": "openai/m",
                "api_base": f"http://127.0.0.1:{server.server_address[1]}/v1",
                "max_n": 2,
                "retries": 0,
            },
            on_progress=seen,
        )
        replies = client.chat([{"role": "user", "content": "q"}], n=2, seed=3)
        assert [r.text for r in replies] == ["reply 0", "reply 1"]
        assert asked == [True, False] and client._stream_ok is False
        assert seen.reports[-1] == (4, True)
    finally:
        server.shutdown()
        server.server_close()


def test_the_embedded_provider_streams_into_the_sink(monkeypatch):
    """The client sets :data:`embedded.token_sink` around the request; generate streams then."""
    chunks = [{"choices": [{"index": j, "delta": {"content": f"t{k}"}}]} for k in range(3) for j in range(2)]
    chunks += [
        {"choices": [{"index": j, "delta": {}, "finish_reason": "length"} for j in range(2)]},
        {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}},
    ]

    class Server:
        requests: list = []

        def handle_chat_completions(self, request, callback=None):
            self.requests.append(request)
            if not request.get("stream"):
                return {
                    "choices": [
                        {"index": j, "message": {"content": "t0t1t2"}, "finish_reason": "length"} for j in range(2)
                    ],
                    "usage": {"prompt_tokens": 5, "completion_tokens": 3},
                }
            for chunk in chunks:
                callback(chunk)

    server = Server()
    monkeypatch.setattr(embedded, "get_server", lambda name="": server)
    monkeypatch.setattr(embedded, "get_plan", lambda name="": embedded.ServerPlan(1, 2, 4096, True, "test"))
    monkeypatch.setattr(embedded, "_plan", embedded.ServerPlan(1, 2, 4096, True, "test"))
    seen = Seen()
    client = make_client({"cache": False, "max_tokens": 3, "show_progress": False}, on_progress=seen)
    client.PROGRESS_EVERY_S = 0.0
    replies = client.chat([{"role": "user", "content": "q"}], n=2, seed=2)
    assert server.requests[-1]["stream"] is True
    assert [r.text for r in replies] == ["t0t1t2", "t0t1t2"]  # as the whole reply would be
    assert [t for t, _ in seen.reports][1:4] == [1, 2, 3] and seen.reports[-1] == (6, True)
    plain = make_client({"cache": False, "max_tokens": 3, "show_progress": False})
    assert [r.text for r in plain.chat([{"role": "user", "content": "q"}], n=2, seed=2)] == ["t0t1t2", "t0t1t2"]
    assert server.requests[-1]["stream"] is False


@pytest.mark.slow
def test_the_real_embedded_model_streams_the_same_replies(tmp_path):
    embedded.unload()
    try:
        cfg = {
            "cache": False,
            "max_tokens": 10,
            "temperature": 1.0,
            "show_progress": False,
            "n_parallel": 2,
            "n_threads": 1,
            "prefix_cache": False,
        }  # every request computes its prompt: the same numbers each time
        messages = [{"role": "user", "content": "Name three colours."}]
        whole = make_client(cfg).chat(messages, n=2, seed=7)
        seen = Seen()
        streamed = make_client(cfg, on_progress=seen).chat(messages, n=2, seed=7, tag="check")
        assert [r.text for r in streamed] == [r.text for r in whole]
        assert [r.completion_tokens for r in streamed] == [r.completion_tokens for r in whole]
        assert seen.reports[-1] == (sum(r.completion_tokens for r in streamed), True)
        assert any(0 < t for t, done in seen.reports if not done)  # counted while it decoded
    finally:
        embedded.unload()
