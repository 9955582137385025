"""fxrt's on-disk compile cache.

:mod:`~fxrt.cache.keys`: what a cached graph's behaviour depends on, hashed.
:mod:`~fxrt.cache.store`: entries, tensor blobs, the index and eviction; it imports no torch, so
``python -m fxrt cache list`` answers at once.
:mod:`~fxrt.cache.lookup`: the lookup, load and store around a compile. What is keyed, when a
hit happens and the format: docs/cache.md.

``fxrt.cache.stats`` counts what the cache did in this process. The other names below are the
keys' and the store's, read from their modules on first use (importing this package imports
neither).
"""

from __future__ import annotations

import importlib
from collections import Counter
from typing import Any

# What the cache did in this process: "hit", "miss", "stored", "rejected", "uncached", "compiled".
# Here, not in keys: a compiled graph counts its compiles without importing the keys.
stats: Counter[str] = Counter()

_FROM = {
    "keys": (
        "LEVELS",
        "Unkeyable",
        "cache_key",
        "config_text",
        "configure_logging",
        "graph_name",
        "open_store",
        "source_hash",
    ),
    "store": ("SUFFIX", "Store", "cache_dir", "default_dir", "total_bytes"),
}
_WHERE = {name: module for module, names in _FROM.items() for name in names}
__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module 'fxrt.cache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value
