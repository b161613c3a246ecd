"""A good client's success rate and latency while slow and idle connections flood a node.

Starts a real ``rdmakv serve`` (token required, default connection limits),
then runs phases; in each, attacker processes keep their connections open
(re-opening any the node closes) while a good client does rounds of: connect,
HELLO with the token, put 4 blocks, get them back, verify every byte, close.

* ``baseline``: no attackers;
* ``slow``: ``--slow`` connections that never finish HELLO, each sending one
  byte every ``--drip-s`` seconds (slowloris);
* ``idle``: ``--idle`` connections that finish HELLO and then say nothing;
* ``slow+idle``: both at once.

Prints one JSON object ``{"phases": {name: {"rounds", "ok", "success_rate",
"p50_ms", "p99_ms", "attackers_open"}}, "node": {refused counters},
"meta": {...}}`` and writes ``bench/results/flood.json`` (``--out``).
Latency is the whole round (connect to verified get) in ms.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmakvError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.perf.provenance import provenance
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import Op, encode_hello

BLOCK = 16 * 1024
BLOCKS_PER_ROUND = 4
DIGEST = b"f" * 16
TOKEN = b"flood-bench-token"
ATTACKER_SETTLE_S = 3.0
"""Time for attackers to open their connections before a phase is measured."""


def attacker(kind: str, count: int, host: str, port: int, drip_s: float) -> None:
    """Keep ``count`` connections of ``kind`` open until killed; re-open closed ones."""
    conns: list[socket.socket | None] = [None] * count
    last_drip = 0.0
    while True:
        for i, s in enumerate(conns):
            if s is not None:
                continue
            try:
                s = socket.create_connection((host, port), timeout=5)
                if kind == "idle":
                    Channel(s).call(Op.HELLO, encode_hello(TOKEN), "HELLO")
                else:
                    s.send(b"\x01")
                s.setblocking(False)
                conns[i] = s
            except (OSError, RdmakvError):
                if s is not None:
                    s.close()
        now = time.monotonic()
        for i, s in enumerate(conns):
            if s is None:
                continue
            try:  # noticing closes: a read of b"" (or an error) means the node closed it
                if s.recv(1) == b"":
                    raise ConnectionResetError
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                conns[i] = None
                continue
            if kind == "slow" and now - last_drip >= drip_s:
                try:
                    s.send(b"\x01")
                except OSError:
                    s.close()
                    conns[i] = None
        if kind == "slow" and now - last_drip >= drip_s:
            last_drip = now
        time.sleep(0.05)


def good_round(
    host: str, port: int, slab: Slab, handles: list[int], tag: bytes, errors: list[str]
) -> bool:
    src, dst = handles[:BLOCKS_PER_ROUND], handles[BLOCKS_PER_ROUND:]
    keys = [b"good-%s-%d" % (tag, i) for i in range(BLOCKS_PER_ROUND)]  # new keys every round
    for h in dst:
        slab.view(h)[:] = b"\0" * BLOCK
    try:
        with KVClient(host, port, slab=slab, transport="tcp", token=TOKEN, timeout=10) as c:
            if not all(c.put(keys, src, BLOCK, [DIGEST] * len(keys))):
                return False
            if not all(c.get(keys, dst, [DIGEST] * len(keys))):
                return False
    except RdmakvError as e:
        errors.append(f"{type(e).__name__}: {e}")
        return False
    return all(bytes(slab.view(a)) == bytes(slab.view(b)) for a, b in zip(src, dst, strict=True))


def run_phase(
    node: LocalNodeProcess, name: str, attackers: list[tuple[str, int]], args: argparse.Namespace
) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "--attacker", kind, "--count", str(n),
             "--port", str(node.port), "--drip-s", str(args.drip_s)],
        )
        for kind, n in attackers
    ]
    try:
        if procs:
            time.sleep(ATTACKER_SETTLE_S)
        slab = Slab(2 * BLOCKS_PER_ROUND * BLOCK, BLOCK, lock=False)
        handles = [slab.alloc() for _ in range(2 * BLOCKS_PER_ROUND)]
        for i, h in enumerate(handles[:BLOCKS_PER_ROUND]):
            slab.view(h)[:] = os.urandom(BLOCK) if i else bytes([i]) * BLOCK
        lat, ok, errors = [], 0, []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            tag = b"%s-%d" % (name.encode(), r)
            good = good_round(node.host, node.port, slab, handles, tag, errors)
            lat.append((time.perf_counter() - t0) * 1e3)
            ok += good
        slab.close()
        open_now = _established(node.port)
    finally:
        for p in procs:
            p.kill()
            p.wait()
    out = {
        "rounds": args.rounds,
        "ok": ok,
        "success_rate": round(ok / args.rounds, 4),
        "p50_ms": round(float(np.percentile(lat, 50)), 3),
        "p99_ms": round(float(np.percentile(lat, 99)), 3),
        "attackers": dict(attackers),
        "node_connections_at_end": open_now,
        "errors": errors[:5],
    }
    print(f"[flood] {name}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def _established(port: int) -> int:
    """TCP connections to ``port`` in ESTABLISHED state (from /proc/net/tcp)."""
    want = f":{port:04X}"
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(want) and fields[3] == "01":
            n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--attacker", choices=["slow", "idle"], help=argparse.SUPPRESS)
    ap.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--slow", type=int, default=1024, help="slow-handshake connections")
    ap.add_argument("--idle", type=int, default=1024, help="idle authenticated connections")
    ap.add_argument("--drip-s", type=float, default=6.0, help="seconds between a slow one's bytes")
    ap.add_argument("--rounds", type=int, default=200, help="good-client rounds per phase")
    ap.add_argument("--out", type=Path, default=Path("bench/results"))
    ap.add_argument("--name", default="flood")
    args = ap.parse_args()
    if args.attacker:
        attacker(args.attacker, args.count, "127.0.0.1", args.port, args.drip_s)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        token = Path(tmp) / "token"
        token.write_bytes(TOKEN)
        node = LocalNodeProcess(
            {"pool-size": str(4096 * BLOCK), "block-size": str(BLOCK), "transport": "tcp",
             "token-file": str(token)},
            extra_args=["--no-lock"],
        )
        try:
            phases = {
                "baseline": run_phase(node, "baseline", [], args),
                "slow": run_phase(node, "slow", [("slow", args.slow)], args),
                "idle": run_phase(node, "idle", [("idle", args.idle)], args),
                "slow+idle": run_phase(
                    node, "slow+idle", [("slow", args.slow), ("idle", args.idle)], args
                ),
            }
            with KVClient(*node.address, slab=None, transport="tcp", token=TOKEN) as c:
                st = c.stats()
        finally:
            node.terminate()
    result = {
        "phases": phases,
        "node": {k: v for k, v in st.items() if k.startswith("refused_") or k == "sessions_total"},
        "meta": {**provenance(), "slow": args.slow, "idle": args.idle, "drip_s": args.drip_s},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    bad = [n for n, p in phases.items() if p["success_rate"] < 1.0]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
