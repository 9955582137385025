"""The package file: a fixed prelude, a JSON manifest and a safetensors weights section.

Layout (all integers little-endian)::

    offset  size  field
         0     8  magic b"FXRTPKG\\0"
         8     4  u32 format version (VERSION)
        12     4  u32 flags (0)
        16     8  u64 manifest offset (PRELUDE = 128)
        24     8  u64 manifest length
        32     8  u64 weights offset (a multiple of 64)
        40     8  u64 weights length
        48     8  u64 file length
        56    32  SHA-256 of bytes 0..56, the manifest, and the weights section's length and header
        88    32  SHA-256 of the weights section's data
       120     8  zero (checked)
       128        manifest (UTF-8 JSON), zero padding to the weights offset (checked)
                  weights section: a safetensors file (see :mod:`fxrt.deploy.tensorfile`)

The manifest (JSON, ``"format": "fxrt-package/1"``) holds::

    producer         fxrt / torch / python versions and fxrt's source hash (informational)
    module           the exported module's class name
    device           the device the model was exported on
    options          the compiler options given to fxrt.export (informational)
    runtime_options  the defaults for fxrt.load: pure_python, arena, arena_max_idle, check_inputs
    graph            the compiled fxrt IR, in fxrt.serialize's artifact encoding; its tensors
                     (constants fxrt made) are the weights section's "graph/<name>" entries
    program          the lowered Program as data, for the C++ runtime
                     (fxrt.deploy.program_data; null when it cannot be encoded; absent in
                     packages of fxrt versions before it)
    ops              every ATen op the graph calls: qualified name -> schema string
    signature        graph inputs (weight / tensor / constant / symint), outputs (user leaf /
                     buffer or input mutation), size-symbol ranges and Dim names, in and out
                     tree specs (fxrt.deploy.signature)
    weights          name -> {entry, dtype, shape, stride, offset, kind}: a strided view of a
                     weights-section entry (tied names share an entry)
    info             fallbacks, demotions and timings of the export (informational)

Loading is the C++ runtime's (``csrc/src``, behind :func:`fxrt.load` and the C++ API): it reads
the file as :func:`read` does here and validates everything it runs (the manifest's fields, the
op schemas, the program, the weights and the signature); where fxrt's own loops run the package's
graph instead, :mod:`fxrt.deploy.host_loop` validates the graph (through
:func:`fxrt.serialize.decode_graph`, as cache artifacts are). :func:`read` here serves
``python -m fxrt inspect`` and tests. Reading a package never runs code and never trusts a byte
before it is checked:

1. The prelude: magic, version, flags, and offsets that tile the file exactly (manifest after the
   prelude, weights after the manifest, the file as long as it says).
2. The first hash, over everything but the weight bytes: a flipped bit or a truncation anywhere
   in the structure is refused before any JSON is parsed. The second, over the weight bytes, is
   checked too unless the caller opts out (``verify_weights=False``, for large models: the check
   reads every page of the weights).
3. The manifest JSON (no duplicate keys, no NaN) and the weights header
   (:func:`fxrt.deploy.tensorfile.read_header`).

The hashes catch accidents (truncated downloads, bad disks); they are not signatures. Safety
against a hostile file comes from the validation, which runs whatever the hashes say.

Nothing here imports torch (``python -m fxrt inspect`` reads packages without it).
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO, Any

from .tensorfile import ALIGN, Entry, TensorFileError, layout, loads_json, read_header

MAGIC = b"FXRTPKG\0"
VERSION = 1
FORMAT = "fxrt-package/1"
PRELUDE = 128
MAX_MANIFEST = 1 << 30
_HEAD = struct.Struct("<8sIIQQQQQ")  # magic .. file length: 56 bytes
assert _HEAD.size == 56


class PackageError(ValueError):
    """A file that is not a valid fxrt package, or one this process cannot run (an op whose
    schema changed, an output type that is not registered)."""


@dataclass
class RawPackage:
    """A package's checked structure: the manifest JSON, the weight entries and where their data
    lies in ``buf``."""

    buf: Any  # bytes-like: the whole file (an mmap when loaded from a path)
    manifest: Any
    manifest_json: bytes  # the manifest's text as in the file (compact; decoded again on demand)
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int
    size: int
    weights_verified: bool


def write(
    f: IO[bytes],
    manifest_json: bytes,
    tensors: Iterable[tuple[str, str, tuple[int, ...], Callable[[], Any]]],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write a package to the binary file ``f`` (seekable); return its length.

    Args:
        manifest_json: the manifest, serialized.
        tensors: ``(name, dtype code, shape, data)`` per weight entry; ``data()`` returns the
            entry's bytes as a bytes-like object (called once, while writing).
        metadata: the weights header's ``__metadata__``.
    """
    tensors = list(tensors)
    data_of = {name: fn for name, _, _, fn in tensors}
    weights_offset = _round_up(PRELUDE + len(manifest_json), ALIGN)
    head, entries = layout([(n, d, s) for n, d, s, _ in tensors], weights_offset, metadata)
    data_len = entries[-1].end if entries else 0
    weights_len = len(head) + data_len
    file_len = weights_offset + weights_len
    fixed = _HEAD.pack(
        MAGIC, VERSION, 0, PRELUDE, len(manifest_json), weights_offset, weights_len, file_len
    )
    f.write(b"\0" * PRELUDE)
    f.write(manifest_json)
    f.write(b"\0" * (weights_offset - PRELUDE - len(manifest_json)))
    f.write(head)
    data_hash = hashlib.sha256()
    for e in entries:
        chunk = memoryview(data_of[e.name]()).cast("B")
        if len(chunk) != e.end - e.begin:
            raise ValueError(f"weight {e.name}: {len(chunk)} bytes, {e.end - e.begin} expected")
        data_hash.update(chunk)
        f.write(chunk)
    meta_hash = hashlib.sha256(fixed + manifest_json + head).digest()
    f.seek(0)
    f.write(fixed + meta_hash + data_hash.digest())
    return file_len


def save(path: str | os.PathLike[str], writer: Callable[[IO[bytes]], Any]) -> None:
    """Write a file atomically: to a temporary file beside ``path``, then renamed over it."""
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(prefix=".fxrt-", dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(fd, "wb") as f:
            writer(f)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def read(buf: Any, *, verify_weights: bool = True) -> RawPackage:
    """Check the structure of package bytes ``buf`` (bytes, bytearray, memoryview or mmap).

    Raises:
        PackageError: not an fxrt package, another format version, truncated, or damaged.
    """
    size = len(buf)
    if size < PRELUDE:
        raise PackageError(f"not an fxrt package: {size} bytes, shorter than the prelude")
    fixed = bytes(buf[: _HEAD.size])
    magic, version, flags, m_off, m_len, w_off, w_len, f_len = _HEAD.unpack(fixed)
    if magic != MAGIC:
        raise PackageError("not an fxrt package (bad magic)")
    if version != VERSION:
        raise PackageError(
            f"fxrt package format version {version} is not supported (this fxrt reads {VERSION})"
        )
    if flags != 0:
        raise PackageError(f"unknown package flags {flags:#x}")
    if f_len != size:
        raise PackageError(f"package is {size} bytes but says {f_len} (truncated or extended)")
    if (
        m_off != PRELUDE
        or m_len > MAX_MANIFEST
        or m_off + m_len > w_off
        or w_off % ALIGN
        or w_off + w_len != f_len
        or w_len < 8
    ):
        raise PackageError("invalid package: section offsets out of range")
    if any(buf[120:PRELUDE]) or any(buf[m_off + m_len : w_off]):
        raise PackageError("invalid package: reserved bytes are not zero")
    head_len = int.from_bytes(buf[w_off : w_off + 8], "little")
    if head_len > w_len - 8:
        raise PackageError("invalid package: weights header length out of range")
    manifest_raw = bytes(buf[m_off : m_off + m_len])
    st_head = bytes(buf[w_off : w_off + 8 + head_len])
    want_meta, want_data = bytes(buf[56:88]), bytes(buf[88:120])
    meta_hash = hashlib.sha256(fixed)
    meta_hash.update(manifest_raw)  # in parts: no copy of the manifest made for the hash
    meta_hash.update(st_head)
    if meta_hash.digest() != want_meta:
        raise PackageError("package is damaged: its structure does not match its SHA-256")
    if verify_weights:
        data_hash = hashlib.sha256()
        view = memoryview(buf)
        try:
            step = 1 << 24
            for i in range(w_off + 8 + head_len, f_len, step):
                data_hash.update(view[i : min(i + step, f_len)])
        finally:
            view.release()
        if data_hash.digest() != want_data:
            raise PackageError("package is damaged: its weights do not match their SHA-256")
    try:
        manifest = loads_json(manifest_raw, "manifest")
        entries, metadata, data_start = read_header(buf, w_off, w_len)
    except TensorFileError as e:
        raise PackageError(f"invalid package: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else None
        raise PackageError(f"not an {FORMAT} package (format {str(found)[:40]!r})")
    return RawPackage(
        buf, manifest, manifest_raw, entries, metadata, data_start, size, verify_weights
    )


def read_path(path: str | os.PathLike[str], *, verify_weights: bool = True) -> RawPackage:
    """:func:`read` on a file, memory-mapped copy-on-write (the weights stay the file's pages
    until something writes to them; writes never reach the file)."""
    import mmap

    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            raise PackageError(f"{os.fspath(path)}: empty file, not an fxrt package")
        buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    raw = read(buf, verify_weights=verify_weights)
    # The prelude, the manifest (kept as a copy of its text) and the weights header are parsed:
    # their pages leave this process. They are clean pages of a private mapping that nothing
    # writes to (tensors start at the data), so this only unmaps them; were they read again, the
    # kernel would map them from the file again. The weights' pages stay.
    head = raw.data_start // mmap.PAGESIZE * mmap.PAGESIZE
    if head and hasattr(mmap, "MADV_DONTNEED"):
        buf.madvise(mmap.MADV_DONTNEED, 0, head)
    return raw


def _round_up(n: int, k: int) -> int:
    return -(-n // k) * k


__all__ = ["FORMAT", "MAGIC", "VERSION", "PackageError", "RawPackage", "read", "read_path", "save"]
