"""Write generated Mooncake-format traces, one per workload shape, for ``bench/trace.py``.

    python bench/trace_shapes.py --out build/shapes              # every shape, seed 0
    python bench/trace_shapes.py --shape agent --seed 7 --requests 2000 --out build/shapes

Writes ``<out>/<shape>_s<seed>.jsonl`` per shape and prints the paths. The
shapes and why each exists: :mod:`rdmakv.replay.shapes`; replay one with
``bench/trace.py --trace <out>/agent_s0.jsonl``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rdmakv.errors import RdmakvError
from rdmakv.replay.shapes import DEFAULT_REQUESTS, SHAPES, generate_trace, write_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--shape", choices=SHAPES, action="append",
                   help="a shape to write (repeatable; default: every shape)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS)
    p.add_argument("--out", type=Path, required=True, help="directory for the .jsonl files")
    args = p.parse_args(argv)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        for shape in args.shape or SHAPES:
            trace = generate_trace(shape, seed=args.seed, requests=args.requests)
            print(write_trace(trace, args.out / f"{shape}_s{args.seed}.jsonl"))
    except RdmakvError as e:
        print(f"bench/trace_shapes.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
