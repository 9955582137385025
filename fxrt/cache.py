"""The on-disk compile cache.

Keys are SHA-256 hashes of: the canonical IR text of the graph as fxrt received it (which names
every op, argument and input type), the strides and devices of the example inputs, the bytes of
every constant the graph owns, the compiler config (user passes by their source text), and the
fxrt version with a hash of fxrt's own source files, and the torch version. Never ``id()``.

Entries are artifacts (:mod:`fxrt.serialize`): data only, loaded without running code. Writes go
to a temporary file renamed into place, so readers never see half a file and two processes
writing one key both succeed. A file that does not load (truncated, corrupt, another version,
not an fxrt artifact) is reported in one warning, removed, and the graph is compiled again.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import os
import tempfile
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

SUFFIX = ".fxrt"
stats: Counter[str] = Counter()  # "hit", "miss", "stored", "rejected", "unserializable"


def default_dir() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "fxrt")


def cache_dir(configured: str | None = None) -> Path:
    return Path(configured or os.environ.get("FXRT_CACHE_DIR") or default_dir())


@functools.cache
def source_hash() -> str:
    """Fingerprint of fxrt's own sources (and the built extension): a changed fxrt never reads
    an older fxrt's entries. Names, sizes and modification times, not contents: a stat per file
    keeps a warm cache load fast, and a touched-but-unchanged file only costs a recompile."""
    h = hashlib.sha256()
    root = Path(__file__).parent
    for p in sorted(root.rglob("*")):
        if p.suffix in (".py", ".pyx", ".pxd", ".h", ".so") and "__pycache__" not in p.parts:
            st = p.stat()
            h.update(f"{p.relative_to(root)}:{st.st_size}:{st.st_mtime_ns};".encode())
    return h.hexdigest()[:16]


def _describe_input(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"T{x.dtype}{tuple(x.shape)}{x.stride()}{x.device}{x.requires_grad}"
    return f"{type(x).__name__}:{x!r}"


def _config_text(config: Any) -> str:
    parts = []
    for f in dataclasses.fields(config):
        if f.name in ("dump_dir", "cache", "cache_dir"):
            continue  # where things go, not what is compiled
        v = getattr(config, f.name)
        if callable(v):
            try:
                v = inspect.getsource(v)
            except (OSError, TypeError):
                v = f"{getattr(v, '__module__', '')}.{getattr(v, '__qualname__', repr(v))}"
        parts.append(f"{f.name}={v!r}")
    return ";".join(parts)


def cache_key(
    ir_text: str, example_inputs: Sequence[Any], constants: Sequence[Any], config: Any
) -> str:
    from .ops.kernels import registry_fingerprint
    from .ops.native_kernels import available as native_kernels_available
    from .serialize import FORMAT, versions

    h = hashlib.sha256()
    config_text = _config_text(config) + ";kernels=" + registry_fingerprint()  # register_kernel
    config_text += ";native=" + ",".join(sorted(native_kernels_available()))  # the extension's ops
    for part in (FORMAT, repr(sorted(versions().items())), ir_text, config_text):
        h.update(part.encode())
        h.update(b"\0")
    for x in example_inputs:
        h.update(_describe_input(x).encode())
    for c in constants:
        h.update(_describe_input(c).encode())
        if isinstance(c, torch.Tensor) and c.layout == torch.strided and not c.is_meta:
            t = c.detach().contiguous().cpu()
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


class DiskCache:
    def __init__(self, root: Path):
        self.root = root

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}{SUFFIX}"

    def get(self, key: str, load: Callable[[bytes], Any]) -> Any | None:
        """Load the entry for ``key`` with ``load``; None if absent or unusable (then removed)."""
        p = self.path(key)
        try:
            data = p.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as e:
            warnings.warn(f"fxrt cache: cannot read {p}: {e}; compiling again", stacklevel=3)
            return None
        try:
            return load(data)
        except Exception as e:
            stats["rejected"] += 1
            warnings.warn(
                f"fxrt cache: ignoring unusable entry {p} ({e}); removed it and compiling again",
                stacklevel=3,
            )
            with _quiet():
                p.unlink()
            return None

    def put(self, key: str, data: bytes) -> None:
        p = self.path(key)
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=".tmp-", suffix=SUFFIX)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, p)
        except BaseException:
            with _quiet():
                os.unlink(tmp)
            raise

    def entries(self) -> list[Path]:
        return sorted(self.root.rglob(f"*{SUFFIX}")) if self.root.exists() else []

    def clear(self) -> int:
        n = 0
        for p in self.entries():
            with _quiet():
                p.unlink()
                n += 1
        return n


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, typ: Any, exc: Any, tb: Any) -> bool:
        return typ is not None and issubclass(typ, OSError)
