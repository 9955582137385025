"""``python -m fxrt inspect model.fxrt``: what a package holds, read from its manifest.

Reads the prelude, checks the structure's hash and parses the manifest and weights header (the
weight bytes are not hashed, for speed: ``--verify`` does, and ``--load`` loads the package as
``fxrt.load`` does, which also checks every op's schema against this torch). Prints the signature
(inputs with their paths, dtypes, shapes and size ranges; outputs), the ops and how often the graph
calls each, the fallbacks and demotions recorded at export, whether the C++ runtime can run it,
the weights (tensors, entries, bytes, tied names) and the versions that made it. Without
``--load`` it imports no torch.
"""

from __future__ import annotations

import os
from collections import Counter
from typing import Any

from .package import PackageError, read_path
from .program_data import cpp_runnable


def describe(path: str, *, verify: bool = False) -> str:
    """The text ``python -m fxrt inspect`` prints.

    Raises:
        PackageError: not a valid package (or damaged).
        OSError: the file cannot be read.
    """
    raw = read_path(path, verify_weights=verify)
    m = raw.manifest
    try:
        return "\n".join(_lines(path, raw, m))
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise PackageError(
            f"invalid fxrt package: malformed manifest ({type(e).__name__})"
        ) from None


def _lines(path: str, raw: Any, m: dict[str, Any]) -> list[str]:
    prod = m["producer"]
    sig = m["signature"]
    ranges = sig["ranges"]
    lines = [
        f"{path}: fxrt package ({m['format']}), {raw.size:,} bytes"
        + (", weights verified" if raw.weights_verified else ""),
        f"module:  {m['module']} (exported on {m['device']})",
        f"made by: fxrt {prod['fxrt']}, torch {prod['torch']}, python {prod.get('python', '?')}",
        "",
        "inputs:",
    ]
    for s in sig["inputs"]:
        if s["kind"] == "weight":
            continue
        if s["kind"] == "tensor":
            dims = ", ".join(str(d) for d in s["shape"])
            dev = "" if s["device"] == "cpu" else f"@{s['device']}"
            lines.append(f"  {s['path']:<28} {s['name']:<20} {s['dtype']}[{dims}]{dev}")
        elif s["kind"] == "constant":
            lines.append(f"  {s['path']:<28} {s['name']:<20} constant {s['value']!r}")
        else:
            lines.append(f"  {s['path']:<28} {s['name']:<20} int {s['shape'][0]}")
    lines.append("outputs:")
    for o in sig["outputs"]:
        if o["kind"] == "user":
            dims = ", ".join(str(d) for d in o["shape"])
            lines.append(f"  {o['path']:<28} {o['dtype']}[{dims}]")
        else:
            what = "buffer" if o["kind"] == "buffer_mutation" else "input"
            lines.append(f"  (mutates {what} {o['target']})")
    if ranges:
        lines.append(
            "ranges:  "
            + ", ".join(
                f"{_sym(sig, k)} in [{lo}, {'inf' if hi is None else hi}]"
                for k, (lo, hi) in ranges.items()
            )
        )
    nodes = m["graph"]["nodes"]
    counts = Counter(
        n["op"].get("aten") or n["op"].get("python") or "?" for n in nodes if isinstance(n, dict)
    )
    lines += ["", f"ops: {len(counts)} distinct, {len(nodes)} nodes"]
    for name, n in counts.most_common():
        lines.append(f"  {n:>5}  {name}")
    info = m["info"]
    fallbacks = info.get("fallbacks") or []
    lines.append("fallbacks: " + (", ".join(map(str, fallbacks)) if fallbacks else "none"))
    for d in info.get("demotions") or []:
        lines.append(f"  demoted: {d}")
    why = cpp_runnable(m.get("program"))
    lines.append("C++ runtime: " + ("yes" if why is None else f"no ({why})"))
    weights = m["weights"]
    nbytes = sum(
        e.end - e.begin for name, e in raw.entries.items() if not name.startswith("graph/")
    )
    graph_bytes = sum(
        e.end - e.begin for name, e in raw.entries.items() if name.startswith("graph/")
    )
    by_entry: dict[str, list[str]] = {}
    for name, r in weights.items():
        by_entry.setdefault(r["entry"], []).append(name)
    tied = [names for names in by_entry.values() if len(names) > 1]
    kinds = Counter(r["kind"] for r in weights.values())
    lines += [
        "",
        f"weights: {len(weights)} tensors ("
        + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        + f") in {len(by_entry)} entries, {_size(nbytes)}"
        + (f"; graph constants {_size(graph_bytes)}" if graph_bytes else ""),
    ]
    for names in tied:
        lines.append("  tied: " + " = ".join(names))
    opts = m["options"]
    if opts:
        lines.append("options: " + ", ".join(f"{k}={v}" for k, v in opts.items()))
    secs = info.get("seconds") or {}
    if secs:
        lines.append(
            "export:  "
            + ", ".join(f"{k} {v:.2f} s" for k, v in secs.items() if isinstance(v, float))
            + f" (executor {info.get('executor', '?')})"
        )
    return lines


def _sym(sig: dict[str, Any], k: str) -> str:
    name = (sig.get("dims") or {}).get(k)
    return f"{name} ({k})" if isinstance(name, str) else k


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def main(path: str, *, verify: bool = False, load: bool = False) -> int:
    try:
        print(describe(path, verify=verify))
    except (PackageError, OSError) as e:
        print(f"fxrt inspect: {os.fspath(path)}: {e}")
        return 1
    if load:
        from .loaded import load as load_package

        try:
            m = load_package(path)
        except (PackageError, ValueError) as e:
            print(f"\nload: FAILED: {e}")
            return 1
        fb = ", ".join(m.program.fallbacks) or "none"
        print(
            f"\nload: ok in this process (torch and ops match; executor {m.executor}; "
            f"fallbacks: {fb})"
        )
    return 0


__all__ = ["describe", "main"]
