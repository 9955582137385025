"""Command line: ``python -m fxrt {demo, bench, cache, inspect}``."""

from __future__ import annotations

import argparse
import datetime
import sys


def _cache(action: str, directory: str | None) -> int:
    # The index answers; torch is not imported (this takes well under a second).
    from .cache.store import Store, cache_dir, total_bytes

    store = Store(cache_dir(directory))
    entries = store.index() if store.root.is_dir() else {}
    if action == "list":
        # level: "dynamo" = keyed on Dynamo's graph, before fxrt's ATen trace (a hit skips it);
        # "aten" = keyed on the ATen graph handed over (AOTAutograd's, compile_graph's).
        print(
            f"{'key':16}  {'level':6}  {'graph':40}  {'ops':>5}  {'bytes':>10}  {'created':19}  "
            f"{'last used':19}  versions"
        )
        for key, r in sorted(entries.items(), key=lambda kv: -_num(kv[1].get("last_used"))):
            v = r.get("versions") if isinstance(r.get("versions"), dict) else {}
            level = str(r.get("level", "aten"))[:6]
            print(
                f"{key[:16]}  {level:6}  {str(r.get('name', '?'))[:40]:40}  "
                f"{_num(r.get('ops')):>5}  "
                f"{_num(r.get('bytes')):>10}  {_when(r.get('created'))}  "
                f"{_when(r.get('last_used'))}  "
                f"torch {v.get('torch', '?')}, fxrt {v.get('fxrt', '?')}"
            )
        print(f"{len(entries)} entries, {total_bytes(entries)} bytes in {store.root}")
    elif action == "info":
        print(f"directory: {store.root}")
        print(f"entries:   {len(entries)} ({total_bytes(entries)} bytes)")
    else:
        n = store.clear() if store.root.is_dir() else 0
        print(f"removed {n} entries from {store.root}")
    return 0


def _num(x: object) -> int:
    return int(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else 0


def _when(t: object) -> str:
    if not isinstance(t, (int, float)):
        return "?".ljust(19)
    return datetime.datetime.fromtimestamp(t).isoformat(timespec="seconds")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrt", description="fxrt command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile a small transformer block and compare with eager")
    sub.add_parser(
        "bench",
        help="W1-W3 host-overhead benchmark; writes ./bench-results/ (bench --help)",
        add_help=False,
    )
    c = sub.add_parser("cache", help="inspect or empty the compile cache")
    c.add_argument("action", choices=["list", "info", "clear"])
    c.add_argument("--dir", help="cache directory (default: FXRT_CACHE_DIR or ~/.cache/fxrt)")
    i = sub.add_parser("inspect", help="describe an fxrt.export package (model.fxrt)")
    i.add_argument("path")
    i.add_argument("--verify", action="store_true", help="also check the weight bytes' SHA-256")
    i.add_argument("--load", action="store_true", help="also load it here (imports torch)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:
        from .bench import main as bench

        return bench(argv[1:])
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo()
    if args.command == "inspect":
        from .deploy.inspect import main as inspect

        return inspect(args.path, verify=args.verify, load=args.load)
    return _cache(args.action, args.dir)


if __name__ == "__main__":
    sys.exit(main())
