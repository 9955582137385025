"""Command line: ``python -m fxrt demo``."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxrt", description="fxrt command line")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile a small transformer block and compare with eager")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import main as demo

        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
