"""The ``rdmakv`` command line."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rdmakv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the demo workload")
    args = parser.parse_args(argv)
    print(f"rdmakv {args.command}: not built yet", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
