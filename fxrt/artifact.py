"""The artifact container and its tensors, as bytes: no pickle, no ``torch.load``.

Layout::

    b"fxrt-artifact\\n"  <64 hex digits: SHA-256 of the body>  b"\\n"  <body>
    body = <8-byte little-endian length n> <n bytes of JSON> <tensor data section>

The hash is checked before anything is parsed, so a truncated or bit-flipped file is refused as a
whole. Each tensor is described in the document by a :class:`TensorRecord` (dtype, sizes, strides,
device, byte count, SHA-256 of its bytes, offset in the data section) and stored as the raw bytes
of the storage it spans, from its first element to its last; a tensor is rebuilt as a view with
its strides of a copy of those bytes, and the byte count must be exactly that span, so a record
can never describe memory it does not own (any strides round-trip: permuted, expanded, gapped).
The on-disk cache keeps tensor bytes outside the entry, one file per SHA-256 (each stored once).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

MAGIC = b"fxrt-artifact\n"
_HASH_LEN = 64
_MAX_DIMS = 64


class ArtifactError(ValueError):
    """Bytes that are not a well-formed fxrt artifact (or tensor)."""


@dataclass(frozen=True)
class TensorRecord:
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    device: str
    requires_grad: bool
    nbytes: int
    sha256: str
    offset: int = -1  # in the data section of a self-contained artifact; -1 when stored apart
    payload: bytes | None = None  # the bytes, while writing

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "stride": list(self.stride),
            "device": self.device,
            "requires_grad": self.requires_grad,
            "nbytes": self.nbytes,
            "sha256": self.sha256,
            "offset": self.offset,
        }

    @staticmethod
    def from_json(d: Any, where: str) -> TensorRecord:
        fields = {
            "dtype",
            "shape",
            "stride",
            "device",
            "requires_grad",
            "nbytes",
            "sha256",
            "offset",
        }
        if not isinstance(d, dict) or set(d) != fields:
            raise ArtifactError(f"{where}: malformed tensor record")
        ints = [*d["shape"], *d["stride"], d["nbytes"], d["offset"]] if _lists(d) else [None]
        if not all(type(i) is int and -1 <= i < 2**62 for i in ints):
            raise ArtifactError(f"{where}: sizes, strides and offsets must be integers")
        if not isinstance(d["sha256"], str) or len(d["sha256"]) != _HASH_LEN:
            raise ArtifactError(f"{where}: malformed hash")
        if not isinstance(d["dtype"], str) or not isinstance(d["device"], str):
            raise ArtifactError(f"{where}: malformed dtype or device")
        if type(d["requires_grad"]) is not bool:
            raise ArtifactError(f"{where}: requires_grad must be a bool")
        return TensorRecord(
            d["dtype"],
            tuple(d["shape"]),
            tuple(d["stride"]),
            d["device"],
            d["requires_grad"],
            d["nbytes"],
            d["sha256"],
            d["offset"],
        )


def _lists(d: dict[str, Any]) -> bool:
    return (
        isinstance(d["shape"], list)
        and isinstance(d["stride"], list)
        and len(d["shape"]) == len(d["stride"])
        and len(d["shape"]) <= _MAX_DIMS
    )


def extent(shape: Sequence[int], stride: Sequence[int]) -> int:
    """How many elements of storage a tensor of ``shape`` and ``stride`` spans, from its first
    element to its last (0 for no elements)."""
    if any(s == 0 for s in shape):
        return 0
    return 1 + sum((size - 1) * st for size, st in zip(shape, stride))


def encode_tensor(t: torch.Tensor) -> TensorRecord:
    """The record and bytes of a strided tensor of a standard dtype: the bytes of the storage it
    spans, from its first element to its last, so any strides round-trip exactly (a dense
    permuted tensor, an expanded one with stride 0, one with gaps).

    Raises:
        ArtifactError: a layout or dtype the format does not hold (sparse, quantized, a fake or
            meta tensor).
    """
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized or t.device.type == "meta":
        raise ArtifactError(f"a {t.layout} tensor on {t.device} is not stored")
    if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
        raise ArtifactError(f"a tensor subclass ({type(t).__name__}) is not stored")
    t = t.resolve_conj().resolve_neg()
    shape, stride = tuple(t.shape), tuple(t.stride())
    span = extent(shape, stride)
    if span:
        flat = t.as_strided((span,), (1,)).cpu()  # from the tensor's own storage offset
        payload = flat.view(torch.uint8).numpy().tobytes()
    else:
        payload = b""
    return TensorRecord(
        str(t.dtype),
        shape,
        stride,
        str(t.device),
        bool(t.requires_grad),
        len(payload),
        hashlib.sha256(payload).hexdigest(),
        payload=payload,
    )


_DTYPES = {str(d): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def decode_tensor(r: TensorRecord, payload: bytes) -> torch.Tensor:
    """Rebuild a tensor from its record and bytes, checking each against the other.

    Raises:
        ArtifactError: the bytes do not match the record, or the record is inconsistent.
    """
    dtype = _DTYPES.get(r.dtype)
    if dtype is None:
        raise ArtifactError(f"unknown dtype {r.dtype[:30]!r}")
    if len(r.shape) != len(r.stride) or any(s < 0 for s in (*r.shape, *r.stride)):
        raise ArtifactError(f"strides {r.stride} do not fit sizes {r.shape}")
    itemsize = dtype.itemsize
    if extent(r.shape, r.stride) * itemsize != r.nbytes or len(payload) != r.nbytes:
        raise ArtifactError(
            f"{len(payload)} bytes for a {r.dtype} tensor of sizes {r.shape} ({r.nbytes} recorded)"
        )
    if hashlib.sha256(payload).hexdigest() != r.sha256:
        raise ArtifactError("tensor bytes do not match their hash")
    try:
        device = torch.device(r.device)
    except RuntimeError:
        raise ArtifactError(f"{r.device[:30]!r} is not a device") from None
    if r.nbytes:
        # The bytes are the storage the tensor spans: the tensor is a view of their copy,
        # made without running a copy kernel (whose code a fresh process would page in).
        out = torch.frombuffer(bytearray(payload), dtype=dtype).as_strided(r.shape, r.stride)
    else:
        out = torch.empty_strided(r.shape, r.stride, dtype=dtype)
    if device.type != "cpu":
        try:
            out = out.to(device)
        except (RuntimeError, AssertionError) as e:
            raise ArtifactError(f"cannot place a tensor on {device}: {e}") from None
    return out.requires_grad_(r.requires_grad) if r.requires_grad else out


class Section:
    """The data section of a self-contained artifact."""

    def __init__(self, data: memoryview):
        self.data = data

    def read(self, r: TensorRecord) -> bytes:
        if r.offset < 0 or r.offset + r.nbytes > len(self.data):
            raise ArtifactError("tensor bytes lie outside the artifact")
        return bytes(self.data[r.offset : r.offset + r.nbytes])


def pack(doc: dict[str, Any], tensors: dict[str, TensorRecord], *, inline: bool = True) -> bytes:
    """Container bytes for ``doc``; with ``inline``, the tensors' bytes follow the document."""
    records, parts, offset = {}, [], 0
    for name, r in tensors.items():
        if inline:
            records[name] = replace(r, offset=offset).to_json()
            parts.append(r.payload or b"")
            offset += r.nbytes
        else:
            records[name] = r.to_json()
    js = json.dumps({**doc, "tensors": records}, separators=(",", ":")).encode()
    body = len(js).to_bytes(8, "little") + js + b"".join(parts)
    return MAGIC + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def unpack(data: bytes) -> tuple[Any, Section]:
    """The document and data section of container bytes, after checking their hash.

    Raises:
        ArtifactError: not an fxrt artifact, or damaged.
    """
    head = len(MAGIC) + _HASH_LEN + 1
    if len(data) < head + 8 or not data.startswith(MAGIC):
        raise ArtifactError("not an fxrt artifact")
    body = memoryview(data)[head:]
    if hashlib.sha256(body).hexdigest().encode() != data[len(MAGIC) : head - 1]:
        raise ArtifactError("content does not match its SHA-256 (truncated or modified)")
    n = int.from_bytes(body[:8], "little")
    if n > len(body) - 8:
        raise ArtifactError("document length out of range")
    try:
        doc = json.loads(bytes(body[8 : 8 + n]))
    except (ValueError, RecursionError) as e:
        raise ArtifactError(f"document is not JSON: {e}") from None
    return doc, Section(body[8 + n :])


def content_hash(data: bytes) -> str:
    """The SHA-256 a container carries for its body (its identity in the cache index)."""
    return data[len(MAGIC) : len(MAGIC) + _HASH_LEN].decode("ascii", "replace")
