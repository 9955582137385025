"""Command line: ``python -m fxrt {demo, bench, cache}``."""

from __future__ import annotations

import argparse
import datetime
import sys


def _cache(action: str, directory: str | None) -> int:
    from . import cache
    from .serialize import versions

    store = cache.DiskCache(cache.cache_dir(directory))
    entries = store.entries()
    if action == "list":
        for p in entries:
            st = p.stat()
            when = datetime.datetime.fromtimestamp(st.st_mtime).isoformat(timespec="seconds")
            print(f"{p.stem}  {st.st_size:>10} B  {when}")
        print(f"{len(entries)} entries in {store.root}")
    elif action == "info":
        total = sum(p.stat().st_size for p in entries)
        print(f"directory: {store.root}")
        print(f"entries:   {len(entries)} ({total} bytes)")
        print("versions:  " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    else:
        print(f"removed {store.clear()} entries from {store.root}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrt", description="fxrt command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile a small transformer block and compare with eager")
    sub.add_parser("bench", help="W1-W3 host-overhead benchmark", add_help=False)
    c = sub.add_parser("cache", help="inspect or empty the compile cache")
    c.add_argument("action", choices=["list", "info", "clear"])
    c.add_argument("--dir", help="cache directory (default: FXRT_CACHE_DIR or ~/.cache/fxrt)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo()
    return _cache(args.action, args.dir)


if __name__ == "__main__":
    sys.exit(main())
