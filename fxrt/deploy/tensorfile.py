"""The weights section of a package: a safetensors file, written and read without the
``safetensors`` package (a C++ loader needs the same few rules, so they are kept small here).

Layout (the safetensors format, https://github.com/huggingface/safetensors)::

    <8-byte little-endian n> <n bytes: JSON header, padded with spaces> <data>
    header = {"__metadata__": {str: str}, name: {"dtype": "F32", "shape": [..],
              "data_offsets": [begin, end]}, ...}

Offsets are relative to the start of the data. Writing, entries are ordered by item size
(largest first), then by name, and the header is padded so that the data starts at an
``ALIGN``-byte boundary of the file: every entry then starts at a multiple of its item size, so it
can be used in place (memory-mapped) without a copy. The data is covered exactly, without holes
or overlaps, as the spec requires.

Reading checks everything before a byte of data is used: the header length against the section,
JSON without duplicate keys, each entry's fields and types, a known dtype, ``end - begin`` equal
to ``prod(shape) * itemsize``, entries covering the data exactly once, and each entry aligned to
its item size in the file. Nothing here imports torch; :data:`DTYPES` names torch dtypes by
attribute.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

ALIGN = 64
MAX_HEADER = 100_000_000  # the safetensors limit
MAX_DIMS = 64
MAX_NAME = 4096

# safetensors dtype -> (torch dtype attribute, item size)
DTYPES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U64": ("uint64", 8),
    "U32": ("uint32", 4),
    "U16": ("uint16", 2),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "C64": ("complex64", 8),
}
BY_TORCH_NAME = {torch_name: code for code, (torch_name, _) in DTYPES.items()}


class TensorFileError(ValueError):
    """A weights section that is not a well-formed safetensors file."""


@dataclass(frozen=True)
class Entry:
    """One tensor of the section: ``begin``/``end`` are offsets in the data."""

    name: str
    dtype: str  # a key of DTYPES
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype][1]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def layout(
    entries: Iterable[tuple[str, str, tuple[int, ...]]],
    section_offset: int,
    metadata: dict[str, str] | None = None,
) -> tuple[bytes, list[Entry]]:
    """The section's first bytes (length and header) and its entries in data order, for tensors
    ``(name, dtype code, shape)`` written at file offset ``section_offset`` (a multiple of
    ``ALIGN``)."""
    items = sorted(entries, key=lambda e: (-DTYPES[e[1]][1], e[0]))
    placed, offset = [], 0
    for name, dtype, shape in items:
        n = math.prod(shape) * DTYPES[dtype][1]
        placed.append(Entry(name, dtype, tuple(shape), offset, offset + n))
        offset += n
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for e in placed:
        header[e.name] = {
            "dtype": e.dtype,
            "shape": list(e.shape),
            "data_offsets": [e.begin, e.end],
        }
    text = json.dumps(header, separators=(",", ":")).encode()
    pad = -(section_offset + 8 + len(text)) % ALIGN
    text += b" " * pad
    return len(text).to_bytes(8, "little") + text, placed


def loads_json(data: bytes, what: str) -> Any:
    """JSON from untrusted bytes: UTF-8, no duplicate keys, no NaN/Infinity, bounded nesting.

    Equal long strings that are values of objects become one string object (a manifest repeats
    each stack trace for every node of its source line: most of a transformer's graph text)."""
    strings: dict[str, str] = {}

    def no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise TensorFileError(f"duplicate key {k[:60]!r}")
            if type(v) is str and len(v) > 64:
                v = strings.setdefault(v, v)
            out[k] = v
        return out

    try:
        return json.loads(
            data.decode("utf-8"),
            object_pairs_hook=no_duplicates,
            parse_constant=_reject_constant,
        )
    except TensorFileError as e:
        raise TensorFileError(f"{what}: {e}") from None
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise TensorFileError(f"{what} is not valid JSON: {str(e)[:120]}") from None


def _reject_constant(name: str) -> Any:
    raise TensorFileError(f"{name} is not allowed")


def read_header(buf: Any, start: int, length: int) -> tuple[dict[str, Entry], dict[str, str], int]:
    """Parse and check the section at ``buf[start:start + length]``.

    Returns:
        The entries by name, the ``__metadata__`` strings, and the file offset of the data.

    Raises:
        TensorFileError: anything about the section is malformed.
    """
    if length < 8 or start + length > len(buf):
        raise TensorFileError("weights section out of range")
    n = int.from_bytes(buf[start : start + 8], "little")
    if n > length - 8 or n > MAX_HEADER:
        raise TensorFileError(f"header length {n} out of range")
    raw = bytes(buf[start + 8 : start + 8 + n])
    if not raw.startswith(b"{"):
        raise TensorFileError("header does not start with '{'")
    header = loads_json(raw, "weights header")
    if not isinstance(header, dict):
        raise TensorFileError("header is not a JSON object")
    data_start = start + 8 + n
    data_len = length - 8 - n
    meta = header.pop("__metadata__", {})
    if not isinstance(meta, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
    ):
        raise TensorFileError("__metadata__ must map strings to strings")
    entries: dict[str, Entry] = {}
    for name, d in header.items():
        entries[name] = _entry(name, d, data_len, data_start)
    cursor = 0
    for e in sorted(entries.values(), key=lambda e: (e.begin, e.end)):
        if e.begin != cursor:
            raise TensorFileError(
                f"tensor {e.name[:60]!r} starts at {e.begin}, expected {cursor} (a hole or an "
                "overlap)"
            )
        cursor = e.end
    if cursor != data_len:
        raise TensorFileError(f"tensors cover {cursor} of {data_len} data bytes")
    return entries, meta, data_start


def save_tensors(path: Any, tensors: dict[str, Any]) -> None:
    """Write torch tensors as a standalone safetensors file (the C++ runner's ``--inputs``)."""
    import torch

    flat = {n: t.detach().cpu().contiguous() for n, t in tensors.items()}
    head, entries = layout(
        [
            (n, BY_TORCH_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape))
            for n, t in flat.items()
        ],
        0,
    )
    with open(path, "wb") as f:
        f.write(head)
        for e in entries:
            t = flat[e.name]
            if t.numel():
                f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())


def load_tensors(path: Any) -> dict[str, Any]:
    """The tensors of a standalone safetensors file (copies), by name."""
    import torch

    with open(path, "rb") as f:
        buf = f.read()
    entries, _, data_start = read_header(buf, 0, len(buf))
    out = {}
    for name, e in entries.items():
        dtype = getattr(torch, DTYPES[e.dtype][0])
        raw = bytearray(buf[data_start + e.begin : data_start + e.end])
        t = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(e.shape)
    return out


def _entry(name: str, d: Any, data_len: int, data_start: int) -> Entry:
    where = f"tensor {name[:60]!r}"
    if len(name) > MAX_NAME:
        raise TensorFileError(f"{where}: name too long")
    if not isinstance(d, dict) or set(d) != {"dtype", "shape", "data_offsets"}:
        raise TensorFileError(f"{where}: malformed entry")
    dtype, shape, offsets = d["dtype"], d["shape"], d["data_offsets"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise TensorFileError(f"{where}: unknown dtype {str(dtype)[:20]!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_DIMS
        or not all(type(s) is int and 0 <= s < 2**62 for s in shape)
    ):
        raise TensorFileError(f"{where}: malformed shape")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(type(o) is int for o in offsets)
        or not 0 <= offsets[0] <= offsets[1] <= data_len
    ):
        raise TensorFileError(f"{where}: data offsets {str(offsets)[:60]} out of range")
    e = Entry(name, dtype, tuple(shape), offsets[0], offsets[1])
    if e.numel * e.itemsize != e.end - e.begin:
        raise TensorFileError(
            f"{where}: {e.end - e.begin} bytes for {dtype}{list(shape)} "
            f"({e.numel * e.itemsize} expected)"
        )
    if (data_start + e.begin) % e.itemsize:
        raise TensorFileError(f"{where}: not aligned to its item size")
    return e


__all__ = ["ALIGN", "DTYPES", "Entry", "TensorFileError", "layout", "loads_json", "read_header"]
