"""The node side of the ``rdma`` transport: :class:`RdmaNodeDataPath`.

The pool is registered once at start; each session that sends
``RDMA_CONNECT`` gets its own queue pair (and, where the device has them,
memory windows confining it to its leased extents), destroyed when the
session ends or on ``RDMA_DISCONNECT``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence

from rdmakv.blocks.slab import Slab
from rdmakv.errors import (
    RdmakvError,
    RdmaUnavailable,
)
from rdmakv.transport.base import (
    CONFINE_WINDOWS,
    ExtentGuard,
    NodeDataPath,
    NodeHandler,
    NodeSession,
)
from rdmakv.transport.rdma import verbs
from rdmakv.transport.rdma.device import SharedDevice
from rdmakv.wire.batches import decode_json, encode_json
from rdmakv.wire.format import Header, Op

log = logging.getLogger("rdmakv.rdma")


class _Window:
    """One bound window of a session over [addr, addr+length), shared by the
    ``count`` extent grants it covers (contiguous extents of one grant call
    share a window, so their ops still gather into one WR)."""

    __slots__ = ("addr", "count", "length", "window", "write")

    def __init__(self, window: verbs.MemoryWindow, addr: int, length: int, write: bool) -> None:
        self.window = window
        self.addr = addr
        self.length = length
        self.write = write
        self.count = 0


class _NodeSession:
    """Node-side RDMA state of one session: its QP and the windows bound on it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()  # serialises QP use (binds) and the grant table
        self.qp: verbs.QueuePair | None = None
        # (extent addr, write) -> the windows granting it, one entry per grant
        self.grants: dict[tuple[int, bool], list[_Window]] = {}
        self.windows: set[_Window] = set()


def _runs(extents: Sequence[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """Contiguous runs of extents, as (addr, length, indexes), in address order."""
    order = sorted(range(len(extents)), key=lambda i: extents[i][0])
    runs: list[tuple[int, int, list[int]]] = []
    for i in order:
        addr, length = extents[i]
        if runs and runs[-1][0] + runs[-1][1] == addr:
            lo, n, idx = runs[-1]
            idx.append(i)
            runs[-1] = (lo, n + length, idx)
        elif runs and runs[-1][0] == addr and runs[-1][1] >= length:
            runs[-1][2].append(i)  # the same extent twice in one call
        else:
            runs.append((addr, length, [i]))
    return runs


BIND_TIMEOUT_S = 10.0
"""Bound on one batch of window binds (soft-RoCE under emulation is slow)."""


class RdmaNodeDataPath(NodeDataPath):
    """Node side: the pool is registered once; one QP per connected session.

    Confinement ``windows`` (the default): the pool MR grants no remote access
    through its own rkey; every extent the store hands a session is reached
    through a type-2 memory window bound on THAT session's QP (so another
    client cannot use its rkey) and deallocated when the session loses the
    extent (commit/abort for writes, release/expiry for reads, disconnect).
    Devices without type-2 windows refuse to start in this mode. ``none``:
    the old behaviour, one MR with remote read+write whose rkey every client
    learns (any client can read/write the whole pool).

    Caveat (soft-RoCE/rxe, checked on Linux 6.1 and current sources): rxe
    checks a window's rkey, QP and lifetime but not its address range (only
    the underlying MR's), so there a session holding any live window can
    reach the whole pool; hardware HCAs check the window's range.

    Lock order: the store's lock, then a session's lock (grant/revoke come
    from the store); connect/drop take only the session's lock.
    """

    name = "rdma"

    def __init__(self, pool: Slab, *, confinement: str = CONFINE_WINDOWS) -> None:
        super().__init__(pool, confinement=confinement)
        self._dev = SharedDevice.acquire()
        self.windows = confinement == CONFINE_WINDOWS
        if self.windows and not self._dev.supports_windows:
            raise RdmaUnavailable(
                f"{self._dev.sel.device} does not support type-2 memory windows, which "
                "rdma_confinement='windows' needs to confine each client to its own extents; "
                "set rdma_confinement='none' to serve RDMA with one pool-wide rkey (any "
                "client can then read and write the whole pool)"
            )
        self._mr = self._dev.register(pool.base_addr, pool.nbytes, owner=pool, windows=self.windows)
        self._lock = threading.Lock()
        self._sessions: dict[int, _NodeSession] = {}
        log.info(
            "rdma data path: confinement %s%s", confinement,
            " (per-extent memory windows)" if self.windows else " (one pool-wide rkey)",
        )

    @property
    def rkey(self) -> int:
        return 0 if self.windows else self._mr.rkey

    @property
    def device(self) -> verbs.Device:
        return self._dev

    @property
    def guard(self) -> ExtentGuard | None:
        return self if self.windows else None

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.RDMA_CONNECT: self._connect, Op.RDMA_DISCONNECT: self._disconnect}

    def _session(self, session_id: int, create: bool) -> _NodeSession | None:
        with self._lock:
            s = self._sessions.get(session_id)
            if s is None and create:
                s = self._sessions[session_id] = _NodeSession()
            return s

    def _connect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        remote = verbs.ConnInfo.from_dict(decode_json(bytes(payload), "RDMA_CONNECT").get("conn"))
        qp = self._dev.create_qp()
        try:
            qp.connect(remote)
            mine = qp.local_info(self._mr)
        except BaseException:
            qp.close()
            raise
        s = self._session(session.session_id, create=True)
        assert s is not None
        remap: list[list[int]] = []
        with s.lock:
            old, s.qp = s.qp, qp
            if s.windows:
                # A reconnect (the client's recovery from a QP error): the windows
                # of the old QP die with it; rebind what the session still holds
                # on the new one and tell the client its extents' new rkeys.
                remap = self._rebind(s, qp)
            if old is not None:
                old.close()  # its windows are closed first (see QueuePair.close)
        session.one_sided = True
        reply: dict[str, object] = {"conn": mine.to_dict()}
        if remap:
            reply["remap"] = remap
        session.reply(req, encode_json(reply))

    def _rebind(self, s: _NodeSession, qp: verbs.QueuePair) -> list[list[int]]:
        """New windows on ``qp`` for every live window of ``s`` (session lock held)."""
        remap: list[list[int]] = []
        for write in (False, True):
            wins = [w for w in s.windows if w.write == write]
            if not wins:
                continue
            fresh = [self._dev.alloc_window() for _ in wins]
            status = qp.bind_windows(
                self._mr, fresh, [(w.addr, w.length) for w in wins],
                read=not write, write=write, timeout=BIND_TIMEOUT_S,
            )
            failed = 0
            for w, new, st in zip(wins, fresh, status, strict=True):
                old_rkey = w.window.rkey
                w.window.close()
                if st != verbs.ST_OK:
                    new.close()  # its extents' accesses now fail: misses, never wrong data
                    failed += 1
                    continue
                w.window = new
                remap.append([old_rkey, new.rkey])
            if failed:
                log.warning(
                    "rdma: %d of %d windows could not be bound again on a reconnected QP "
                    "(first: %s); the client's reads or writes of those extents fail",
                    failed, len(wins), verbs.status_name(next(x for x in status if x)),
                )
        return remap

    # -- ExtentGuard (called by the store with its lock held) ---------------------
    def grant(self, session: int, extents: Sequence[tuple[int, int]], *, write: bool) -> list[int]:
        out = [0] * len(extents)
        s = self._session(session, create=False)
        if s is None or not extents:
            return out  # not an RDMA session: the tcp path checks its ops itself
        with s.lock:
            qp = s.qp
            if qp is None:
                return out
            runs = _runs(extents)
            try:
                fresh = [self._dev.alloc_window() for _ in runs]
            except RdmakvError as e:
                log.warning("rdma: cannot allocate memory windows: %s", e)
                return out
            try:
                status = qp.bind_windows(
                    self._mr, fresh, [(lo, n) for lo, n, _ in runs],
                    read=not write, write=write, timeout=BIND_TIMEOUT_S,
                )
            except RdmakvError as e:
                log.warning("rdma: binding memory windows failed: %s", e)
                status = [verbs.ST_POST_FAILED] * len(fresh)
            failed = 0
            for (lo, n, idx), mw, st in zip(runs, fresh, status, strict=True):
                if st != verbs.ST_OK:
                    mw.close()
                    failed += 1
                    continue
                w = _Window(mw, lo, n, write)
                s.windows.add(w)
                for i in idx:
                    s.grants.setdefault((extents[i][0], write), []).append(w)
                    w.count += 1
                    out[i] = mw.rkey
            if failed:
                log.warning(
                    "rdma: %d of %d window binds failed (first: %s); those extents get no rkey",
                    failed, len(runs), verbs.status_name(next(x for x in status if x)),
                )
        return out

    def revoke(self, session: int, addrs: Sequence[int], *, write: bool) -> None:
        s = self._session(session, create=False)
        if s is None:
            return
        with s.lock:
            for addr in addrs:
                stack = s.grants.get((addr, write))
                if not stack:
                    continue
                w = stack.pop()
                if not stack:
                    del s.grants[(addr, write)]
                w.count -= 1
                if w.count <= 0:
                    w.window.close()  # ibv_dealloc_mw: revoked now, whatever the QP state
                    s.windows.discard(w)

    # -- sessions -------------------------------------------------------------------
    def _disconnect(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        self._drop(session.session_id)
        session.one_sided = False
        session.reply(req)

    def _drop(self, session_id: int) -> None:
        with self._lock:
            s = self._sessions.pop(session_id, None)
        if s is None:
            return
        with s.lock:
            for w in s.windows:
                w.window.close()
            s.windows.clear()
            s.grants.clear()
            if s.qp is not None:
                s.qp.close()
                s.qp = None

    @property
    def sessions(self) -> int:
        with self._lock:
            return sum(1 for s in self._sessions.values() if s.qp is not None)

    def session_closed(self, session: NodeSession) -> None:
        self._drop(session.session_id)

    def close(self) -> None:
        with self._lock:
            ids = list(self._sessions)
        for sid in ids:
            self._drop(sid)
        self._mr.close()  # the pool is going away with the node
