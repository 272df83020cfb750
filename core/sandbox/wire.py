"""How batches and results cross between the host and a program worker.

Two shared-memory arenas per worker, each a sealed ``memfd`` (it can neither shrink
nor grow, so a worker cannot make the host fault on a truncated mapping):

- the *input* arena: the host writes the arguments of a call; the worker holds it
  through a read-only descriptor (mode 0600, owned by the host's user, so it cannot be
  reopened for writing) and gives the program private copies;
- the *output* arena: the worker writes the named result tensors; the host copies them
  out with bound checks before looking at a value.

Requests (host to worker) are pickles: the worker trusts its host. Replies (worker to
host) are JSON and raw tensor bytes, decoded by :func:`decode_reply` and
:func:`unpack_named`; nothing a worker sends is ever unpickled. Decoding a reply is total:
whatever the bytes, it returns checked values or raises :class:`MalformedReply` (a
``ValueError``), never another exception.
"""

from __future__ import annotations

import fcntl
import json
import math
import mmap
import os
from typing import Any

import numpy as np
import torch

ALIGN = 64
#: dtypes that cross (numpy names); anything else is converted to float32 or refused
DTYPES = {
    name: np.dtype(name)
    for name in ("float32", "float64", "float16", "int64", "int32", "int16", "int8", "uint8", "bool")
}
_NAMES = {dtype: name for name, dtype in DTYPES.items()}
MAX_NAMED = 64  # tensors in one reply
MAX_DIMS = 8
MIN_ARENA = 1 << 20


class Arena:
    """A shared-memory segment of fixed size, mapped read-write in this process."""

    def __init__(self, size: int) -> None:
        self.size = int(size)
        self.fd = os.memfd_create("llm4rl-sandbox", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
            os.fchmod(self.fd, 0o600)
            self.map = mmap.mmap(self.fd, self.size)
        except BaseException:
            os.close(self.fd)
            raise

    def read_only_fd(self) -> int:
        """A new descriptor that can only read the segment (the worker's view of inputs)."""
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def close(self) -> None:
        try:
            self.map.close()
        except BufferError:  # a view is still alive; the mapping goes with the process
            pass
        os.close(self.fd)


def arena_size(nbytes: int) -> int:
    """A power of two at least ``nbytes`` and :data:`MIN_ARENA`."""
    return max(MIN_ARENA, 1 << max(0, math.ceil(math.log2(max(1, nbytes)))))


# -- host to worker: a tree of tensors ------------------------------------------------------


def as_array(value: torch.Tensor | np.ndarray) -> tuple[np.ndarray, str]:
    """``value`` as a numpy array of a dtype that crosses, with the dtype's name.

    :raises TypeError: for complex, object and other dtypes that do not cross.
    """
    if isinstance(value, torch.Tensor):
        try:  # the common case: a plain CPU tensor (raises for grad, other devices, bfloat16)
            arr = value.numpy()
            name = _NAMES.get(arr.dtype)
            if name is not None:
                return arr, name
        except (RuntimeError, TypeError):
            pass
        if value.layout != torch.strided:
            raise TypeError(f"{value.layout} tensors cannot cross (use a dense tensor)")
        if value.requires_grad:
            value = value.detach()
        if value.device.type != "cpu":
            try:
                value = value.cpu()
            except Exception as e:  # e.g. a meta tensor has no data
                raise TypeError(f"a tensor on {value.device} cannot cross: {e}") from None
        if value.dtype == torch.bfloat16:
            value = value.float()
        if value.is_complex():
            raise TypeError(f"complex values ({value.dtype}) cannot cross")
        value = value.resolve_neg().numpy()
    name = _NAMES.get(value.dtype)
    if name is None:
        if value.dtype.kind != "f":
            raise TypeError(f"values of dtype {value.dtype} cannot cross")
        value, name = value.astype(np.float32), "float32"
    return value, name


def tree_nbytes(tree: Any) -> int:
    """Bytes :func:`pack_tree` needs for ``tree`` (with alignment)."""
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        n = tree.numel() * tree.element_size() if isinstance(tree, torch.Tensor) else tree.nbytes
        return n + ALIGN
    if isinstance(tree, dict):
        return sum(tree_nbytes(v) for v in tree.values())
    if isinstance(tree, (tuple, list)):
        return sum(tree_nbytes(v) for v in tree)
    return 0


class TooBig(Exception):
    """The values do not fit the arena (the host grows it and tries again)."""


def _write(buf: mmap.mmap, offset: int, arr: np.ndarray) -> None:
    end = offset + arr.nbytes
    if end > len(buf):
        raise TooBig
    if arr.nbytes <= 1 << 16 and arr.flags.c_contiguous:
        buf[offset:end] = arr.tobytes()  # small: one bytes object is the cheapest copy
    else:
        np.ndarray(arr.shape, arr.dtype, buffer=buf, offset=offset)[...] = arr


def pack_tree(tree: Any, buf: mmap.mmap, offset: int = 0) -> tuple[Any, int]:
    """Write the tensors of ``tree`` into ``buf`` from ``offset``; ``(spec, end offset)``.

    ``tree`` is tensors/arrays, dicts with string keys, tuples, lists and plain scalars;
    the spec says how to rebuild it (:func:`unpack_tree`).

    :raises TooBig: when the tensors do not fit.
    """
    if isinstance(tree, (torch.Tensor, np.ndarray)):
        arr, name = as_array(tree)
        offset = -(-offset // ALIGN) * ALIGN
        _write(buf, offset, arr)
        return ("a", name, arr.shape, offset), offset + arr.nbytes
    if type(tree) is tuple and all(type(t) is torch.Tensor for t in tree):  # the common case, flat
        specs = []
        for t in tree:
            arr, name = as_array(t)
            offset = -(-offset // ALIGN) * ALIGN
            _write(buf, offset, arr)
            specs.append(("a", name, arr.shape, offset))
            offset += arr.nbytes
        return ("t", specs), offset
    if isinstance(tree, dict):
        items = []
        for key, value in tree.items():
            spec, offset = pack_tree(value, buf, offset)
            items.append((str(key), spec))
        return ("d", items), offset
    if isinstance(tree, (tuple, list)):
        items = []
        for value in tree:
            spec, offset = pack_tree(value, buf, offset)
            items.append(spec)
        return ("t" if isinstance(tree, tuple) else "l", items), offset
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return ("s", tree), offset
    raise TypeError(f"{type(tree).__name__} cannot be passed to programs")


def private_copy(buf: mmap.mmap, end: int) -> bytearray:
    """The first ``end`` bytes of an arena as memory of this process alone (one copy)."""
    with memoryview(buf) as view:
        return bytearray(view[:end])


def unpack_tree(spec: Any, buf: Any, *, arrays: bool = False) -> Any:
    """Rebuild a tree written by :func:`pack_tree` on ``buf`` (the worker's private copy).

    Tensors come back as torch tensors sharing ``buf`` (numpy arrays with ``arrays``).
    """
    tag = spec[0]
    if tag == "a":
        _, dtype, shape, offset = spec
        arr = np.frombuffer(buf, DTYPES[dtype], math.prod(shape), offset).reshape(shape)
        return arr if arrays else torch.from_numpy(arr)
    if tag == "d":
        return {key: unpack_tree(value, buf, arrays=arrays) for key, value in spec[1]}
    if tag in ("t", "l"):
        items = [unpack_tree(value, buf, arrays=arrays) for value in spec[1]]
        return tuple(items) if tag == "t" else items
    return spec[1]


def flat_plan(spec: Any) -> list[tuple[np.dtype, int, int, tuple[int, ...]]] | bool:
    """For a flat tuple of arrays (the usual call), where each one lies; False for any other tree."""
    if spec[0] != "t" or not all(item[0] == "a" for item in spec[1]):
        return False
    return [(DTYPES[dtype], math.prod(shape), offset, tuple(shape)) for _, dtype, shape, offset in spec[1]]


def read_plan(plan: list[tuple[np.dtype, int, int, tuple[int, ...]]], buf: Any) -> tuple[np.ndarray, ...]:
    """The arrays of a flat plan, as views of ``buf``."""
    return tuple(np.frombuffer(buf, dtype, count, offset).reshape(shape) for dtype, count, offset, shape in plan)


def as_tensors(tree: Any) -> Any:
    """Numpy arrays in ``tree`` as torch tensors (sharing memory)."""
    if isinstance(tree, np.ndarray):
        return torch.from_numpy(tree)
    if isinstance(tree, dict):
        return {key: as_tensors(value) for key, value in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(as_tensors(value) for value in tree)
    return tree


# -- worker to host: replies and named tensors, checked --------------------------------------


class MalformedReply(ValueError):
    """A worker's reply that is not what the protocol allows (the worker is not trusted)."""


def decode_reply(data: bytes) -> dict[str, Any]:
    """A JSON reply from a worker as a dict; :class:`MalformedReply` for anything else.

    Bytes that are not UTF-8 or not JSON, nesting deeper than the decoder's recursion
    limit, integers longer than Python converts, and any value but an object are all
    refused the same way.
    """
    try:
        value = json.loads(data)
    except RecursionError:
        raise MalformedReply("nested too deeply") from None
    except (ValueError, TypeError, OverflowError, MemoryError) as e:  # not UTF-8, not JSON, an integer too long
        raise MalformedReply(f"not JSON: {str(e)[:80]}") from None
    if not isinstance(value, dict):
        raise MalformedReply(f"a JSON {type(value).__name__}, not an object")
    return value


def reply_seconds(value: Any) -> float:
    """A reply's ``program_s``: a real number as a float (NaN and inf pass: the caller
    falls back to its own clock); :class:`MalformedReply` for any other value."""
    if type(value) not in (int, float):  # not bool, not a string or a list
        raise MalformedReply(f"program_s is a {type(value).__name__}, not a number")
    try:
        return float(value)
    except OverflowError:
        raise MalformedReply("program_s is out of range") from None


def pack_named(named: list[tuple[str, torch.Tensor]], buf: mmap.mmap) -> list[list[Any]]:
    """Write named tensors into the output arena (in the worker); the header to send."""
    header, offset = [], 0
    for name, tensor in named:
        arr, dtype = as_array(tensor)
        offset = -(-offset // ALIGN) * ALIGN
        try:
            _write(buf, offset, arr)
        except TooBig:
            raise ValueError(f"the result is larger than {len(buf)} bytes") from None
        header.append([name, dtype, list(arr.shape), offset])
        offset += arr.nbytes
    return header


def check_header(header: Any, size: int) -> list[tuple[str, np.dtype, int, int, tuple[int, ...]]]:
    """A result header from a worker, every field checked: ``[(name, dtype, count, offset, shape)]``.

    :raises MalformedReply: (a ``ValueError``) on anything malformed: the worker is not trusted.
    """
    if not isinstance(header, list) or len(header) > MAX_NAMED:
        raise MalformedReply("malformed result header")
    layout = []
    for item in header:
        if not (isinstance(item, list) and len(item) == 4):
            raise MalformedReply("malformed result entry")
        name, dtype, shape, offset = item
        if not isinstance(name, str) or len(name) > 100 or not isinstance(dtype, str) or dtype not in DTYPES:
            raise MalformedReply("malformed result name or dtype")
        # each dimension at most the arena's size: an empty result cannot name a shape numpy refuses
        if not (
            isinstance(shape, list) and len(shape) <= MAX_DIMS and all(type(d) is int and 0 <= d <= size for d in shape)
        ):
            raise MalformedReply("malformed result shape")
        if type(offset) is not int or offset < 0 or offset % ALIGN:
            raise MalformedReply("malformed result offset")
        count = math.prod(shape)
        if offset + count * DTYPES[dtype].itemsize > size:
            raise MalformedReply("result outside the shared memory")
        layout.append((name, DTYPES[dtype], count, offset, tuple(shape)))
    return layout


def read_named(
    layout: list[tuple[str, np.dtype, int, int, tuple[int, ...]]], buf: mmap.mmap
) -> list[tuple[str, np.ndarray]]:
    """Copies of the named arrays a checked layout describes (in the host)."""
    return [
        (name, np.frombuffer(buf, dtype, count, offset).reshape(shape).copy())
        for name, dtype, count, offset, shape in layout
    ]


def unpack_named(header: Any, buf: mmap.mmap) -> list[tuple[str, np.ndarray]]:
    """Copy named arrays out of the output arena (in the host), checking every field first."""
    return read_named(check_header(header, len(buf)), buf)
