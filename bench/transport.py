"""Transport benchmark: batched put then get of N blocks through a real `rdmakv serve`.

For each block size (16 KiB, 64 KiB, 256 KiB, 1 MiB) it starts a node, puts N
blocks from a client slab, gets them back into other slab blocks, and verifies
every byte. In the same run it measures the ceiling: the strongest plain
Python socket loop we know, over loopback, in two processes (like client and
node), moving the same bytes each way between arenas of the same size as the
client slab and node pool. Several loops run in every repeat and the ceiling
is the best figure any of them reached:

* ``scatter``: ``sendmsg`` / ``recvmsg_into`` with scatter lists of up to
  IOV_MAX (1024) blocks per system call on both ends, resuming after short
  transfers: the fewest system calls a plain loop can make;
* ``scatter_bigbuf``: the same over a socket with 4 MiB send/receive buffers;
* ``per_block``: ``sendall`` / ``recv_into`` per block (the classic loop).

Prints ONE JSON object: ``{"16384": {put_gbps, get_gbps, ceiling_gbps, ...}, ...}``.

``--metrics-overhead`` instead measures what Prometheus metrics cost: per size,
two nodes, one serving ``--metrics-port`` (scraped once per repeat, as a
Prometheus would) and one without, repeats interleaved between them:
``{"16384": {"metrics_on": {put_gbps, get_gbps}, "metrics_off": {...},
"put_overhead_pct", "get_overhead_pct"}, ...}`` (best of the repeats each).
GB/s are 1e9 bytes per second; each figure is the best of ``--repeats`` runs
(the same rule for our path and for the ceiling). ``ceiling_gbps`` is the
best of every loop in either direction, so the ratios are conservative;
``ceiling_loops`` gives each loop's best send / recv figure.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import selectors
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.perf.drivers.socket_loop import recv_views, send_views

BLOCK_SIZES = (16 * 1024, 64 * 1024, 256 * 1024, 1024 * 1024)
DEFAULT_BLOCKS = 1000
DEFAULT_REPEATS = 5
GB = 1e9
READY_TIMEOUT_S = 60.0
CLIENT_TIMEOUT_S = 60.0
ACK = b"k"
BIG_SOCK_BUF = 4 * 1024 * 1024
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


# -- the ceiling: plain socket loops -------------------------------------------------


def _send_per_block(sock: socket.socket, views: Sequence[memoryview]) -> None:
    for v in views:
        sock.sendall(v)


def _recv_per_block(sock: socket.socket, views: Sequence[memoryview]) -> None:
    for v in views:
        got, size = 0, len(v)
        while got < size:
            n = sock.recv_into(v[got:])
            if n == 0:
                raise ConnectionError("socket-loop peer closed the connection")
            got += n


Mover = Callable[[socket.socket, Sequence[memoryview]], None]
# name -> (big socket buffers?, send loop, receive loop)
LOOPS: dict[str, tuple[bool, Mover, Mover]] = {
    "scatter": (False, send_views, recv_views),
    "scatter_bigbuf": (True, send_views, recv_views),
    "per_block": (False, _send_per_block, _recv_per_block),
}


def _tune(sock: socket.socket, big: bool) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if big:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, opt, BIG_SOCK_BUF)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def _peer_main(port_file: str, block: int, count: int) -> None:
    """Other end of the socket loops, in its own process (like the node).

    One connection per loop (socket options are set before any data moves);
    each command byte is one transfer: ``S`` = receive ``count`` blocks then
    ack, ``G`` = send them. It receives into / sends from an arena of
    ``count`` distinct blocks, as the node does with its pool: reusing one hot
    block would measure cache, not a transfer that leaves the bytes somewhere.
    """
    ls = socket.create_server(("127.0.0.1", 0))
    Path(port_file).write_text(str(ls.getsockname()[1]))
    arena = memoryview(mmap.mmap(-1, block * count, flags=_MAP_FLAGS))
    blocks = [arena[i * block : (i + 1) * block] for i in range(count)]
    conns: list[tuple[socket.socket, Mover, Mover]] = []
    for _ in LOOPS:
        conn, _addr = ls.accept()
        name = _recv_exact(conn, 32).rstrip(b" ").decode()
        big, send, recv = LOOPS[name]
        _tune(conn, big)
        conns.append((conn, send, recv))
    sel = selectors.DefaultSelector()
    for item in conns:
        sel.register(item[0], selectors.EVENT_READ, item)
    live = len(conns)
    while live:
        for key, _mask in sel.select():
            conn, send, recv = key.data
            cmd = conn.recv(1)
            if cmd == b"S":
                recv(conn, blocks)
                conn.sendall(ACK)
            elif cmd == b"G":
                send(conn, blocks)
            else:  # closed
                sel.unregister(conn)
                conn.close()
                live -= 1


def _start_peer(block: int, count: int, tmp: Path) -> tuple[Any, int]:
    port_file = tmp / f"rdmakv-bench-peer-{os.getpid()}-{block}"
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen(
        [sys.executable, __file__, "--peer", str(port_file), str(block), str(count)]
    )
    deadline = time.monotonic() + READY_TIMEOUT_S
    while not port_file.exists() or not port_file.read_text():
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("socket-loop peer did not start")
        time.sleep(0.01)
    port = int(port_file.read_text())
    port_file.unlink(missing_ok=True)
    return proc, port


class SocketLoop:
    """Every loop of :data:`LOOPS`, both directions, against one peer process."""

    def __init__(self, slab: Slab, handles: list[int], tmp: Path) -> None:
        self.block, self.count = slab.block_size, len(handles)
        self.views = [slab.view(h) for h in handles]
        self._peer, port = _start_peer(self.block, self.count, tmp)
        self._socks: dict[str, socket.socket] = {}
        for name, (big, _send, _recv) in LOOPS.items():
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            _tune(sock, big)  # before connect: buffer sizes shape the window scale
            sock.connect(("127.0.0.1", port))
            sock.sendall(name.encode().ljust(32))
            self._socks[name] = sock
        self.best: dict[str, dict[str, float]] = {n: {"send": 0.0, "recv": 0.0} for n in LOOPS}

    def run_all(self) -> tuple[float, float]:
        """One send and one receive per loop; the best send and receive GB/s of this round."""
        best_send = best_recv = 0.0
        nbytes = self.block * self.count
        for name, (_big, send, recv) in LOOPS.items():
            sock = self._socks[name]
            t0 = time.perf_counter()
            sock.sendall(b"S")
            send(sock, self.views)
            if sock.recv(1) != ACK:
                raise RuntimeError("socket-loop peer failed")
            gbps = nbytes / (time.perf_counter() - t0) / GB
            self.best[name]["send"] = max(self.best[name]["send"], gbps)
            best_send = max(best_send, gbps)
            t0 = time.perf_counter()
            sock.sendall(b"G")
            recv(sock, self.views)
            gbps = nbytes / (time.perf_counter() - t0) / GB
            self.best[name]["recv"] = max(self.best[name]["recv"], gbps)
            best_recv = max(best_recv, gbps)
        return best_send, best_recv

    def close(self) -> None:
        for sock in self._socks.values():
            sock.close()
        self._peer.wait(READY_TIMEOUT_S)


# -- our path ---------------------------------------------------------------------------


def start_node(
    block: int, count: int, metrics: bool = False
) -> tuple[subprocess.Popen[str], int]:
    pool = block * (count + 16)
    metrics_args = ["--metrics-port", "0"] if metrics else []
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
            "--transport",
            "tcp",
            "--no-lock",
            *metrics_args,
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
    proc.metrics_url = next(  # type: ignore[attr-defined]
        (w.split("=", 1)[1] for w in line.split() if w.startswith("metrics=")), None
    )
    return proc, port


def _put_get_once(
    c: KVClient, slab: Slab, src: list[int], dst: list[int], digests: list[bytes], tag: str
) -> tuple[float, float]:
    """One timed put and get of every block, bytes verified; (put GB/s, get GB/s)."""
    count, block = len(src), slab.block_size
    keys = [b"bench-%s-%d" % (tag.encode(), i) for i in range(count)]
    t0 = time.perf_counter()
    ok = c.put(keys, src, block, digests)
    put = count * block / (time.perf_counter() - t0) / GB
    if not all(ok):
        raise RuntimeError(f"put stored only {sum(ok)} of {count}")
    for h in dst:
        slab.numpy(h)[:] = 0
    t0 = time.perf_counter()
    hits = c.get(keys, dst, digests)
    get = count * block / (time.perf_counter() - t0) / GB
    if not all(hits):
        raise RuntimeError(f"get hit only {sum(hits)} of {count}")
    for s_h, d_h in zip(src, dst, strict=True):
        if not np.array_equal(slab.numpy(s_h), slab.numpy(d_h)):
            raise RuntimeError(f"bytes differ for block {s_h} -> {d_h}")
    c.delete(keys)
    return put, get


def bench_metrics_overhead(block: int, count: int, repeats: int) -> dict[str, Any]:
    """The same put/get through a node with metrics on (scraped every repeat) and one
    with them off, repeats interleaved so both see the same machine load."""
    import urllib.request

    slab = Slab(2 * count * block, block, lock=False)
    src = slab.alloc_many(count)
    dst = slab.alloc_many(count)
    rng = np.random.default_rng(block)
    for h in src:
        slab.numpy(h)[:] = rng.integers(0, 256, block, dtype=np.uint8)
    digests = [h.to_bytes(16, "little") for h in range(count)]
    on_node, on_port = start_node(block, count, metrics=True)
    off_node, off_port = start_node(block, count, metrics=False)
    url = on_node.metrics_url  # type: ignore[attr-defined]
    figures: dict[str, list[tuple[float, float]]] = {"metrics_on": [], "metrics_off": []}
    scraped = 0
    try:
        with (
            KVClient("127.0.0.1", on_port, slab, timeout=CLIENT_TIMEOUT_S) as on,
            KVClient("127.0.0.1", off_port, slab, timeout=CLIENT_TIMEOUT_S) as off,
        ):
            for rep in range(repeats):
                order = [("metrics_on", on), ("metrics_off", off)]
                for name, c in order if rep % 2 == 0 else order[::-1]:
                    figures[name].append(_put_get_once(c, slab, src, dst, digests, str(rep)))
                with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
                    scraped += len(r.read())
    finally:
        for node in (on_node, off_node):
            node.terminate()
            node.wait(30)
    slab.close()
    out: dict[str, Any] = {"blocks": count, "repeats": repeats, "scraped_bytes": scraped}
    for name, runs in figures.items():
        out[name] = {
            "put_gbps": round(max(p for p, _ in runs), 3),
            "get_gbps": round(max(g for _, g in runs), 3),
            "median_put_gbps": round(float(np.median([p for p, _ in runs])), 3),
            "median_get_gbps": round(float(np.median([g for _, g in runs])), 3),
        }
    for d in ("put", "get"):
        on_g, off_g = out["metrics_on"][f"{d}_gbps"], out["metrics_off"][f"{d}_gbps"]
        out[f"{d}_overhead_pct"] = round(100 * (off_g - on_g) / off_g, 2)
    return out


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
    loop = SocketLoop(slab, scratch, tmp)
    puts, gets, sends, recvs = [], [], [], []
    verified = 0
    try:
        with KVClient("127.0.0.1", port, slab, timeout=CLIENT_TIMEOUT_S) as c:
            for rep in range(repeats):
                send, recv = loop.run_all()
                sends.append(send)
                recvs.append(recv)
                put, get = _put_get_once(c, slab, src, dst, digests, str(rep))
                puts.append(put)
                gets.append(get)
                verified += count * block
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
        "median_ceiling_gbps": round(
            float(np.median([max(a, b) for a, b in zip(sends, recvs, strict=True)])), 3
        ),
        "ceiling_loops": {
            name: {d: round(v, 3) for d, v in best.items()} for name, best in loop.best.items()
        },
        "bytes_verified": verified,
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--peer":
        port_file, block, count = sys.argv[2:5]
        _peer_main(port_file, int(block), int(count))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS)
    ap.add_argument("--repeats", type=int, default=DEFAULT_REPEATS)
    ap.add_argument("--sizes", type=int, nargs="*", default=list(BLOCK_SIZES))
    ap.add_argument(
        "--metrics-overhead",
        action="store_true",
        help="compare a node with Prometheus metrics on (scraped) and off, same run",
    )
    args = ap.parse_args()
    tmp = Path(os.environ.get("TMPDIR", "/tmp"))
    if args.metrics_overhead:
        out = {
            str(b): bench_metrics_overhead(b, args.blocks, args.repeats) for b in args.sizes
        }
    else:
        out = {str(b): bench_size(b, args.blocks, args.repeats, tmp) for b in args.sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
