"""WireProxy: a fault-injecting TCP forwarder between a client and a real KV node.

The proxy listens on 127.0.0.1 (a free port) and, for every client it
accepts, opens its own connection to the node and forwards bytes both ways
with two threads. Nothing is parsed: faults are placed by *stream offset*, the
number of bytes that passed in one direction, so they land wherever the
protocol happens to be at that point (a header, a key list, block data).

Faults (armed at any time, from any thread; :meth:`WireProxy.clear` disarms):

* :meth:`~WireProxy.cut_after` -- close the connection once ``nbytes`` more bytes
  have passed in one direction (the bytes before that offset are delivered,
  the rest are not): a connection drop mid-request or mid-reply.
* :meth:`~WireProxy.stall_after` -- after ``nbytes`` the connection goes silent
  both ways (a black hole) until the fault is cleared; it is then closed.
* :meth:`~WireProxy.flip_bits` -- flip one random bit at random offsets, about
  one every ``mean_gap`` bytes, in one direction: corruption on the wire;
  :meth:`~WireProxy.flip_at` flips one chosen bit at one offset.
* :meth:`~WireProxy.call_at` -- run a callable (e.g. ``node.kill``) when the
  stream reaches an offset, before any later byte is forwarded: a fault of the
  node placed exactly mid-transfer.

Invariants: the bytes that reach the far side are exactly the bytes sent,
in order, except for recorded flips; a cut or stalled connection never
delivers a byte past its offset. Offsets count from the moment the fault is
armed, over every connection of the proxy (``every=True`` cuts count per
connection). Flip positions come from a seeded generator and are recorded
(:attr:`WireProxy.flips`, as offsets since the proxy started), so a failing
run names the bytes it corrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import random
import socket
import threading
from collections.abc import Callable

UPSTREAM_CONNECT_TIMEOUT_S = 2.0
RECV_CHUNK = 256 * 1024


class Direction(enum.Enum):
    UP = "client->node"
    DOWN = "node->client"


class Kind(enum.Enum):
    CUT = "cut"
    STALL = "stall"
    CALL = "call"
    FLIP = "flip"


@dataclasses.dataclass
class _Fault:
    """One armed fault of one direction.

    ``at`` is the global stream offset where it fires; with ``every`` it is
    ``nbytes`` instead, counted per connection from the arming (``bases``: what
    each connection open then had already forwarded; later ones count from 0)."""

    kind: Kind
    at: int
    every: bool = False
    bases: dict[int, int] = dataclasses.field(default_factory=dict)
    fn: Callable[[], object] | None = None
    bit: int = 0


@dataclasses.dataclass
class _FlipPlan:
    rng: random.Random
    mean_gap: int
    next_at: int


@dataclasses.dataclass(frozen=True)
class Flip:
    """One corrupted bit: ``offset`` is the global stream offset in ``direction``."""

    direction: Direction
    offset: int
    bit: int


class _Link:
    """One proxied connection: the client's socket and the proxy's socket to the node."""

    def __init__(self, serial: int, client: socket.socket, node: socket.socket) -> None:
        self.serial = serial  # unique per proxy (unlike id(), never reused)
        self.client = client
        self.node = node
        self.sent = dict.fromkeys(Direction, 0)  # bytes this link forwarded per direction
        self.closed = False
        self.stalled = False
        self.eof: set[Direction] = set()  # directions whose sender closed in order

    def ends(self, d: Direction) -> tuple[socket.socket, socket.socket]:
        return (self.client, self.node) if d is Direction.UP else (self.node, self.client)

    def close(self) -> None:
        """Close both sockets. Bytes already forwarded still arrive, then EOF
        (shutdown first: it also wakes a pump blocked in recv/send)."""
        if self.closed:
            return
        self.closed = True
        for s in (self.client, self.node):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
            s.close()


class WireProxy:
    """A TCP forwarder to ``upstream`` (host, port) with injectable faults (module doc)."""

    def __init__(self, upstream: tuple[str, int], host: str = "127.0.0.1") -> None:
        self.upstream = upstream
        self._listener = socket.create_server((host, 0))
        self.host, self.port = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._released = threading.Condition(self._lock)
        self._links: set[_Link] = set()
        self._pos = dict.fromkeys(Direction, 0)
        self._faults: dict[Direction, list[_Fault]] = {d: [] for d in Direction}
        self._flips: dict[Direction, _FlipPlan | None] = dict.fromkeys(Direction)
        self._generation = 0  # bumped by clear(): releases stalls
        self.flips: list[Flip] = []
        self.fired: list[tuple[Kind, Direction]] = []
        self.connections = 0
        self._closed = False
        self._accepter = threading.Thread(target=self._accept, name="wire-proxy", daemon=True)
        self._accepter.start()

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    # -- arming --------------------------------------------------------------------------
    def cut_after(self, d: Direction, nbytes: int, *, every: bool = False) -> None:
        """Close the connection carrying byte ``nbytes`` (from now) in direction ``d``.

        One-shot; with ``every``, each connection is cut once it carried
        ``nbytes`` bytes in ``d`` since now (or since it opened): retries on a
        new connection are cut too, until :meth:`clear`."""
        with self._lock:
            if every:
                bases = {link.serial: link.sent[d] for link in self._links}
                fault = _Fault(Kind.CUT, nbytes, every=True, bases=bases)
            else:
                fault = _Fault(Kind.CUT, self._pos[d] + nbytes)
            self._faults[d].append(fault)

    def stall_after(self, d: Direction, nbytes: int) -> None:
        """After ``nbytes`` more bytes in ``d``, that connection goes silent both
        ways until :meth:`clear`, then it is closed. One-shot."""
        with self._lock:
            self._faults[d].append(_Fault(Kind.STALL, self._pos[d] + nbytes))

    def call_at(self, d: Direction, nbytes: int, fn: Callable[[], object]) -> None:
        """Run ``fn`` (on the forwarding thread) when ``nbytes`` more bytes have
        passed in ``d``, before the next byte is forwarded. One-shot."""
        with self._lock:
            self._faults[d].append(_Fault(Kind.CALL, self._pos[d] + nbytes, fn=fn))

    def flip_at(self, d: Direction, nbytes: int, bit: int) -> None:
        """Flip bit ``bit`` (0..7) of the byte ``nbytes`` bytes from now in ``d``. One-shot."""
        if not 0 <= bit < 8:
            raise ValueError(f"bit must be in 0..7, got {bit}")
        with self._lock:
            self._faults[d].append(_Fault(Kind.FLIP, self._pos[d] + nbytes, bit=bit))

    def flip_bits(self, d: Direction, *, mean_gap: int, seed: int) -> None:
        """Flip one random bit about every ``mean_gap`` bytes in ``d`` (random
        offsets from a generator seeded with ``seed``), until :meth:`clear`."""
        if mean_gap < 1:
            raise ValueError(f"mean_gap must be >= 1, got {mean_gap}")
        rng = random.Random(seed)
        with self._lock:
            self._flips[d] = _FlipPlan(rng, mean_gap, self._pos[d] + self._gap(rng, mean_gap))

    def clear(self) -> None:
        """Disarm every fault; stalled connections are released (and closed)."""
        with self._lock:
            for d in Direction:
                self._faults[d].clear()
                self._flips[d] = None
            self._generation += 1
            self._released.notify_all()

    @staticmethod
    def _gap(rng: random.Random, mean_gap: int) -> int:
        return 1 + int(rng.expovariate(1.0 / mean_gap))

    # -- forwarding ----------------------------------------------------------------------
    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                node = socket.create_connection(self.upstream, UPSTREAM_CONNECT_TIMEOUT_S)
                node.settimeout(None)
            except OSError:
                # the node is gone: the client sees its connection closed at once
                client.close()
                continue
            for s in (client, node):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    node.close()
                    return
                self.connections += 1
                link = _Link(self.connections, client, node)
                self._links.add(link)
            for d in Direction:
                threading.Thread(
                    target=self._pump,
                    args=(link, d),
                    daemon=True,
                    name=f"wire-proxy-{d.name.lower()}",
                ).start()

    def _pump(self, link: _Link, d: Direction) -> None:
        """Forward ``d`` until EOF, an error or a fault ends it. An orderly EOF
        is passed on as a half-close (the other direction keeps flowing); the
        link closes when both directions ended, or at once on an error or a fault."""
        src, dst = link.ends(d)
        eof = False
        try:
            while not link.closed:
                data = bytearray(src.recv(RECV_CHUNK))
                if not data:
                    eof = True
                    break
                if not self._forward(link, d, data, dst):
                    break
        except OSError:
            pass
        with self._lock:
            if eof and not link.closed:
                link.eof.add(d)
                with contextlib.suppress(OSError):
                    dst.shutdown(socket.SHUT_WR)
                if len(link.eof) < len(Direction):
                    return
            self._links.discard(link)
            link.close()

    def _forward(self, link: _Link, d: Direction, data: bytearray, dst: socket.socket) -> bool:
        """Send ``data`` on, applying the faults it crosses; False once the link is done."""
        i = 0
        while i < len(data):
            with self._lock:
                self._wait_while_stalled(link)
                if link.closed:
                    return False
                stop, fault = self._next_fault(link, d, len(data) - i)
                stop += i
                self._apply_flips(d, data, i, stop)
                self._pos[d] += stop - i
                link.sent[d] += stop - i
                if fault is not None:
                    self.fired.append((fault.kind, d))
                    if not fault.every:
                        self._faults[d].remove(fault)
                    if fault.kind is Kind.FLIP:  # data[stop] goes out with the next piece
                        data[stop] ^= 1 << fault.bit
                        self.flips.append(Flip(d, self._pos[d], fault.bit))
            if stop > i:
                dst.sendall(memoryview(data)[i:stop])
            i = stop
            if fault is None or fault.kind is Kind.FLIP:
                continue
            if fault.kind is Kind.CUT:
                return False
            if fault.kind is Kind.CALL:
                assert fault.fn is not None
                fault.fn()
            elif fault.kind is Kind.STALL:
                with self._lock:
                    link.stalled = True
                    generation = self._generation
                    while self._generation == generation and not self._closed:
                        self._released.wait()
                return False
        return True

    def _wait_while_stalled(self, link: _Link) -> None:
        """(Lock held.) The other direction of a stalled link forwards nothing either."""
        while link.stalled and not link.closed and not self._closed:
            self._released.wait(0.05)
        if link.stalled:
            link.closed = link.closed or self._closed

    def _next_fault(self, link: _Link, d: Direction, n: int) -> tuple[int, _Fault | None]:
        """(Lock held.) How many of the next ``n`` bytes go before the earliest
        fault of ``d`` on this link fires, and that fault (None: all go)."""
        best_left, best = n, None
        for f in self._faults[d]:
            if f.every:
                left = f.at - (link.sent[d] - f.bases.get(link.serial, 0))
            else:
                left = f.at - self._pos[d]
            if max(0, left) < best_left:
                best_left, best = max(0, left), f
        return best_left, best

    def _apply_flips(self, d: Direction, data: bytearray, lo: int, hi: int) -> None:
        """(Lock held.) Flip the planned bits whose offsets fall in ``data[lo:hi]``."""
        plan = self._flips[d]
        if plan is None:
            return
        base = self._pos[d] - lo  # global offset of data[0]
        while plan.next_at < base + hi:
            j = plan.next_at - base
            if j >= lo:
                bit = plan.rng.randrange(8)
                data[j] ^= 1 << bit
                self.flips.append(Flip(d, plan.next_at, bit))
            plan.next_at += self._gap(plan.rng, plan.mean_gap)

    # -- lifetime --------------------------------------------------------------------------
    def drop_all(self) -> None:
        """Close every open connection now (the listener stays)."""
        with self._lock:
            links = list(self._links)
            self._links.clear()
            for link in links:
                link.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._released.notify_all()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the blocked accept()
        self._listener.close()
        self.drop_all()
        self._accepter.join(5)

    def __enter__(self) -> WireProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
