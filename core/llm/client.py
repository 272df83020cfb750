"""One LLM client over litellm: samples, retries, a persistent cache, accounting.

Plugins never call litellm themselves; they get an :class:`LLMClient` (``run.llm``)
and call :meth:`LLMClient.chat` or :meth:`LLMClient.ask`. The backend is whatever the
Hydra ``llm`` node names: the embedded local model by default, or any litellm model
string (``gpt-4o``, ``anthropic/...``, ``ollama/...``, ``openai/<name>`` + ``api_base``).

Samples: ``chat(n=K)`` asks for the K samples together. Backends with OpenAI's ``n``
get ``llm.max_n`` samples per request; the rest, and backends without ``n``, get their
requests concurrently (up to ``llm.concurrency`` at a time). The embedded model decodes
the samples of one request together in its slots from one computation of the prompt.

Reproducibility: sample ``i`` of a call with seed ``s`` is cached under a key of
(model, messages, sampling params, ``s``, ``i``), so re-running an experiment with the
same seed makes no backend call and gets the same replies. A request that starts at
sample ``i`` is sent the seed :func:`sample_seed` ``(s, i)``, so requests differ from
one another. How the samples were grouped into requests is not part of the key.

Embeddings: :meth:`LLMClient.embed` gives one unit vector per text: the embedded model's
from a second, embedding-mode server over the same GGUF, any other backend's from
``litellm.embedding`` (the chat model, or another embedding model named per call). Each
text's vector is kept in memory and in the response cache, under (model, text).

Arrival: :meth:`LLMClient.chat_groups` hands a call's samples over in groups as their
requests land (in sample order, the same replies as :meth:`LLMClient.chat`), so that a
caller can start on the first samples (the loop trains them) while the rest are sampled.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import math
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import did_you_mean
from core.llm.cache import ResponseCache, cache_key, default_cache_path, position_key
from core.llm.errors import LLMError, ReplayMiss, missing_key

log = logging.getLogger(__name__)

_ROLES = ("system", "user", "assistant", "tool")


# -------------------------------------------------------------------------------------
# Records
# -------------------------------------------------------------------------------------


@dataclass
class Reply:
    """One sampled reply.

    ``prompt_tokens``/``completion_tokens`` describe the reply even when it came from
    the cache; ``latency_s`` and ``cost`` are what *this* call paid (0 when cached).
    When a backend returned several samples in one request, ``latency_s`` is that
    request's wall time and the completion tokens are split evenly between them.
    """

    text: str
    prompt_tokens: int
    completion_tokens: int
    latency_s: float
    cost: float
    cached: bool
    model: str
    # the most likely first tokens of the reply, token text -> log-probability; set only
    # when the call asked for ``top_logprobs`` and the backend returns them
    logprobs: dict[str, float] | None = None
    # why the reply ended: "stop" (it was complete), "length" (cut off at max_tokens); "" unknown
    finish_reason: str = ""

    @property
    def cut_off(self) -> bool:
        """Whether the reply ended at the token cap rather than where the model stopped."""
        return self.finish_reason == "length"


#: what :meth:`LLMClient.continue_reply` asks after a reply the token cap cut off
CONTINUE = (
    "Your reply was cut off at the length limit. Continue it from exactly where it stopped: "
    "do not repeat anything already written and do not start over."
)


@dataclass
class CallRecord:
    """One :meth:`LLMClient.chat` call: what was asked and every reply (for artifacts)."""

    tag: str
    messages: list[dict]
    replies: list[Reply]
    params: dict


@dataclass
class CallProgress:
    """How far one :meth:`LLMClient.chat` call is, for a live line (``on_progress``).

    ``tokens`` counts the completion tokens received so far over all the call's samples
    as the backend streams them (the embedded model, and litellm backends that stream);
    a backend that does not stream adds a request's tokens when it ends.
    """

    tag: str
    samples: int  # samples requested from the backend (cache hits excluded)
    max_tokens: int  # the cap per sample
    tokens: int = 0
    started: float = field(default_factory=time.perf_counter)
    first_token: float | None = None  # when the first token came (before it: the prompt is computed)
    done: bool = False

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    @property
    def rate(self) -> float:
        """Completion tokens per second since the first one (0 before it)."""
        if self.first_token is None:
            return 0.0
        return self.tokens / max(1e-6, time.perf_counter() - self.first_token)


@dataclass
class LLMStats:
    """Running totals of one client. Tokens, cost and latency count backend work only."""

    calls: int = 0  # chat() calls
    cache_hits: int = 0  # replies served from the cache
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0  # USD, where litellm knows the price (0 for local models)
    latency_s: float = 0.0  # time backend requests took, summed over requests (concurrent ones overlap)
    requests: int = 0  # backend requests (a request may return several samples)
    errors: int = 0  # calls that ended in LLMError
    cached_prompt_tokens: int = 0  # prompt tokens the backend reused from earlier requests (prefix cache)
    wait_s: float = 0.0  # wall time callers waited; below latency_s when requests ran concurrently
    overlap_s: float = 0.0  # wall time requests ran while the caller worked on samples already delivered (chat_groups)
    cut_off: int = 0  # replies the backend ended at max_tokens (finish_reason "length"), not where the model stopped
    by_position: int = 0  # replies a replay found by their place in the run, not by their prompt (llm.replay_only)

    def as_metrics(self) -> dict[str, float]:
        """``{"llm/calls": ..., "llm/cache_hits": ..., ...}`` for a metrics logger."""
        return {f"llm/{f.name}": float(getattr(self, f.name)) for f in fields(self)}

    def summary(self) -> str:
        """One line for logs and the command line."""
        return (
            f"{self.calls} call(s), {self.requests} request(s), {self.cache_hits} cache hit(s), "
            f"{self.prompt_tokens} prompt + {self.completion_tokens} completion tokens"
            + (f" ({self.cached_prompt_tokens} prompt tokens reused)" if self.cached_prompt_tokens else "")
            + f", {self.wait_s:.1f} s, ${self.cost:.4f}"
        )


@dataclass
class EmbedStats:
    """Running totals of one client's :meth:`LLMClient.embed` calls (apart from :class:`LLMStats`,
    whose figures describe chat calls)."""

    calls: int = 0  # embed() calls
    texts: int = 0  # texts asked for, over all calls
    cache_hits: int = 0  # texts served from memory or the response cache
    requests: int = 0  # backend requests (one per call that had texts to compute)
    seconds: float = 0.0  # wall time of those requests
    errors: int = 0  # calls that ended in LLMError

    def as_metrics(self) -> dict[str, float]:
        """``{"embed/calls": ..., "embed/texts": ..., ...}`` for a metrics logger."""
        return {f"embed/{f.name}": float(getattr(self, f.name)) for f in fields(self)}


# -------------------------------------------------------------------------------------
# Settings (the Hydra ``llm`` node)
# -------------------------------------------------------------------------------------


@dataclass
class LLMSettings:
    """The ``llm`` config node, typed. ``conf/llm/*.yaml`` documents every key."""

    model: str = "embedded/qwen2.5-coder-1.5b-instruct"
    api_base: str | None = None
    api_key_env: str | None = None
    temperature: float = 0.7
    max_tokens: int = 1024
    top_p: float | None = None
    timeout_s: float = 600.0
    retries: int = 4
    backoff_s: float = 2.0
    max_n: int = 8
    concurrency: int = 8
    cache: bool = True
    replay_only: bool = False  # answer only from the cache: a request with no recorded reply is an LLMError
    cache_path: str | None = None
    n_threads: int | str = "auto"
    n_parallel: int = 0
    n_ctx: int = 8192
    prefix_cache: bool = True
    gguf_path: str | None = None
    show_progress: bool = True
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_cfg(cls, cfg: LLMSettings | Mapping[str, Any] | None) -> LLMSettings:
        """Build from a mapping or DictConfig (typed records are returned as they are);
        unknown keys and bad values are an :class:`LLMError`.

        A run's ``llm`` node is typed once by :func:`core.config.validate` (one paragraph
        per mistake); this is for clients made from a plain mapping.
        """
        if isinstance(cfg, LLMSettings):
            return cfg
        if cfg is None:
            return cls()
        try:
            from omegaconf import DictConfig, OmegaConf

            if isinstance(cfg, DictConfig):
                cfg = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
        except ImportError:  # pragma: no cover - omegaconf is a base dependency
            pass
        names = [f.name for f in fields(cls)]
        values = {}
        for key, value in dict(cfg).items():
            if key not in names:
                raise LLMError(
                    f"Unknown LLM setting 'llm.{key}'.{did_you_mean(str(key), names)} "
                    f"Known settings: {', '.join(names)}."
                )
            values[key] = value
        settings = cls(**values)
        try:
            settings.check()
        except ValueError as err:
            raise LLMError(f"llm.{err}.") from None
        return settings

    def check(self) -> None:
        """Refuse values that cannot work (``ValueError``); ``n_threads`` given as a number string becomes an int."""
        if self.max_n < 1 or self.concurrency < 1 or self.retries < 0 or self.n_parallel < 0:
            raise ValueError("max_n and llm.concurrency must be >= 1, llm.retries and llm.n_parallel >= 0")
        if isinstance(self.n_threads, str):
            if self.n_threads.lstrip("-").isdigit():
                self.n_threads = int(self.n_threads)
            elif self.n_threads != "auto":
                raise ValueError(f"n_threads must be a number or 'auto', got {self.n_threads!r}")

    @property
    def is_embedded(self) -> bool:
        return self.model.startswith("embedded/")


def sample_seed(seed: int, index: int) -> int:
    """The backend seed for sample ``index`` of a call made with ``seed``."""
    return (int(seed) * 1_000_003 + int(index)) % (2**31)


# -------------------------------------------------------------------------------------
# litellm, imported once, quietly and offline
# -------------------------------------------------------------------------------------


def import_litellm() -> Any:
    """``litellm`` with the local cost map (no network at import) and quiet logs."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    os.environ.setdefault("LITELLM_LOG", "ERROR")
    import litellm

    litellm.suppress_debug_info = True
    litellm.telemetry = False
    for name in ("LiteLLM", "LiteLLM Router", "LiteLLM Proxy", "litellm", "httpx"):
        logging.getLogger(name).setLevel(logging.ERROR)
    return litellm


def _transient_errors(litellm: Any) -> tuple[type[BaseException], ...]:
    exc = litellm.exceptions
    return (
        exc.RateLimitError,
        exc.Timeout,
        exc.APIConnectionError,
        exc.ServiceUnavailableError,
        exc.InternalServerError,
        exc.BadGatewayError,
    )


# -------------------------------------------------------------------------------------
# The client
# -------------------------------------------------------------------------------------


class LLMClient:
    """Chat with the configured model; see the module docstring.

    :param cfg: the Hydra ``llm`` node (or any mapping with the same keys).
    :param on_call: called with a :class:`CallRecord` after every successful
        :meth:`chat` (the tracker logs it as an MLflow artifact).
    :param on_progress: called with a :class:`CallProgress` when a call that needs the
        backend starts, as its tokens arrive (a few times a second at most) and when it
        ends (``done``); e.g. :class:`core.progress.LLMCallView`. With it, the backends
        stream their replies (what is sampled, cached and returned is the same).
    """

    #: seconds between two ``on_progress`` reports of one call while tokens arrive
    PROGRESS_EVERY_S = 0.25

    def __init__(
        self,
        cfg: LLMSettings | Mapping[str, Any] | None,
        on_call: Callable[[CallRecord], None] | None = None,
        on_progress: Callable[[CallProgress], None] | None = None,
        scope: str = "",
    ) -> None:
        self.settings = LLMSettings.from_cfg(cfg)
        self.on_call = on_call
        self.on_progress = on_progress
        self.scope = scope  # the run the calls belong to: with it, each reply is also cached by its place
        self._calls_by_tag: dict[str, int] = {}  # calls made so far per tag (a sample's place in the run)
        self._numbered = threading.local()  # the call number chat_many gave the call this thread makes
        self._stream_ok = True  # set False when a litellm backend fails to stream (then it is asked whole)
        self.stats = LLMStats()
        self.embed_stats = EmbedStats()
        self._embeddings: dict[tuple[str, str], np.ndarray] = {}  # (model, text) -> unit vector
        self.records: list[CallRecord] = []
        self.cache: ResponseCache | None = None
        if self.settings.cache:
            self.cache = ResponseCache(cache_file(self.settings.cache_path))
        self._lock = threading.Lock()
        self._n_support: bool | None = None  # whether the provider takes OpenAI's n (asked once)
        self._sleep: Callable[[float], None] = time.sleep  # replaced in tests
        self._litellm = import_litellm()
        if self.settings.is_embedded:
            from core.llm import embedded

            embedded.configure(
                n_threads=self.settings.n_threads,
                n_parallel=self.settings.n_parallel,
                n_ctx=self.settings.n_ctx,
                prefix_cache=self.settings.prefix_cache,
                gguf_path=self.settings.gguf_path,
                show_progress=self.settings.show_progress,
            )
            embedded.register()

    @property
    def model(self) -> str:
        return self.settings.model

    # -- public API ----------------------------------------------------------------

    def chat(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float | None = None,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        seed: int = 0,
        tag: str = "",
        top_logprobs: int = 0,
    ) -> list[Reply]:
        """``n`` sampled replies to ``messages`` (OpenAI chat format).

        The samples not in the cache are requested together: ``llm.max_n`` per request
        where the backend takes ``n``, the requests concurrently (``llm.concurrency``).
        ``temperature``/``max_tokens`` default to the config's; ``stop`` ends a reply
        at any of the given strings; ``seed`` makes the call reproducible through the
        cache; ``tag`` labels the call in records (e.g. ``"eureka/propose"``).
        ``top_logprobs > 0`` asks for that many alternatives of the reply's first token
        with their log-probabilities (:attr:`Reply.logprobs`); backends without them
        (the parameter is dropped) leave it None, so callers need a text fallback.
        Raises :class:`LLMError` when the backend cannot answer after the retries.
        """
        return [
            reply
            for group in self.chat_groups(
                messages,
                n=n,
                temperature=temperature,
                max_tokens=max_tokens,
                stop=stop,
                seed=seed,
                tag=tag,
                top_logprobs=top_logprobs,
            )
            for reply in group
        ]

    def chat_groups(
        self,
        messages: list[dict[str, str]],
        *,
        n: int = 1,
        temperature: float | None = None,
        max_tokens: int | None = None,
        stop: list[str] | None = None,
        seed: int = 0,
        tag: str = "",
        top_logprobs: int = 0,
    ) -> Iterator[list[Reply]]:
        """:meth:`chat`'s ``n`` replies, handed over in groups as their requests land.

        The groups, joined, are exactly :meth:`chat`'s list (same cache keys, same
        replies, same order): a group is the run of samples from the first one not yet
        handed over up to the first one still being sampled, so cached samples come at
        once and a request that lands early waits for the ones before it. The requests
        not yet landed keep running while the caller works on a group; that time counts
        in ``stats.overlap_s``, not in ``stats.wait_s``. The call is recorded (and
        ``on_call`` called) before its last group is handed over. Arguments and errors as
        in :meth:`chat` (raised when the generator is first advanced, or after the
        groups that did land).
        """
        messages = _check_messages(messages)
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        params: dict[str, Any] = {
            "temperature": float(self.settings.temperature if temperature is None else temperature),
            "max_tokens": int(self.settings.max_tokens if max_tokens is None else max_tokens),
            "stop": list(stop) if stop else None,
            "top_p": self.settings.top_p,
            "top_logprobs": int(top_logprobs) if top_logprobs > 0 else None,
        }
        keys = [cache_key(self.model, messages, params, seed, i) for i in range(n)]
        places = self._places(params, seed, tag, n)
        replies: list[Reply | None] = [None] * n
        by_position = 0
        if self.cache is not None:
            for i, key in enumerate(keys):
                hit = self.cache.get(key)
                if hit is None and places and self.settings.replay_only:
                    hit = self._at_place(places[i])
                    by_position += hit is not None
                if hit is not None:
                    replies[i] = Reply(**{**hit, "latency_s": 0.0, "cost": 0.0, "cached": True})
        missing = [i for i, r in enumerate(replies) if r is None]
        if missing and self.settings.replay_only:
            raise ReplayMiss(
                f"llm.replay_only: no recorded reply for {len(missing)} of the {n} sample(s) of the call "
                f"'{tag or 'call'}', by its prompt or by its place in the run (a request the recorded run "
                "did not make: other code, config or seed). Set llm.replay_only=false to ask the LLM."
            )
        sent = 0  # samples handed over so far

        def landed() -> list[Reply]:  # the samples from ``sent`` up to the first one still missing
            nonlocal sent
            end = sent
            while end < n and replies[end] is not None:
                end += 1
            group, sent = replies[sent:end], end
            return group  # type: ignore[return-value]

        if missing:
            watch = CallProgress(tag, len(missing), params["max_tokens"]) if self.on_progress is not None else None
            self._report(watch)
            try:
                for _ in self._sample(messages, params, seed, missing, keys, replies, watch):
                    if all(r is not None for r in replies[sent:]):
                        continue  # the last group waits until the call is recorded
                    group = landed()
                    if group:
                        yield group
            finally:
                if watch is not None:
                    watch.done = True
                    self._report(watch)
        done = [r for r in replies if r is not None]
        record = CallRecord(
            tag=tag,
            messages=[dict(m) for m in messages],
            replies=done,
            params={"model": self.model, "n": n, "seed": seed, **params},
        )
        if self.cache is not None:
            for place, key in zip(places, keys):  # a place already held (the replay's own) is kept
                self.cache.put(place, {"position_of": key}, model=self.model)
        with self._lock:
            self.stats.calls += 1
            self.stats.cache_hits += n - len(missing)
            self.stats.by_position += by_position
            self.records.append(record)
        if self.on_call is not None:
            try:
                self.on_call(record)
            except Exception:  # a tracking hiccup must not lose a paid-for reply
                log.warning("on_call callback failed for LLM call %r", tag, exc_info=True)
        group = landed()
        if group:
            yield group

    def _next_call(self, tag: str) -> int:
        """How many calls with ``tag`` came before this one (counted once per call)."""
        with self._lock:
            call = self._calls_by_tag.get(tag, 0)
            self._calls_by_tag[tag] = call + 1
        return call

    def _chat_numbered(self, call: int, kwargs: Mapping[str, Any]) -> list[Reply]:
        self._numbered.call = call
        try:
            return self.chat(**kwargs)
        finally:
            self._numbered.call = None

    def _places(self, params: dict[str, Any], seed: int, tag: str, n: int) -> list[str]:
        """The :func:`position_key` of each sample of this call ([] without a scope or a cache)."""
        call = getattr(self._numbered, "call", None)
        if call is None:
            call = self._next_call(tag)
        if not self.scope or self.cache is None:
            return []
        return [position_key(self.model, params, seed, self.scope, tag, call, i) for i in range(n)]

    def _at_place(self, place: str) -> dict[str, Any] | None:
        """The reply a recorded run got at ``place``, or None."""
        assert self.cache is not None
        ref = self.cache.get(place)
        return self.cache.get(ref["position_of"]) if ref and "position_of" in ref else None

    def chat_many(self, calls: Sequence[Mapping[str, Any]]) -> list[list[Reply]]:
        """Several independent :meth:`chat` calls at once, replies in call order.

        ``calls`` holds each call's keyword arguments, ``messages`` included (e.g. K
        conversations that each carry their own follow-up). The calls run concurrently, up
        to ``llm.concurrency`` at a time; each is cached, counted and recorded exactly as
        if made alone. Raises the first :class:`LLMError` once every call has ended.
        """
        calls = [dict(c) for c in calls]
        if len(calls) <= 1 or self.settings.concurrency <= 1:
            return [self.chat(**c) for c in calls]
        numbers = [self._next_call(c.get("tag", "")) for c in calls]  # places in call order, not thread order
        with ThreadPoolExecutor(
            max_workers=min(self.settings.concurrency, len(calls)), thread_name_prefix="llm-call"
        ) as pool:
            futures = [pool.submit(self._chat_numbered, k, c) for k, c in zip(numbers, calls)]
        errors = [e for f in futures if (e := f.exception()) is not None]
        if errors:
            raise errors[0]
        return [f.result() for f in futures]

    def continue_reply(
        self, messages: Sequence[Mapping[str, str]], reply: Reply, *, rounds: int = 1, tag: str = "", **kw: Any
    ) -> Reply:
        """``reply`` (to ``messages``) continued where the token cap cut it off, for at most
        ``rounds`` more requests, instead of asking again from scratch.

        Each request sends the conversation with the text so far as the assistant's turn
        and :data:`CONTINUE` (``kw`` as in :meth:`chat`: max_tokens, temperature, seed);
        the pieces are joined (a code fence the continuation reopens is dropped). The
        result's tokens, latency and ``finish_reason`` are the last piece's; a reply that was
        not cut off comes back as it is.
        """
        text = reply.text
        for k in range(rounds):
            if not reply.cut_off:
                break
            follow = [
                *({"role": m["role"], "content": m["content"]} for m in messages),
                {"role": "assistant", "content": text},
                {"role": "user", "content": CONTINUE},
            ]
            (reply,) = self.chat(follow, n=1, tag=f"{tag or 'call'}-continued{k + 1}", **kw)
            piece = reply.text
            if piece.lstrip().startswith("```") and text.count("```") % 2 == 1:  # still inside the open fence
                piece = piece.lstrip().split("\n", 1)[1] if "\n" in piece.lstrip() else ""
            text += piece
        return replace(reply, text=text)

    def ask(self, prompt: str, *, system: str | None = None, **kw: Any) -> str:
        """The text of one reply to a single user ``prompt`` (``kw`` as in :meth:`chat`)."""
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        return self.chat(messages, n=1, **kw)[0].text

    def embed(self, texts: Sequence[str], *, model: str | None = None, tag: str = "") -> np.ndarray:
        """``[len(texts), D]`` float32: one L2-normalised embedding per text, in order.

        ``model``: the embedding model, default the configured one. The embedded model
        embeds in-process (:func:`core.llm.embedded.embed`); any other model string goes to
        ``litellm.embedding`` with the client's ``api_base``, key and timeout, retried on
        transient errors like a chat request. Texts already embedded by this client, or
        in the response cache, cost nothing; the rest go in one request. ``tag`` labels
        the call in errors. Raises :class:`LLMError` when the backend cannot embed (a chat
        model without embeddings: name an embedding model, e.g.
        ``openai/text-embedding-3-small``), or, with ``llm.replay_only``, for a text the
        cache does not hold.
        """
        name = model or self.settings.model
        texts = [str(t) for t in texts]
        with self._lock:
            self.embed_stats.calls += 1
            self.embed_stats.texts += len(texts)
        out: dict[str, np.ndarray] = {}
        for text in dict.fromkeys(texts):
            hit = self._embeddings.get((name, text))
            if hit is None and self.cache is not None:
                stored = self.cache.get(_embedding_key(name, text))
                if stored is not None:
                    hit = np.frombuffer(base64.b64decode(stored["embedding"]), dtype=np.float32).copy()
                    self._embeddings[(name, text)] = hit
            if hit is not None:
                out[text] = hit
        missing = [t for t in dict.fromkeys(texts) if t not in out]
        with self._lock:
            self.embed_stats.cache_hits += sum(1 for t in texts if t not in missing)
        if missing and self.settings.replay_only:
            with self._lock:
                self.embed_stats.errors += 1
            raise LLMError(
                f"llm.replay_only: no recorded embedding for {len(missing)} text(s) of "
                f"'{tag or 'embed'}' (e.g. {missing[0][:60]!r}). Set llm.replay_only=false to ask the model."
            )
        if missing:
            start = time.perf_counter()
            try:
                vectors = self._embed_request(name, missing)
            except LLMError:
                with self._lock:
                    self.embed_stats.errors += 1
                raise
            finally:
                with self._lock:
                    self.embed_stats.requests += 1
                    self.embed_stats.seconds += time.perf_counter() - start
            for text, vector in zip(missing, vectors):
                vector = np.asarray(vector, dtype=np.float32).reshape(-1)
                norm = float(np.linalg.norm(vector))
                if not np.isfinite(norm) or norm == 0.0:
                    raise LLMError(f"The model '{name}' returned a zero or non-finite embedding for {text[:60]!r}.")
                vector = vector / norm
                self._embeddings[(name, text)] = vector
                out[text] = vector
                if self.cache is not None:
                    self.cache.put(
                        _embedding_key(name, text),
                        {"embedding": base64.b64encode(vector.tobytes()).decode("ascii"), "dim": int(vector.size)},
                        model=name,
                    )
        if not texts:
            return np.zeros((0, 0), dtype=np.float32)
        dims = {out[t].size for t in texts}
        if len(dims) != 1:
            raise LLMError(
                f"The model '{name}' returned embeddings of different sizes {sorted(dims)}; "
                "was the cache written by another model under the same name?"
            )
        return np.stack([out[t] for t in texts])

    def _embed_request(self, name: str, texts: list[str]) -> list[Any]:
        """The raw embeddings of ``texts`` from ``name``'s backend, in order."""
        s = self.settings
        if name.startswith("embedded/"):
            from core.llm import embedded

            return embedded.embed(name.split("/", 1)[1], texts)
        litellm = self._litellm
        kwargs: dict[str, Any] = {"model": name, "input": texts, "timeout": s.timeout_s}
        if s.api_base:
            kwargs["api_base"] = s.api_base
        if s.api_key_env:
            key = os.environ.get(s.api_key_env)
            if not key:
                raise LLMError(
                    f"Embeddings from '{name}' need an API key, but the environment variable "
                    f"{s.api_key_env} is not set. Set it, or use the offline default `llm=embedded`."
                )
            kwargs["api_key"] = key
        elif s.api_base and name.startswith("openai/"):
            kwargs["api_key"] = "not-needed"  # a self-hosted server usually wants none; the SDK wants one
        transient = _transient_errors(litellm)
        attempt = 0
        while True:
            try:
                response = litellm.embedding(**kwargs)
                break
            except transient as exc:
                if attempt == s.retries:
                    raise LLMError(self._explain_transient(exc, attempt + 1)) from exc
                self._sleep(min(60.0, s.backoff_s * 2**attempt) * (1 + 0.25 * random.random()))
                attempt += 1
            except Exception as exc:  # not an embedding model, bad request, no key...
                raise LLMError(
                    f"Embeddings from '{name}' failed: {type(exc).__name__}: {_short(exc)}. A chat model "
                    "may have no embeddings: name an embedding model (e.g. openai/text-embedding-3-small), "
                    "or use `llm=embedded`."
                ) from exc
        data = getattr(response, "data", None)
        if data is None and isinstance(response, Mapping):
            data = response.get("data")
        if not data or len(data) != len(texts):
            raise LLMError(f"Embeddings from '{name}': {len(data or [])} vector(s) for {len(texts)} text(s).")

        def field_of(item: Any, key: str) -> Any:
            return item.get(key) if isinstance(item, Mapping) else getattr(item, key, None)

        ordered = sorted(data, key=lambda d: int(field_of(d, "index") or 0))
        return [field_of(d, "embedding") for d in ordered]

    # -- backend -------------------------------------------------------------------

    def _report(self, watch: CallProgress | None) -> None:
        if watch is None or self.on_progress is None:
            return
        try:
            self.on_progress(watch)
        except Exception:  # a display hiccup must not lose a reply
            log.debug("on_progress callback failed", exc_info=True)

    def _counter(self, watch: CallProgress | None) -> Callable[[int], None] | None:
        """A function that adds streamed tokens to ``watch`` and reports it now and then."""
        if watch is None:
            return None
        last = [0.0]

        def add(k: int) -> None:
            with self._lock:
                watch.tokens += k
                now = time.perf_counter()
                if watch.first_token is None and k > 0:
                    watch.first_token = now
                due = now - last[0] >= self.PROGRESS_EVERY_S
                if due:
                    last[0] = now
            if due:
                self._report(watch)

        return add

    def _sample(
        self,
        messages: list[dict[str, str]],
        params: dict[str, Any],
        seed: int,
        missing: list[int],
        keys: list[str],
        replies: list[Reply | None],
        watch: CallProgress | None = None,
    ) -> Iterator[None]:
        """Fill ``replies[i]`` for every ``i`` in ``missing``: requests of up to
        :meth:`samples_per_request` samples, run concurrently, each cached as it lands.

        A generator: it pauses (yields) each time a request has landed while others may
        still run, so that :meth:`chat_groups` can hand those samples over. Time paused
        counts as the caller's own work: in ``stats.overlap_s`` as far as a request was
        running meanwhile (requests run on in threads), in neither figure otherwise.

        Every request runs to its end even when another fails, so what was paid for is
        kept; then the first failure (in sample order) is raised.
        """
        flights: list[list[float]] = []  # [from, to] of each request (to: inf while it runs)

        def run(chunk: list[int]) -> None:
            flight = [time.perf_counter(), math.inf]
            with self._lock:
                flights.append(flight)
            try:
                for i, reply in zip(chunk, self._request_samples(messages, params, seed, chunk, watch)):
                    replies[i] = reply
                    if self.cache is not None:
                        stored = {k: v for k, v in reply.__dict__.items() if k not in ("cached",)}
                        self.cache.put(keys[i], stored, model=self.model)
            finally:
                flight[1] = time.perf_counter()

        paused: list[tuple[float, float]] = []  # (from, to): the caller worked on delivered samples

        def pause() -> Iterator[None]:
            began = time.perf_counter()
            yield
            paused.append((began, time.perf_counter()))

        start = time.perf_counter()
        errors: list[tuple[int, LLMError]] = []
        try:
            chunks = _chunks(missing, self.samples_per_request(messages, params["max_tokens"]))
            first = None
            if self.settings.is_embedded and len(chunks) > 1 and self.settings.prefix_cache:
                # the first request computes the prompt; the others then find it cached
                # (requests sent together would each compute it in their own slot)
                first = chunks.pop(0)
                run(first)
            workers = min(self.settings.concurrency, len(chunks))
            if workers <= 1:
                if first is not None:
                    yield from pause()
                for chunk in chunks:
                    run(chunk)
                    yield from pause()
            else:
                with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="llm") as pool:
                    order = {pool.submit(run, chunk): k for k, chunk in enumerate(chunks)}
                    if first is not None:  # the others run while the caller takes the first
                        yield from pause()
                    for future in as_completed(order):
                        try:
                            future.result()
                        except LLMError as exc:
                            errors.append((order[future], exc))
                            continue
                        yield from pause()
        except LLMError as exc:
            errors.append((-1, exc))
        finally:
            end = time.perf_counter()
            away = sum(b - a for a, b in paused)
            with self._lock:
                overlap = sum(covered(a, b, flights) for a, b in paused)
            with self._lock:
                self.stats.wait_s += end - start - away
                self.stats.overlap_s += overlap
                self.stats.errors += 1 if errors else 0
        if errors:
            raise min(errors, key=lambda e: e[0])[1]

    def samples_per_request(self, messages: list[dict[str, str]], max_tokens: int) -> int:
        """How many samples one backend request asks for: ``llm.max_n``, 1 where the
        provider has no ``n``, and for the embedded model what its slots and KV pool hold."""
        s = self.settings
        if s.is_embedded:
            from core.llm import embedded

            name = s.model.split("/", 1)[1]
            embedded.retune(name)  # follow the free cores between calls (n_threads=auto)
            plan = embedded.get_plan(name)  # loads the model outside any timing
            chars = sum(len(m["content"]) for m in messages)
            return min(s.max_n, plan.samples_per_request(chars, max_tokens))
        return s.max_n if self._native_n else 1

    @property
    def _native_n(self) -> bool:
        """Whether litellm sends ``n`` to this provider (it would drop it otherwise)."""
        if self._n_support is None:
            try:
                model, provider, _, _ = self._litellm.get_llm_provider(self.settings.model)
                supported = self._litellm.get_supported_openai_params(model=model, custom_llm_provider=provider)
                self._n_support = supported is None or "n" in supported
            except Exception:  # unknown to litellm: try, and top up if fewer come back
                self._n_support = True
        return self._n_support

    def _request_samples(
        self,
        messages: list[dict[str, str]],
        params: dict[str, Any],
        seed: int,
        chunk: list[int],
        watch: CallProgress | None = None,
    ) -> list[Reply]:
        """``len(chunk)`` samples starting at sample ``chunk[0]``; a backend that returns
        fewer choices than asked (it ignored ``n``) is asked again for the rest."""
        got: list[Reply] = []
        while len(got) < len(chunk):
            got += self._request(messages, params, len(chunk) - len(got), sample_seed(seed, chunk[len(got)]), watch)
        return got

    def _request(
        self,
        messages: list[dict[str, str]],
        params: dict[str, Any],
        n: int,
        seed: int,
        watch: CallProgress | None = None,
    ) -> list[Reply]:
        """One backend request for ``n`` samples, with retries and backoff.

        With a ``watch`` the reply is streamed and its tokens counted as they come: the
        embedded model through :data:`core.llm.embedded.token_sink`, a litellm backend
        with ``stream=True`` (its chunks joined by ``litellm.stream_chunk_builder``; a
        backend that fails to stream is asked again without, and no longer streamed).
        Calls that ask for ``top_logprobs`` are not streamed.
        """
        s = self.settings
        kwargs: dict[str, Any] = {
            "model": s.model,
            "messages": messages,
            "temperature": params["temperature"],
            "max_tokens": params["max_tokens"],
            "seed": seed,
            "timeout": s.timeout_s,
            "num_retries": 0,  # retries are ours, so the accounting sees each one
            "drop_params": True,  # e.g. Anthropic has no seed; drop rather than fail
            **dict(s.extra),
        }
        if n > 1:
            kwargs["n"] = n
        if params["stop"]:
            kwargs["stop"] = params["stop"]
        if params["top_p"] is not None:
            kwargs["top_p"] = params["top_p"]
        if params.get("top_logprobs"):
            kwargs["logprobs"] = True
            kwargs["top_logprobs"] = params["top_logprobs"]
        if s.api_base:
            kwargs["api_base"] = s.api_base
        if s.api_key_env:
            key = os.environ.get(s.api_key_env)
            if not key:
                raise missing_key(s.model, s.api_key_env)
            kwargs["api_key"] = key
        elif s.api_base and s.model.startswith("openai/"):
            # A self-hosted OpenAI-compatible server usually wants no key, but the
            # OpenAI SDK refuses to start without one.
            kwargs["api_key"] = "not-needed"

        if s.is_embedded:
            # Load (or assemble) the local model outside the timed request, so latency
            # and tokens/s measure generation; the load time is in embedded.loaded_info().
            from core.llm import embedded

            embedded.get_server(s.model.split("/", 1)[1])

        litellm = self._litellm
        transient = _transient_errors(litellm)
        add = self._counter(watch)
        streamed = [0]  # tokens this request reported while streaming

        def counted(k: int) -> None:
            streamed[0] += k
            add(k)  # type: ignore[misc]

        attempt = 0
        while True:
            start = time.perf_counter()
            stream = add is not None and not params.get("top_logprobs") and (s.is_embedded or self._stream_ok)
            if streamed[0]:  # an attempt that failed midway: its tokens do not count
                add(-streamed[0])  # type: ignore[misc]
                streamed[0] = 0
            try:
                response = self._completion(kwargs, messages, counted if stream else None)
            except transient as exc:
                if attempt == s.retries:
                    raise LLMError(self._explain_transient(exc, attempt + 1)) from exc
                delay = min(60.0, s.backoff_s * 2**attempt) * (1 + 0.25 * random.random())
                log.warning(
                    "LLM request failed (%s); retry %d/%d in %.1f s", type(exc).__name__, attempt + 1, s.retries, delay
                )
                self._sleep(delay)
                attempt += 1
                continue
            except LLMError:
                raise
            except litellm.exceptions.AuthenticationError as exc:
                env = s.api_key_env or "the provider's API key variable (e.g. OPENAI_API_KEY)"
                raise LLMError(
                    f"The backend rejected the API key for '{s.model}' ({_short(exc)}). "
                    f"Check {env}, or use the offline default `llm=embedded`."
                ) from exc
            except Exception as exc:  # bad request, unknown model, context too long...
                if stream and not s.is_embedded:  # perhaps only the streaming: ask again, whole
                    log.info("LLM backend '%s' did not stream (%s); asking for whole replies", s.model, _short(exc))
                    self._stream_ok = False
                    continue
                raise LLMError(
                    f"The LLM call to '{s.model}' failed: {type(exc).__name__}: {_short(exc)}. "
                    "Check llm.model (any litellm model string) and the request size "
                    "(llm.max_tokens, llm.n_ctx)."
                ) from exc
            latency = time.perf_counter() - start
            replies = self._replies(response, n, latency)
            if add is not None:  # the request's own count replaces what was streamed
                add(sum(r.completion_tokens for r in replies) - streamed[0])
            return replies

    def _completion(
        self, kwargs: dict[str, Any], messages: list[dict[str, str]], on_tokens: Callable[[int], None] | None
    ) -> Any:
        """``litellm.completion(**kwargs)``; with ``on_tokens``, streamed and counted."""
        litellm = self._litellm
        if on_tokens is None:
            return litellm.completion(**kwargs)
        if self.settings.is_embedded:  # the provider runs in this thread and reads the sink
            from core.llm import embedded

            token = embedded.token_sink.set(on_tokens)
            try:
                return litellm.completion(**kwargs)
            finally:
                embedded.token_sink.reset(token)
        response = litellm.completion(**kwargs, stream=True, stream_options={"include_usage": True})
        if hasattr(response, "choices") and not hasattr(response, "__next__"):
            return response  # answered whole after all
        chunks, received = [], 0
        for chunk in response:
            chunks.append(chunk)
            pieces = sum(
                1
                for c in (getattr(chunk, "choices", None) or [])
                if getattr(getattr(c, "delta", None), "content", None)
            )
            if pieces:
                received += pieces
                on_tokens(pieces)
        built = litellm.stream_chunk_builder(chunks, messages=messages) if received else None
        if built is None or not getattr(built, "choices", None):
            # a server that answers a streamed request whole reads as an empty stream: never an empty reply
            raise ValueError("the streamed response held no text")
        return built

    def _replies(self, response: Any, n: int, latency: float) -> list[Reply]:
        usage = getattr(response, "usage", None)
        prompt_tokens = int(getattr(usage, "prompt_tokens", 0) or 0)
        details = getattr(usage, "prompt_tokens_details", None)
        reused = int(getattr(details, "cached_tokens", 0) or 0) if details is not None else 0
        completion_tokens = int(getattr(usage, "completion_tokens", 0) or 0)
        cost = 0.0 if self.settings.is_embedded else _cost(self._litellm, response)
        choices = list(response.choices)[:n]
        if not choices:
            raise LLMError(f"The model '{self.model}' returned no choices; try again or raise llm.max_tokens.")
        k = len(choices)
        replies = []
        for j, choice in enumerate(choices):
            share = completion_tokens // k + (1 if j < completion_tokens % k else 0)
            replies.append(
                Reply(
                    text=choice.message.content or "",
                    prompt_tokens=prompt_tokens,
                    completion_tokens=share,
                    latency_s=latency,
                    cost=cost / k,
                    cached=False,
                    model=self.model,
                    logprobs=first_token_logprobs(choice),
                    finish_reason=str(getattr(choice, "finish_reason", "") or ""),
                )
            )
        with self._lock:
            self.stats.requests += 1
            self.stats.prompt_tokens += prompt_tokens
            self.stats.cached_prompt_tokens += reused
            self.stats.completion_tokens += completion_tokens
            self.stats.cost += cost
            self.stats.latency_s += latency
            self.stats.cut_off += sum(r.cut_off for r in replies)
        return replies

    def _explain_transient(self, exc: BaseException, attempts: int) -> str:
        s = self.settings
        what = f"{type(exc).__name__}: {_short(exc)}"
        if isinstance(exc, self._litellm.exceptions.APIConnectionError) and not isinstance(
            exc, self._litellm.exceptions.Timeout
        ):
            where = f"llm.api_base={s.api_base}" if s.api_base else "the provider's default endpoint"
            return (
                f"Could not reach the LLM server for '{s.model}' at {where} after {attempts} "
                f"attempt(s) ({what}). Start the server or set llm.api_base to its URL "
                "(e.g. llm.api_base=http://127.0.0.1:8000/v1), or use `llm=embedded`."
            )
        return (
            f"The LLM '{s.model}' kept failing after {attempts} attempt(s) ({what}). It may be "
            "rate-limited or overloaded: raise llm.retries / llm.backoff_s / llm.timeout_s, "
            "or try again later."
        )


def make_client(
    cfg: LLMSettings | Mapping[str, Any] | None,
    on_call: Callable[[CallRecord], None] | None = None,
    on_progress: Callable[[CallProgress], None] | None = None,
    scope: str = "",
) -> LLMClient:
    """The client for the Hydra ``llm`` node ``cfg`` (see :class:`LLMClient` for the
    callbacks; ``scope`` names the run, so that a replay can find replies by their place)."""
    return LLMClient(cfg, on_call=on_call, on_progress=on_progress, scope=scope)


# -------------------------------------------------------------------------------------
# helpers
# -------------------------------------------------------------------------------------


def _check_messages(messages: Any) -> list[dict[str, str]]:
    if isinstance(messages, str) or not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
    checked = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content', got {m!r}")
        if m["role"] not in _ROLES:
            raise ValueError(f"messages[{i}] has role {m['role']!r}; expected one of {_ROLES}")
        if not isinstance(m["content"], str):
            raise ValueError(f"messages[{i}]['content'] must be a string")
        checked.append({"role": m["role"], "content": m["content"]})
    return checked


def _embedding_key(model: str, text: str) -> str:
    """The response-cache key of ``text``'s embedding by ``model`` (the embedded model's
    prompt template is part of it: another template gives other vectors)."""
    template = ""
    if model.startswith("embedded/"):
        from core.llm.embedded import EMBED_TEMPLATE

        template = EMBED_TEMPLATE
    blob = json.dumps(
        {"v": 1, "kind": "embedding", "model": model, "template": template, "text": text},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def cache_file(cache_path: str | None) -> Path:
    """``llm.cache_path`` as a file: a folder (existing, or without a suffix) gets
    ``llm_cache.sqlite`` inside it; ``None`` means the user cache dir."""
    if not cache_path:
        return default_cache_path()
    path = Path(cache_path).expanduser()
    if path.is_dir() or not path.suffix:
        return path / default_cache_path().name
    return path


def first_token_logprobs(choice: Any) -> dict[str, float] | None:
    """``{token: logprob}`` of the alternatives for a choice's first token (None if absent).

    Reads the OpenAI shape (``choice.logprobs.content[0].top_logprobs``) as objects or
    dicts; tokens are stripped of surrounding whitespace, keeping the likeliest spelling.
    """

    def get(x: Any, key: str) -> Any:
        return x.get(key) if isinstance(x, dict) else getattr(x, key, None)

    content = get(get(choice, "logprobs") or {}, "content") or []
    if not content:
        return None
    top = get(content[0], "top_logprobs") or [content[0]]
    out: dict[str, float] = {}
    for alt in top:
        token, lp = str(get(alt, "token") or "").strip(), get(alt, "logprob")
        if lp is not None and float(lp) > out.get(token, float("-inf")):
            out[token] = float(lp)
    return out or None


def covered(start: float, end: float, spans: Sequence[Sequence[float]]) -> float:
    """Seconds of ``[start, end]`` that at least one of ``spans`` (``[from, to]`` pairs) covers."""
    clipped = sorted((max(a, start), min(b, end)) for a, b in spans if b > start and a < end)
    total, reach = 0.0, start
    for a, b in clipped:
        if b > reach:
            total += b - max(a, reach)
            reach = b
    return total


def _chunks(items: list[int], size: int) -> list[list[int]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


def _cost(litellm: Any, response: Any) -> float:
    hidden = getattr(response, "_hidden_params", None) or {}
    if hidden.get("response_cost") is not None:
        return float(hidden["response_cost"])
    try:
        return float(litellm.completion_cost(completion_response=response))
    except Exception:  # unknown price (self-hosted, new model): count it as 0
        return 0.0


def _short(exc: BaseException, limit: int = 300) -> str:
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
