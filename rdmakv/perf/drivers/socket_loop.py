"""The ceiling: the strongest plain socket loop we know, in Python, over loopback TCP.

A child process (like a node) holds an arena of ``blocks`` blocks. ``put``
sends the bench's source blocks into it and waits for a one-byte ack; ``get``
asks for them back and receives them into the bench's destination arena. Each
direction is ``sendmsg`` / ``recvmsg_into`` with scatter lists of up to
``IOV_MAX`` (1024) separate blocks and at most :data:`WINDOW_BYTES` per system
call on both ends, no per-block round trip, no copies, TCP_NODELAY,
kernel-autotuned socket buffers and the congestion control rdmakv's
connections run (:mod:`rdmakv.transport.congestion`). The runner verifies the bytes
that come back, so the loop really moved them out and back. The runner takes
the best of at least :attr:`SocketLoopDriver.min_repeats` runs.

Puts and gets go over two connections, one each, and the peer serves each
from its own thread: rdmakv's driver puts through one client and gets through
another, and its node serves each session from its own thread. On the 2-core
VMs a peer thread that served both directions moved gets at about half the
rate of one that only sent, whether over one connection or two; a thread per
connection matched a separate peer process per direction. (rdmakv itself
showed no such effect: one client putting and getting over one connection
moved as much as a put client and a get client.) The figures, and which
results measured the older loop: bench/README.md, section "Measurements moved
from code comments (issue 58)".

There is no lookup: ``exists`` raises PeerUnavailable. :class:`EchoPeer` is
the one-byte round trip the latency section compares lookups with.

``python -m rdmakv.perf.drivers.socket_loop --peer PORT BLOCK COUNT`` and
``--echo PORT`` are the child processes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence

from rdmakv.perf.driver import Arena, PeerUnavailable, Workload
from rdmakv.transport.congestion import apply_congestion

IOV_MAX = min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024)
WINDOW_BYTES = 512 * 1024
"""Bytes one sendmsg / recvmsg_into call moves at most. The fewest system calls
is not the fastest loop: over loopback, windows of 512 KiB moved more per
second than windows of 1024 whole blocks, and more than 128 KiB, 256 KiB or
1 MiB windows; the send side's cap mattered most (each call's bytes are still
in the CPU cache when the kernel copies them on). It is also the window of
every call of rdmakv's native loop (``RK_TCP_WINDOW``). The figures, and which
results had no cap: bench/README.md, section "Measurements moved from code
comments (issue 58)"."""
ACCEPT_TIMEOUT_S = 60.0
REAP_TIMEOUT_S = 10.0
"""How long a child told to leave may take before it is killed."""
_HDR = struct.Struct("!cII")  # command, first block, block count
ACK = b"k"
CONNECTIONS = 2
"""The loop's connections to its peer: puts go over the first, gets over the second."""
ECHO_WARM_UP = 10
"""Round trips an :class:`EchoPeer` makes before anyone times one."""
_MAP_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


def _tune(sock: socket.socket) -> None:
    # Socket buffers stay kernel-autotuned: fixing SO_RCVBUF/SO_SNDBUF (4 MiB)
    # turns autotuning off and measured slower here at 16 KiB, no faster above.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # The congestion control rdmakv's own connections ask for: the ceiling
    # must not lose to rdmakv by running a slower algorithm (BBR, where that
    # is the system default).
    apply_congestion(sock)


def _advance(views: Sequence[memoryview], i: int, off: int, moved: int) -> tuple[int, int]:
    """Position (view index, offset in it) after ``moved`` more bytes from ``(i, off)``."""
    while moved:
        rest = len(views[i]) - off
        if moved < rest:
            return i, off + moved
        moved -= rest
        i, off = i + 1, 0
    return i, off


def _window(views: Sequence[memoryview], i: int, off: int) -> list[memoryview]:
    """Up to IOV_MAX views and WINDOW_BYTES bytes from position ``(i, off)`` (a
    view longer than the window is cut)."""
    out: list[memoryview] = []
    total = 0
    for j in range(i, min(len(views), i + IOV_MAX)):
        b = views[j][off:] if j == i and off else views[j]
        if total + len(b) >= WINDOW_BYTES:
            out.append(b[: WINDOW_BYTES - total])
            break
        out.append(b)
        total += len(b)
    return out


def send_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Send every view, one window per sendmsg, resuming after short sends."""
    i, off = 0, 0
    while i < len(views):
        i, off = _advance(views, i, off, sock.sendmsg(_window(views, i, off)))


def recv_views(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fill every view, one window per recvmsg_into."""
    i, off = 0, 0
    while i < len(views):
        got = sock.recvmsg_into(_window(views, i, off))[0]
        if got == 0:
            raise ConnectionError("socket-loop peer closed the connection")
        i, off = _advance(views, i, off, got)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_views(sock, [memoryview(buf)])
    return bytes(buf)


def _blocks(mv: memoryview, block: int, count: int) -> list[memoryview]:
    return [mv[i * block : (i + 1) * block] for i in range(count)]


# -- child processes ------------------------------------------------------------------


def _peer_main(port: int, block: int, count: int) -> None:
    """Serve the put and the get connection (:data:`CONNECTIONS`), each from
    its own thread, as a node serves each session from its own."""
    # The arena first: the driver times from the moment the connections are
    # made, and faulting in (zeroing) up to 256 MiB must not fall into that.
    arena = mmap.mmap(-1, block * count, flags=_MAP_FLAGS)
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(CONNECTIONS)]
    views = _blocks(memoryview(arena), block, count)
    threads = [threading.Thread(target=_serve, args=(sock, views)) for sock in socks]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def _serve(sock: socket.socket, views: list[memoryview]) -> None:
    """One connection's commands, until it closes or says Q."""
    _tune(sock)
    while True:
        try:
            cmd, first, n = _HDR.unpack(_recv_exact(sock, _HDR.size))
        except ConnectionError:
            return
        if cmd == b"P":
            recv_views(sock, views[first : first + n])
            sock.sendall(ACK)
        elif cmd == b"G":
            send_views(sock, views[first : first + n])
        else:
            return


def _echo_main(port: int) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        b = sock.recv(1)
        if not b:
            return
        sock.sendall(b)


def _spawn(
    args: list[str], connections: int = 1
) -> tuple[subprocess.Popen[bytes], list[socket.socket]]:
    """Start a child that connects back to a fresh listener ``connections``
    times; return it and the connections, in the order it made them."""
    ls = socket.create_server(("127.0.0.1", 0))
    ls.settimeout(ACCEPT_TIMEOUT_S)
    port = ls.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "rdmakv.perf.drivers.socket_loop", *args[:1], str(port), *args[1:]]
    )
    conns: list[socket.socket] = []
    try:
        for _ in range(connections):
            conns.append(ls.accept()[0])
    except TimeoutError:
        for c in conns:
            c.close()
        proc.kill()
        proc.wait()
        raise PeerUnavailable("socket-loop child did not connect") from None
    finally:
        ls.close()
    for c in conns:
        c.settimeout(None)
    return proc, conns


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Wait for a child told to leave (its connection closed or sent "Q");
    kill it if it has not within :data:`REAP_TIMEOUT_S`."""
    try:
        proc.wait(REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class EchoPeer:
    """A child process that echoes one byte back: the bare TCP round trip.

    Lives until :meth:`close`; each :meth:`ping_ms` is one round trip, so the
    latency section can take one beside each lookup it times (both then meet
    the same machine weather). ``on_spawned`` runs once the child is connected
    (to place it, say)."""

    def __init__(self, on_spawned: Callable[[], object] | None = None) -> None:
        self._proc, (self._sock,) = _spawn(["--echo"])
        try:
            if on_spawned is not None:
                on_spawned()
            self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            for _ in range(ECHO_WARM_UP):
                self.ping_ms()
        except BaseException:
            self.close()
            raise

    def ping_ms(self) -> float:
        t0 = time.perf_counter()
        self._sock.sendall(b"x")
        if self._sock.recv(1) != b"x":
            raise ConnectionError("echo child closed")
        return (time.perf_counter() - t0) * 1e3

    def close(self) -> None:
        self._sock.close()  # the child sees EOF and exits
        _reap(self._proc)

    def __enter__(self) -> EchoPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def tcp_ping_pong_ms(samples: int, on_spawned: Callable[[], object] | None = None) -> list[float]:
    """``samples`` one-byte TCP round trips to a child process, in milliseconds."""
    with EchoPeer(on_spawned) as peer:
        return [peer.ping_ms() for _ in range(samples)]


# -- the driver -----------------------------------------------------------------------


class SocketLoopDriver:
    name = "socket_loop"
    min_repeats = 5
    has_exists = False

    def __init__(self, transport: str = "tcp") -> None:
        if transport != "tcp":
            raise PeerUnavailable(f"the socket loop is TCP only (asked for {transport})")
        self._proc: subprocess.Popen[bytes] | None = None
        self._socks: list[socket.socket] = []
        """The put connection, then the get connection (:data:`CONNECTIONS`)."""
        self._src: list[memoryview] = []
        self._dst: list[memoryview] = []
        self._stored: Sequence[bytes] = ()
        """The keys of the last put, block i in slot i."""
        self._where: dict[bytes, int] | None = None
        """Slot per key of ``_stored``, built on the first get that needs it."""
        self._peer_args: list[str] = []

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        self._src = _blocks(src.data.cast("B"), work.block_bytes, work.blocks)
        self._dst = _blocks(dst.data.cast("B"), work.block_bytes, work.blocks)
        self._peer_args = ["--peer", str(work.block_bytes), str(work.blocks)]
        self._connect()

    def _connect(self) -> None:
        self._proc, self._socks = _spawn(self._peer_args, CONNECTIONS)
        for sock in self._socks:
            _tune(sock)

    def reconnect(self) -> None:
        """Fresh connections: the peer holds nothing a later repeat needs (each
        puts before it gets), so a new peer process connects anew."""
        self.close()
        self._stored, self._where = (), None
        self._connect()

    def put(self, keys: Sequence[bytes]) -> None:
        sock = self._socks[0]
        n = len(keys)
        sock.sendall(_HDR.pack(b"P", 0, n))
        send_views(sock, self._src[:n])
        if _recv_exact(sock, 1) != ACK:
            raise ConnectionError("socket-loop peer did not acknowledge")
        self._stored, self._where = keys, None

    def get(self, keys: Sequence[bytes]) -> None:
        sock = self._socks[1]
        runs = self._runs(keys)
        sock.sendall(b"".join(_HDR.pack(b"G", f, n) for f, n in runs))
        recv_views(sock, self._dst[: len(keys)])

    def _runs(self, keys: Sequence[bytes]) -> list[tuple[int, int]]:
        """(first slot, count) per contiguous run of the slots holding ``keys``.
        The keys just put, in their order, are one run, found without a
        per-key pass: the ceiling times moving bytes, not the bench's
        bookkeeping (a plain loop knows where it put them)."""
        if keys is self._stored:
            return [(0, len(keys))] if keys else []
        if self._where is None:
            self._where = {bytes(k): i for i, k in enumerate(self._stored)}
        runs: list[tuple[int, int]] = []
        for slot in (self._where[bytes(k)] for k in keys):
            if runs and runs[-1][0] + runs[-1][1] == slot:
                runs[-1] = (runs[-1][0], runs[-1][1] + 1)
            else:
                runs.append((slot, 1))
        return runs

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        raise PeerUnavailable("the socket loop has no lookup")

    def close(self) -> None:
        if self._socks:
            with contextlib.suppress(OSError):
                self._socks[0].sendall(_HDR.pack(b"Q", 0, 0))
            for sock in self._socks:
                sock.close()
            self._socks = []
        if self._proc is not None:
            _reap(self._proc)
            self._proc = None


def main(argv: list[str]) -> None:
    if argv[0] == "--peer":
        _peer_main(int(argv[1]), int(argv[2]), int(argv[3]))
    elif argv[0] == "--echo":
        _echo_main(int(argv[1]))
    else:
        raise SystemExit(f"usage: {__doc__}")


if __name__ == "__main__":
    main(sys.argv[1:])
