"""LLMClient: params, samples, cache, retries, errors and accounting (no model, no network)."""

from __future__ import annotations

import time

import pytest

from core.llm import CallRecord, LLMClient, LLMError, LLMStats, make_client
from core.llm.client import import_litellm, sample_seed
from core.llm.errors import ReplayMiss

MSG = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


# -- messages and parameters ---------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    ["hello", [], [{"role": "user"}], [{"role": "robot", "content": "x"}], [{"role": "user", "content": 3}]],
)
def test_bad_messages_are_rejected(bad, llm_cfg, fake_backend):
    client = make_client(llm_cfg)
    with pytest.raises(ValueError):
        client.chat(bad)
    assert fake_backend.calls == []


def test_config_defaults_and_call_overrides_reach_the_backend(llm_cfg, fake_backend):
    client = make_client({**llm_cfg, "cache": False})
    client.chat(MSG)
    client.chat(MSG, temperature=0.0, max_tokens=7, stop=["\n\n"], seed=3)
    first, second = fake_backend.calls
    assert (first["temperature"], first["max_tokens"], first["seed"]) == (0.5, 32, sample_seed(0, 0))
    assert "stop" not in first and "n" not in first
    assert (second["temperature"], second["max_tokens"], second["stop"]) == (0.0, 7, ["\n\n"])
    assert second["seed"] == sample_seed(3, 0)
    assert first["num_retries"] == 0 and first["timeout"] == 600.0
    assert first["messages"] == MSG


def test_samples_get_distinct_seeds_one_request_each_when_max_n_is_1(llm_cfg, fake_backend):
    replies = make_client(llm_cfg).chat(MSG, n=3, seed=7)
    assert len(fake_backend.calls) == 3
    seeds = sorted(c["seed"] for c in fake_backend.calls)  # the requests ran concurrently
    assert seeds == sorted(sample_seed(7, i) for i in range(3)) and len(set(seeds)) == 3
    assert [r.text.split("|")[1] for r in replies] == [f"seed={sample_seed(7, i)}" for i in range(3)]
    assert len({r.text for r in replies}) == 3


def test_n_is_chunked_by_max_n(llm_cfg, fake_backend):
    replies = make_client({**llm_cfg, "max_n": 3}).chat(MSG, n=7)
    assert sorted(c.get("n", 1) for c in fake_backend.calls) == [1, 3, 3]
    assert len(replies) == 7
    assert len({r.text for r in replies}) == 7


def test_top_logprobs_reach_the_backend_and_come_back_cached(llm_cfg, fake_backend):
    client = make_client(llm_cfg)
    (plain,) = client.chat(MSG)
    assert plain.logprobs is None and "logprobs" not in fake_backend.calls[0]
    (reply,) = client.chat(MSG, top_logprobs=3)
    assert fake_backend.calls[1]["logprobs"] is True and fake_backend.calls[1]["top_logprobs"] == 3
    assert reply.logprobs == {"1": -0.1, "2": -2.5}  # stripped, the likelier spelling kept
    (again,) = client.chat(MSG, top_logprobs=3)
    assert again.cached and again.logprobs == reply.logprobs and len(fake_backend.calls) == 2


def test_first_token_logprobs_reads_objects_and_dicts():
    from litellm.types.utils import Choices, Message

    from core.llm.client import first_token_logprobs

    as_dict = {"logprobs": {"content": [{"token": "2", "logprob": -0.2}]}}  # no alternatives: the token itself
    assert first_token_logprobs(as_dict) == {"2": -0.2}
    assert first_token_logprobs({"logprobs": None}) is None
    choice = Choices(
        index=0,
        message=Message(role="assistant", content="x"),
        logprobs={"content": [{"token": "x", "logprob": -1.0, "top_logprobs": [{"token": "x", "logprob": -1.0}]}]},
    )
    assert first_token_logprobs(choice) == {"x": -1.0}


def test_ask_returns_text_and_sends_system(llm_cfg, fake_backend):
    text = make_client(llm_cfg).ask("ping", system="sys")
    assert text.startswith("ping|")
    assert fake_backend.calls[0]["messages"][0] == {"role": "system", "content": "sys"}


def test_unknown_setting_is_a_clear_error(llm_cfg):
    with pytest.raises(LLMError, match="llm.tempreature.*Did you mean 'temperature'"):
        make_client({**llm_cfg, "tempreature": 0.1})


def test_extra_kwargs_are_forwarded(llm_cfg, fake_backend):
    make_client({**llm_cfg, "extra": {"user": "tester"}}).chat(MSG)
    assert fake_backend.calls[0]["user"] == "tester"


def test_self_hosted_openai_server_gets_a_placeholder_key(llm_cfg, fake_backend):
    make_client({**llm_cfg, "api_base": "http://127.0.0.1:8000/v1"}).chat(MSG)
    call = fake_backend.calls[0]
    assert call["api_base"] == "http://127.0.0.1:8000/v1" and call["api_key"]


# -- samples requested together ------------------------------------------------------------


class Gate:
    """Wraps a backend: each request waits until ``parties`` requests are in flight at once
    (a barrier), so a test fails with BrokenBarrierError if the client serialised them."""

    def __init__(self, backend, parties: int, delay_s: float = 0.0) -> None:
        import threading

        self.backend = backend
        self.delay_s = delay_s
        self.barrier = threading.Barrier(parties, timeout=10)
        self.lock = threading.Lock()
        self.active = self.peak = 0

    def __call__(self, **kwargs):
        with self.lock:
            self.active += 1
            self.peak = max(self.peak, self.active)
        try:
            self.barrier.wait()
            time.sleep(self.delay_s)
            return self.backend(**kwargs)
        finally:
            with self.lock:
                self.active -= 1


@pytest.mark.parametrize("model", ["anthropic/fake-model", "ollama/fake-model"])
def test_backends_without_n_get_their_samples_as_concurrent_requests(model, llm_cfg, fake_backend, monkeypatch):
    gate = Gate(fake_backend, parties=4, delay_s=0.5)  # 4 x 0.5 s of latency: overlap shows whatever the load
    monkeypatch.setattr(import_litellm(), "completion", gate)
    client = make_client({**llm_cfg, "model": model, "max_n": 8, "concurrency": 4})
    replies = client.chat(MSG, n=4, seed=5)
    assert gate.peak == 4  # all four in flight together
    assert all("n" not in c for c in fake_backend.calls)  # litellm would drop n: never sent
    assert [r.text.split("|")[1] for r in replies] == [f"seed={sample_seed(5, i)}" for i in range(4)]
    assert client.stats.requests == 4 and client.stats.wait_s < client.stats.latency_s  # overlapped


def test_concurrency_bounds_the_requests_in_flight(llm_cfg, fake_backend, monkeypatch):
    gate = Gate(fake_backend, parties=1)  # never waits; records the peak
    monkeypatch.setattr(import_litellm(), "completion", gate)
    make_client({**llm_cfg, "model": "anthropic/fake-model", "concurrency": 1}).chat(MSG, n=5)
    assert gate.peak == 1 and len(fake_backend.calls) == 5


def test_backends_with_n_get_one_request(llm_cfg, fake_backend):
    replies = make_client({**llm_cfg, "max_n": 8}).chat(MSG, n=6, seed=2)
    assert [(c["n"], c["seed"]) for c in fake_backend.calls] == [(6, sample_seed(2, 0))]
    assert [r.text.split("|")[2] for r in replies] == [f"j={j}" for j in range(6)]


def test_a_backend_that_ignores_n_is_asked_for_the_rest(llm_cfg, fake_backend, monkeypatch):
    def one_choice(**kwargs):
        kwargs.pop("n", None)  # as if the provider dropped it
        return fake_backend(**kwargs)

    monkeypatch.setattr(import_litellm(), "completion", one_choice)
    replies = make_client({**llm_cfg, "max_n": 3}).chat(MSG, n=3, seed=1)
    assert [c["seed"] for c in fake_backend.calls] == [sample_seed(1, i) for i in range(3)]
    assert len({r.text for r in replies}) == 3


def test_concurrent_samples_reproduce_from_the_cache_under_stable_keys(llm_cfg, fake_backend):
    from core.llm.cache import ResponseCache, cache_key

    first = make_client({**llm_cfg, "model": "anthropic/fake-model"}).chat(MSG, n=6, seed=9)
    again = make_client({**llm_cfg, "model": "anthropic/fake-model", "concurrency": 1})
    second = again.chat(MSG, n=6, seed=9)
    assert [r.text for r in second] == [r.text for r in first] and all(r.cached for r in second)
    assert len(fake_backend.calls) == 6 and again.stats.requests == 0
    # the key of sample i is what it was before samples ran concurrently: rows written
    # by earlier versions still hit, and these rows hit for them
    params = {"temperature": 0.5, "max_tokens": 32, "stop": None, "top_p": None, "top_logprobs": None}
    cache = ResponseCache(llm_cfg["cache_path"])
    for i, reply in enumerate(first):
        assert cache.get(cache_key("anthropic/fake-model", MSG, params, 9, i))["text"] == reply.text


def test_a_failed_request_keeps_the_replies_of_the_others(llm_cfg, fake_backend, monkeypatch):
    def flaky(**kwargs):
        if kwargs["seed"] == sample_seed(0, 1):
            raise import_litellm().exceptions.BadRequestError("bad", "anthropic", "fake-model")
        return fake_backend(**kwargs)

    monkeypatch.setattr(import_litellm(), "completion", flaky)
    client = make_client({**llm_cfg, "model": "anthropic/fake-model"})
    with pytest.raises(LLMError, match="failed"):
        client.chat(MSG, n=3)
    assert client.stats.errors == 1 and len(fake_backend.calls) == 2
    monkeypatch.setattr(import_litellm(), "completion", fake_backend)
    replies = client.chat(MSG, n=3)
    assert [r.cached for r in replies] == [True, False, True]  # only the failed one is asked again


def test_chat_many_runs_independent_conversations_together(llm_cfg, fake_backend, monkeypatch):
    gate = Gate(fake_backend, parties=3)
    monkeypatch.setattr(import_litellm(), "completion", gate)
    client = make_client(llm_cfg)
    convs = [[{"role": "user", "content": f"fix attempt {j}"}] for j in range(3)]
    out = client.chat_many([{"messages": c, "seed": j, "tag": f"t{j}"} for j, c in enumerate(convs)])
    assert gate.peak == 3  # in flight together
    assert [replies[0].text.split("|")[0] for replies in out] == [f"fix attempt {j}" for j in range(3)]
    assert sorted(r.tag for r in client.records) == ["t0", "t1", "t2"] and client.stats.calls == 3
    alone = make_client(llm_cfg).chat(convs[1], seed=1)  # cached exactly as a call made alone
    assert alone[0].cached and alone[0].text == out[1][0].text


def test_chat_many_raises_after_every_call_ended(llm_cfg, fake_backend, monkeypatch):
    def flaky(**kwargs):
        if kwargs["messages"][-1]["content"] == "bad":
            raise import_litellm().exceptions.BadRequestError("bad", "openai", "fake-model")
        return fake_backend(**kwargs)

    monkeypatch.setattr(import_litellm(), "completion", flaky)
    client = make_client(llm_cfg)
    with pytest.raises(LLMError):
        client.chat_many([{"messages": [{"role": "user", "content": t}]} for t in ("a", "bad", "c")])
    assert sorted(c["messages"][-1]["content"] for c in fake_backend.calls) == ["a", "c"]
    assert client.stats.calls == 2 and client.stats.errors == 1


def test_prompt_tokens_the_backend_reused_are_counted(llm_cfg, monkeypatch):
    from litellm.types.utils import PromptTokensDetailsWrapper

    real = import_litellm().completion

    def reply(**kwargs):
        response = real(model="gpt-4o-mini", messages=kwargs["messages"], mock_response="ok")
        response.usage.prompt_tokens_details = PromptTokensDetailsWrapper(cached_tokens=3)
        return response

    monkeypatch.setattr(import_litellm(), "completion", reply)
    client = make_client({**llm_cfg, "cache": False})
    client.chat(MSG)
    assert client.stats.cached_prompt_tokens == 3 and "3 prompt tokens reused" in client.stats.summary()


def test_sampling_settings_are_checked(llm_cfg):
    for bad in ({"concurrency": 0}, {"n_parallel": -1}, {"n_threads": "many"}):
        with pytest.raises(LLMError):
            make_client({**llm_cfg, **bad})
    assert make_client({**llm_cfg, "n_threads": "2"}).settings.n_threads == 2


# -- cache -------------------------------------------------------------------------------


def test_second_identical_call_makes_no_backend_call(llm_cfg, fake_backend):
    first = make_client(llm_cfg).chat(MSG, n=2, seed=1)
    assert len(fake_backend.calls) == 2
    again = make_client(llm_cfg)  # a new client (new process, same cache file)
    second = again.chat(MSG, n=2, seed=1)
    assert len(fake_backend.calls) == 2
    assert [r.text for r in second] == [r.text for r in first]
    assert all(r.cached and r.cost == 0.0 and r.latency_s == 0.0 for r in second)
    assert again.stats.cache_hits == 2 and again.stats.requests == 0
    assert again.stats.completion_tokens == 0  # cached replies cost no tokens


def test_cache_key_covers_seed_params_and_messages(llm_cfg, fake_backend):
    client = make_client(llm_cfg)
    client.chat(MSG, seed=1)
    client.chat(MSG, seed=2)
    client.chat(MSG, seed=1, temperature=0.9)
    client.chat(MSG, seed=1, stop=["x"])
    client.chat(MSG[1:], seed=1)
    assert len(fake_backend.calls) == 5
    client.chat(MSG, seed=1)
    assert len(fake_backend.calls) == 5


def test_more_samples_later_only_generates_the_new_ones(llm_cfg, fake_backend):
    client = make_client(llm_cfg)
    two = client.chat(MSG, n=2)
    four = client.chat(MSG, n=4)
    assert len(fake_backend.calls) == 4
    assert [r.text for r in four[:2]] == [r.text for r in two]
    assert [r.cached for r in four] == [True, True, False, False]


def test_replay_only_answers_from_the_cache_and_refuses_a_request_it_has_no_reply_for(llm_cfg, fake_backend):
    recorded = make_client(llm_cfg).chat(MSG)[0].text
    replay = make_client({**llm_cfg, "replay_only": True})
    assert replay.chat(MSG)[0].text == recorded and len(fake_backend.calls) == 1
    with pytest.raises(LLMError, match="no recorded reply"):
        replay.chat(MSG, seed=7)
    assert len(fake_backend.calls) == 1  # nothing was sent


def _feedback_rounds(client, measured: str) -> list[str]:
    """Two rounds of a search: the second prompt carries what training measured."""
    first = client.chat(MSG, n=2, tag="search-it0")
    feedback = [*MSG, {"role": "assistant", "content": first[0].text}, {"role": "user", "content": measured}]
    second = client.chat(feedback, n=2, tag="search-it1")
    return [r.text for r in first + second]


def test_a_replay_finds_a_reply_by_its_place_where_the_prompt_carries_other_measurements(llm_cfg, fake_backend):
    recorded = _feedback_rounds(make_client(llm_cfg, scope="run-a"), "fitness 41.7")
    sent = len(fake_backend.calls)
    replay = make_client({**llm_cfg, "replay_only": True}, scope="run-a")
    # training came out differently (another CPU): round 1's prompt differs, its replies are the recorded ones
    assert _feedback_rounds(replay, "fitness 41.9") == recorded
    assert len(fake_backend.calls) == sent  # the replay sent nothing
    assert replay.stats.by_position == 2 and replay.stats.cache_hits == 4


def test_a_replay_by_place_stays_within_its_run(llm_cfg, fake_backend):
    _feedback_rounds(make_client(llm_cfg, scope="run-a"), "fitness 41.7")
    sent = len(fake_backend.calls)
    other_run = make_client({**llm_cfg, "replay_only": True}, scope="run-b")
    with pytest.raises(ReplayMiss, match="by its prompt or by its place"):
        _feedback_rounds(other_run, "fitness 41.9")  # round 0 replays by prompt; round 1 has no place in run-b
    assert len(fake_backend.calls) == sent


def test_concurrent_calls_take_their_places_in_call_order(llm_cfg, fake_backend):
    calls = [dict(messages=[{"role": "user", "content": f"state {k}"}], tag="judge") for k in range(6)]
    recorded = [r[0].text for r in make_client({**llm_cfg, "concurrency": 6}, scope="s").chat_many(calls)]
    changed = [dict(c, messages=[{"role": "user", "content": f"other state {k}"}]) for k, c in enumerate(calls)]
    replay = make_client({**llm_cfg, "replay_only": True, "concurrency": 6}, scope="s")
    assert [r[0].text for r in replay.chat_many(changed)] == recorded


def test_cache_off_calls_every_time(llm_cfg, fake_backend):
    client = make_client({**llm_cfg, "cache": False})
    client.chat(MSG)
    client.chat(MSG)
    assert len(fake_backend.calls) == 2 and client.cache is None


# -- retries and errors ---------------------------------------------------------------


def _rate_limit():
    return import_litellm().exceptions.RateLimitError("slow down", "openai", "fake-model")


def test_transient_errors_are_retried_with_growing_backoff(llm_cfg, fake_backend):
    fake_backend.fail_with = [_rate_limit(), _rate_limit()]
    client = make_client(llm_cfg)
    delays: list[float] = []
    client._sleep = delays.append
    replies = client.chat(MSG)
    assert len(fake_backend.calls) == 3 and replies[0].text.startswith("hello|")
    assert len(delays) == 2 and 1.0 <= delays[0] < 2.0 <= delays[1] < 4.0


def test_persistent_transient_error_becomes_llm_error(llm_cfg, fake_backend):
    fake_backend.fail_with = [_rate_limit() for _ in range(5)]
    client = make_client(llm_cfg)
    client._sleep = lambda s: None
    with pytest.raises(LLMError, match="after 3 attempt"):
        client.chat(MSG)
    assert len(fake_backend.calls) == 3  # 1 + retries
    assert client.stats.errors == 1 and client.stats.calls == 0


def test_unreachable_server_names_api_base(llm_cfg, fake_backend):
    litellm = import_litellm()
    fake_backend.fail_with = [litellm.exceptions.APIConnectionError("refused", "openai", "m") for _ in range(3)]
    client = make_client({**llm_cfg, "api_base": "http://127.0.0.1:9/v1"})
    client._sleep = lambda s: None
    with pytest.raises(LLMError, match=r"llm\.api_base=http://127\.0\.0\.1:9/v1"):
        client.chat(MSG)


def test_missing_key_names_the_env_var(monkeypatch, fake_backend, tmp_path):
    from core.llm.__main__ import compose_llm

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    cfg = compose_llm(["llm=openai", f"llm.cache_path={tmp_path / 'c.sqlite'}"])
    with pytest.raises(LLMError, match="OPENAI_API_KEY"):
        make_client(cfg).ask("hi")
    assert fake_backend.calls == []  # failed before any request


def test_key_is_read_from_the_named_env_var(monkeypatch, llm_cfg, fake_backend):
    monkeypatch.setenv("MY_LLM_KEY", "sk-test")
    make_client({**llm_cfg, "api_key_env": "MY_LLM_KEY"}).ask("hi")
    assert fake_backend.calls[0]["api_key"] == "sk-test"


def test_rejected_key_is_not_retried(monkeypatch, llm_cfg, fake_backend):
    litellm = import_litellm()
    monkeypatch.setenv("MY_KEY", "sk-bad")
    fake_backend.fail_with = [litellm.exceptions.AuthenticationError("bad key", "openai", "m")]
    with pytest.raises(LLMError, match="Check MY_KEY"):
        make_client({**llm_cfg, "api_key_env": "MY_KEY"}).ask("hi")
    assert len(fake_backend.calls) == 1


# -- accounting and records ----------------------------------------------------------


def test_stats_add_up_and_export_as_metrics(llm_cfg, fake_backend):
    fake_backend.cost = 0.002
    seen: list[CallRecord] = []
    client = make_client({**llm_cfg, "max_n": 2}, on_call=seen.append)
    replies = client.chat(MSG, n=3, tag="unit")
    client.chat(MSG, n=3, tag="unit")  # all cached
    s = client.stats
    assert (s.calls, s.requests, s.cache_hits) == (2, 2, 3)
    assert s.prompt_tokens == 20 and s.completion_tokens == 15
    assert s.cost == pytest.approx(0.004)
    assert sum(r.completion_tokens for r in replies) == 15
    assert sum(r.cost for r in replies) == pytest.approx(0.004)
    metrics = s.as_metrics()
    assert metrics["llm/calls"] == 2.0 and metrics["llm/cache_hits"] == 3.0 and "llm/cost" in metrics
    assert len(seen) == 2 and seen == client.records
    assert seen[0].tag == "unit" and seen[0].params["n"] == 3 and len(seen[0].replies) == 3
    assert seen[0].messages == MSG


def test_failing_on_call_does_not_lose_the_reply(llm_cfg, fake_backend):
    def boom(record):
        raise RuntimeError("tracker down")

    client = make_client(llm_cfg, on_call=boom)
    assert client.ask("hi").startswith("hi|")
    assert len(client.records) == 1


def test_real_litellm_response_is_parsed(llm_cfg):
    # litellm's own mock path: exercises response parsing and cost lookup offline.
    client = make_client({**llm_cfg, "model": "gpt-4o-mini", "cache": False, "extra": {"mock_response": "mocked"}})
    replies = client.chat(MSG, n=1)
    assert replies[0].text == "mocked" and not replies[0].cached
    assert client.stats.prompt_tokens > 0 and client.stats.completion_tokens > 0


def test_stats_summary_is_one_line():
    line = LLMStats(calls=1, requests=1, prompt_tokens=3, completion_tokens=4, latency_s=1.5).summary()
    assert "\n" not in line and "3 prompt + 4 completion" in line


def test_client_type():
    assert isinstance(make_client({"model": "gpt-4o-mini", "cache": False}), LLMClient)


def test_cache_path_may_be_a_folder(llm_cfg, tmp_path, fake_backend):
    client = make_client({**llm_cfg, "cache_path": str(tmp_path / "runcache")})
    assert client.cache.path == tmp_path / "runcache" / "llm_cache.sqlite"


def test_run_config_puts_the_cache_under_cache_dir(make_config, tmp_path, fake_backend):
    cfg = make_config([])
    client = make_client(cfg.llm)
    assert client.cache.path.parent == tmp_path / "cache"


def test_a_reply_cut_off_at_the_cap_is_counted_and_continued_where_it_stopped(llm_cfg, monkeypatch):
    from litellm.types.utils import Choices, Message, ModelResponse, Usage

    from core.llm.client import CONTINUE, import_litellm

    pieces = iter([('```json\n[{"name": "a", ', "length"), ('```json\n"trees": 0.5}]\n```', "stop")])
    sent: list[list[dict]] = []

    def completion(**kwargs):
        sent.append(kwargs["messages"])
        text, reason = next(pieces)
        return ModelResponse(
            choices=[Choices(index=0, finish_reason=reason, message=Message(role="assistant", content=text))],
            model=kwargs["model"],
            usage=Usage(prompt_tokens=10, completion_tokens=5, total_tokens=15),
        )

    monkeypatch.setattr(import_litellm(), "completion", completion)
    client = make_client({**llm_cfg, "cache": False})
    ask = [{"role": "user", "content": "two configs as JSON"}]
    (first,) = client.chat(ask)
    assert first.cut_off and client.stats.cut_off == 1
    whole = client.continue_reply(ask, first, tag="envs")
    assert whole.text == '```json\n[{"name": "a", "trees": 0.5}]\n```' and not whole.cut_off
    assert sent[1][-2:] == [{"role": "assistant", "content": first.text}, {"role": "user", "content": CONTINUE}]
    assert client.stats.cut_off == 1 and client.continue_reply(ask, whole) is not None and len(sent) == 2
