"""Transport benchmark: batched put then get of N blocks through a real `rdmakv serve`.

For each block size (16 KiB, 256 KiB, 1 MiB) it starts a node, puts N blocks
from a client slab, gets them back into other slab blocks, and verifies every
byte. In the same run it measures the ceiling: a plain Python socket loop over
loopback (``sendall`` per block on one side, ``recv_into`` on the other, in two
processes, like client and node) moving the same bytes each way, between
arenas of the same size as the client slab and node pool.

Prints ONE JSON object: ``{"16384": {put_gbps, get_gbps, ceiling_gbps, ...}, ...}``.
GB/s are 1e9 bytes per second; each figure is the best of ``--repeats`` runs
(the same rule for our path and for the ceiling). ``ceiling_gbps`` is the
faster of the two socket-loop directions, so the ratios are conservative.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.client import KVClient
from rdmakv.slab import Slab

BLOCK_SIZES = (16 * 1024, 256 * 1024, 1024 * 1024)
DEFAULT_BLOCKS = 1000
DEFAULT_REPEATS = 5
GB = 1e9
READY_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 60.0
ACK = b"k"
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


# -- the ceiling: a plain socket loop -------------------------------------------------


def _peer_main(mode: str, port_file: str, block: int, count: int, repeats: int) -> None:
    """Other end of the socket loop, in its own process (like the node).

    It receives into / sends from an arena of ``count`` distinct blocks, as the
    node does with its pool: reusing one hot block would measure cache, not a
    transfer that leaves the bytes somewhere.
    """
    ls = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(ls.getsockname()[1]))
    conn, _ = ls.accept()
    arena = memoryview(mmap.mmap(-1, block * count, flags=_MAP_FLAGS))
    blocks = [arena[i * block : (i + 1) * block] for i in range(count)]
    for _ in range(repeats):
        if mode == "sink":
            for b in blocks:
                got = 0
                while got < block:
                    n = conn.recv_into(b[got:])
                    if n == 0:
                        return
                    got += n
            conn.sendall(ACK)
        else:
            if conn.recv(1) != ACK:
                return
            for b in blocks:
                conn.sendall(b)
    conn.close()


def _start_peer(mode: str, block: int, count: int, repeats: int, tmp: Path) -> tuple[Any, int]:
    port_file = tmp / f"peer-{mode}-{block}"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--peer",
            mode,
            str(port_file),
            str(block),
            str(count),
            str(repeats),
        ]
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"socket-loop peer ({mode}) did not start")
        time.sleep(0.01)
    return proc, int(port_file.read_text())


class SocketLoop:
    """Both directions of the plain loop: ``sendall`` per block / ``recv_into`` per block."""

    def __init__(self, slab: Slab, handles: list[int], repeats: int, tmp: Path) -> None:
        self.block, self.count = slab.block_size, len(handles)
        self.views = [slab.view(h) for h in handles]
        self._sink, port = _start_peer("sink", self.block, self.count, repeats, tmp)
        self._out = socket.create_connection(("127.0.0.1", port))
        self._source, port = _start_peer("source", self.block, self.count, repeats, tmp)
        self._in = socket.create_connection(("127.0.0.1", port))

    def send_gbps(self) -> float:
        t0 = time.perf_counter()
        for v in self.views:
            self._out.sendall(v)
        if self._out.recv(1) != ACK:
            raise RuntimeError("sink peer failed")
        return self.block * self.count / (time.perf_counter() - t0) / GB

    def recv_gbps(self) -> float:
        t0 = time.perf_counter()
        self._in.sendall(ACK)
        for v in self.views:
            got = 0
            while got < self.block:
                n = self._in.recv_into(v[got:])
                if n == 0:
                    raise RuntimeError("source peer closed early")
                got += n
        return self.block * self.count / (time.perf_counter() - t0) / GB

    def close(self) -> None:
        self._out.close()
        self._in.close()
        self._sink.wait(READY_TIMEOUT_S)
        self._source.wait(READY_TIMEOUT_S)


# -- our path ---------------------------------------------------------------------------


def start_node(block: int, count: int) -> tuple[subprocess.Popen[str], int]:
    pool = block * (count + 16)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rdmakv.cli",
            "serve",
            "--port",
            "0",
            "--pool-size",
            str(pool),
            "--block-size",
            str(block),
            "--no-lock",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "ready on" not in line:
        proc.kill()
        raise RuntimeError(f"node did not start: {line!r}")
    port = int(line.split("ready on ", 1)[1].split()[0].rsplit(":", 1)[1])
    return proc, port


def bench_size(block: int, count: int, repeats: int, tmp: Path) -> dict[str, Any]:
    """Interleave ceiling and our path in every repeat: load on a shared machine
    shifts over seconds, and interleaving exposes both to the same load."""
    slab = Slab(3 * count * block, block, lock=False)
    src = slab.alloc_many(count)
    dst = slab.alloc_many(count)
    scratch = slab.alloc_many(count)  # the socket loop's buffers: src/dst stay untouched
    rng = np.random.default_rng(block)
    for h in src:
        slab.numpy(h)[:] = rng.integers(0, 256, block, dtype=np.uint8)
    digests = [h.to_bytes(16, "little") for h in range(count)]
    node, port = start_node(block, count)
    loop = SocketLoop(slab, scratch, repeats, tmp)
    puts, gets, sends, recvs = [], [], [], []
    verified = 0
    try:
        with KVClient("127.0.0.1", port, slab, timeout=CLIENT_TIMEOUT_S) as c:
            for rep in range(repeats):
                keys = [b"bench-%d-%d" % (rep, i) for i in range(count)]
                sends.append(loop.send_gbps())
                t0 = time.perf_counter()
                ok = c.put(keys, src, block, digests)
                puts.append(count * block / (time.perf_counter() - t0) / GB)
                if not all(ok):
                    raise RuntimeError(f"put stored only {sum(ok)} of {count}")
                for h in dst:
                    slab.numpy(h)[:] = 0
                t0 = time.perf_counter()
                hits = c.get(keys, dst, digests)
                gets.append(count * block / (time.perf_counter() - t0) / GB)
                recvs.append(loop.recv_gbps())
                if not all(hits):
                    raise RuntimeError(f"get hit only {sum(hits)} of {count}")
                for s_h, d_h in zip(src, dst, strict=True):
                    if not np.array_equal(slab.numpy(s_h), slab.numpy(d_h)):
                        raise RuntimeError(f"bytes differ for block {s_h} -> {d_h}")
                verified += count * block
                c.delete(keys)
    finally:
        loop.close()
        node.terminate()
        node.wait(30)
    slab.close()
    put, get, send, recv = max(puts), max(gets), max(sends), max(recvs)
    ceiling = max(send, recv)
    return {
        "blocks": count,
        "put_gbps": round(put, 3),
        "get_gbps": round(get, 3),
        "ceiling_gbps": round(ceiling, 3),
        "ceiling_send_gbps": round(send, 3),
        "ceiling_recv_gbps": round(recv, 3),
        "put_vs_ceiling": round(put / ceiling, 3),
        "get_vs_ceiling": round(get / ceiling, 3),
        "median_put_gbps": round(float(np.median(puts)), 3),
        "median_get_gbps": round(float(np.median(gets)), 3),
        "median_ceiling_gbps": round(float(np.median(sends + recvs)), 3),
        "bytes_verified": verified,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        mode, port_file, block, count, repeats = sys.argv[2:7]
        _peer_main(mode, port_file, int(block), int(count), int(repeats))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--sizes", type=int, nargs="*", default=list(BLOCK_SIZES))
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    out = {str(b): bench_size(b, args.blocks, args.repeats, tmp) for b in args.sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
