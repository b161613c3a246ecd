"""``python -m rdmakv.fuzz``: fuzz a fresh node for a long time (see the package docstring)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rdmakv.fuzz.harness import FuzzConfig, frames_from_env, replay, run_fuzz
from rdmakv.fuzz.strategies import KNOWN_BUGS
from rdmakv.fuzz.wire import FuzzFailure


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rdmakv.fuzz", description="Protocol fuzzer against a real rdmakv node."
    )
    p.add_argument("--frames", type=int, default=None,
                   help="frames to send (default: $RDMAKV_FUZZ_FRAMES or 3000)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed of the first round")
    p.add_argument("--frames-per-example", type=int, default=FuzzConfig.frames_per_example)
    p.add_argument("--progress", type=float, default=10.0,
                   help="seconds between progress lines on stderr (0: none)")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep the node's stderr and failure transcripts here")
    p.add_argument("--known-bugs", nargs="?", const="all", default="all", metavar="NAMES",
                   help="send the inputs of these (fixed) node bugs, comma-separated; "
                   "'' for none; default all: "
                   + "; ".join(f"{k}: {v}" for k, v in KNOWN_BUGS.items()))
    p.add_argument("--replay", type=Path, default=None, metavar="FILE",
                   help="send a failure file's bytes to a fresh node and print the answers")
    p.add_argument("--pool-size", default=FuzzConfig.pool_size)
    p.add_argument("--block-size", default=FuzzConfig.block_size)
    args = p.parse_args(argv)
    if args.replay is not None:
        return replay(args.replay)
    frames = args.frames if args.frames is not None else frames_from_env()
    bugs = set(KNOWN_BUGS) if args.known_bugs == "all" else {
        b for b in args.known_bugs.split(",") if b}
    if bugs - set(KNOWN_BUGS):
        p.error(f"unknown --known-bugs {sorted(bugs - set(KNOWN_BUGS))}; known: {list(KNOWN_BUGS)}")
    if frames < 1 or args.frames_per_example < 1:
        p.error("--frames and --frames-per-example must be >= 1")
    cfg = FuzzConfig(
        frames=frames,
        frames_per_example=args.frames_per_example,
        seed=args.seed,
        known_bugs=frozenset(bugs),
        pool_size=args.pool_size,
        block_size=args.block_size,
        progress_s=args.progress,
        workdir=args.workdir,
    )
    try:
        report = run_fuzz(cfg)
    except FuzzFailure as e:
        print(f"rdmakv.fuzz: FAILED: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report.as_dict()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
