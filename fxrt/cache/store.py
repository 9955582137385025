"""The compile cache on disk: entries, tensor blobs and an index. Imports no torch, so
``python -m fxrt cache list`` answers at once.

Layout under the cache directory::

    index.json                      one record per entry (name, ops, bytes, created, last used,
                                    versions, the entry's SHA-256, the blobs it uses)
    <k[:2]>/<k>.fxrt                the entry for key k: an artifact container without tensor bytes
    blobs/<h[:2]>/<h>               tensor bytes, named by their SHA-256 (each stored once)

Writes go to temporary files renamed into place; the index is read, changed and rewritten under
an advisory lock, so processes sharing the directory see whole files and a consistent index.
An entry is used only if the index lists it and its content hash matches the index's record.
After each store, least-recently-used entries are evicted until the directory holds at most
``max_bytes``, and blobs no entry uses any more are removed. Only files of these forms are ever
removed: a ``*.fxrt`` file of the user's own elsewhere in the directory is never touched.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # not on POSIX: the index is still replaced atomically, just not locked
    fcntl = None  # type: ignore[assignment]

SUFFIX = ".fxrt"
INDEX = "index.json"
INDEX_FORMAT = "fxrt-cache-index/1"
_KEY = re.compile(r"[0-9a-f]{64}")
log = logging.getLogger("fxrt")
_warned_dirs: set[str] = set()


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fxrt")


def cache_dir(configured: str | None = None) -> Path:
    return Path(configured or os.environ.get("FXRT_CACHE_DIR") or default_dir())


class Store:
    """One cache directory. Use :meth:`open`, which checks that the directory is usable."""

    def __init__(self, root: Path, max_bytes: int = 1 << 30):
        self.root = Path(root)
        self.max_bytes = max_bytes

    @classmethod
    def open(cls, root: Path, max_bytes: int = 1 << 30) -> Store | None:
        """The store at ``root``, or None (after one warning per directory) if it cannot be
        created or written: the caller then compiles without the cache."""
        try:
            root = Path(root)
            root.mkdir(parents=True, exist_ok=True)
            fd, probe = tempfile.mkstemp(dir=root, prefix=".tmp-probe-")
            os.close(fd)
            os.unlink(probe)
        except OSError as e:
            if str(root) not in _warned_dirs:
                _warned_dirs.add(str(root))
                warnings.warn(
                    f"fxrt cache: directory {root} is unusable ({e}); compiling without the "
                    "cache. Set FXRT_CACHE_DIR to a writable directory, or FXRT_CACHE=0.",
                    stacklevel=3,
                )
            return None
        return cls(root, max_bytes)

    # -- paths ------------------------------------------------------------------------------

    def entry_path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / sha

    # -- the index --------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        if fcntl is None:
            yield
            return
        with open(self.root / ".lock", "a+b") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def index(self) -> dict[str, dict[str, Any]]:
        """Entry records by key; empty if there is no index or it is damaged."""
        try:
            doc = json.loads((self.root / INDEX).read_text())
        except (OSError, ValueError):
            return {}
        if not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT:
            return {}
        entries = doc.get("entries")
        if not isinstance(entries, dict):
            return {}
        return {k: v for k, v in entries.items() if _KEY.fullmatch(k) and isinstance(v, dict)}

    def _write_index(self, entries: dict[str, dict[str, Any]]) -> None:
        _atomic_write(
            self.root / INDEX, json.dumps({"format": INDEX_FORMAT, "entries": entries}).encode()
        )

    # -- reading ----------------------------------------------------------------------------

    def read(self, key: str) -> tuple[bytes, dict[str, Any]] | None:
        """The entry's bytes and index record, or None when there is none (a miss)."""
        record = self.index().get(key)
        if record is None:
            return None
        try:
            return self.entry_path(key).read_bytes(), record
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"fxrt cache: cannot read {self.entry_path(key)}: {e}", stacklevel=3)
            return None

    def read_blob(self, sha: str) -> bytes:
        if not _KEY.fullmatch(sha):
            raise OSError(f"malformed blob name {sha[:70]!r}")
        return self.blob_path(sha).read_bytes()

    def touch(self, key: str) -> None:
        """Record a use of ``key`` (least-recently-used eviction reads it)."""
        with self._locked():
            entries = self.index()
            if key in entries:
                entries[key]["last_used"] = time.time()
                self._write_index(entries)

    # -- writing ----------------------------------------------------------------------------

    def write(self, key: str, data: bytes, blobs: dict[str, bytes], record: dict[str, Any]) -> None:
        """Store an entry, its blobs and its index record; then evict down to ``max_bytes``.

        All under the lock: another writer's clean-up removes every blob the index does not
        name, so blobs written before their record is in the index could go before it is."""
        now = time.time()
        record = {
            **record,
            "bytes": len(data),
            "blobs": {sha: len(b) for sha, b in blobs.items()},
            "created": now,
            "last_used": now,
        }
        with self._locked():
            for sha, payload in blobs.items():
                p = self.blob_path(sha)
                if not p.exists():
                    _atomic_write(p, payload)
            _atomic_write(self.entry_path(key), data)
            entries = self.index()
            entries[key] = record
            evicted = self._evict(entries, keep=key)
            self._write_index(entries)
            self._remove_unused_blobs(entries)
        for k, r in evicted:
            log.info("fxrt cache: evicted %s (%s, %d bytes)", k[:16], r.get("name", "?"), _size(r))

    def _evict(self, entries: dict[str, dict[str, Any]], keep: str) -> list[tuple[str, Any]]:
        evicted = []
        by_age = sorted((r.get("last_used", 0), k) for k, r in entries.items() if k != keep)
        while total_bytes(entries) > self.max_bytes and by_age:
            _, k = by_age.pop(0)
            evicted.append((k, entries.pop(k)))
            with contextlib.suppress(OSError):
                self.entry_path(k).unlink()
        return evicted

    def _remove_unused_blobs(self, entries: dict[str, dict[str, Any]]) -> None:
        used = {sha for r in entries.values() for sha in _blobs(r)}
        for p in self.blob_files():
            if p.name not in used:
                with contextlib.suppress(OSError):
                    p.unlink()

    def remove(self, key: str) -> None:
        """Drop one entry (a corrupt one) and the blobs only it used."""
        with self._locked():
            entries = self.index()
            entries.pop(key, None)
            with contextlib.suppress(OSError):
                self.entry_path(key).unlink()
            self._write_index(entries)
            self._remove_unused_blobs(entries)

    def clear(self) -> int:
        """Remove every entry, blob and index file of fxrt's; return the number of entries."""
        with self._locked():
            n = 0
            for p in self.entry_files():
                with contextlib.suppress(OSError):
                    p.unlink()
                    n += 1
            for p in self.blob_files():
                with contextlib.suppress(OSError):
                    p.unlink()
            with contextlib.suppress(OSError):
                (self.root / INDEX).unlink()
            for d in [*self.root.glob("blobs/??"), self.root / "blobs", *self.root.glob("??")]:
                with contextlib.suppress(OSError):
                    d.rmdir()  # only if empty
        return n

    def entry_files(self) -> list[Path]:
        return [
            p
            for p in self.root.glob(f"??/*{SUFFIX}")
            if _KEY.fullmatch(p.stem) and p.parent.name == p.stem[:2]
        ]

    def blob_files(self) -> list[Path]:
        return [
            p
            for p in self.root.glob("blobs/??/*")
            if _KEY.fullmatch(p.name) and p.parent.name == p.name[:2]
        ]


def _blobs(record: dict[str, Any]) -> dict[str, int]:
    b = record.get("blobs")
    return b if isinstance(b, dict) else {}


def _size(record: dict[str, Any]) -> int:
    n = record.get("bytes", 0)
    return n if isinstance(n, int) else 0


def total_bytes(entries: dict[str, dict[str, Any]]) -> int:
    """Bytes the entries take, each blob counted once."""
    blobs: dict[str, int] = {}
    for r in entries.values():
        blobs.update(_blobs(r))
    return sum(_size(r) for r in entries.values()) + sum(
        v for v in blobs.values() if isinstance(v, int)
    )


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
