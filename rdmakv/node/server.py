"""KVNode: the ``rdmakv serve`` process -- listener, sessions, request dispatch.

One thread per client connection (a *session*). The first frame must be
HELLO (version + optional shared-secret token, compared in constant time);
then requests are served in order through a dispatch table ``opcode ->
handler``: the control ops below plus whatever the enabled transports'
:class:`~rdmakv.transport.base.NodeDataPath` objects claim (GET/PUT for tcp,
RDMA_CONNECT for rdma), so a transport adds opcodes without touching
this module.

A bad request gets an error response naming what was wrong and the session
keeps serving; the connection closes after any error answer to the handshake,
and after an answer whose status is in :data:`~rdmakv.wire.format.FATAL_STATUSES`
(a header announcing more than the protocol limits): :meth:`Session.fail`.
Nothing a client sends can touch another client's data: no request names a
pool address (GET and PUT name keys), and one-sided access is confined by the
data path to the extents handed to that session (rdma: memory windows). When
a session ends, its uncommitted extents and leases are reclaimed.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from rdmakv.blocks.slab import Slab
from rdmakv.defaults import (
    DEFAULT_HOST,
    DEFAULT_LEASE_TIMEOUT,
    DEFAULT_MAX_LEASES_PER_BLOCK,
    DEFAULT_PORT,
)
from rdmakv.errors import (
    ConfigError,
    ProtocolError,
    RdmakvError,
)
from rdmakv.metrics.http import MetricsServer
from rdmakv.metrics.node import REFUSAL_REASONS, NodeMetrics
from rdmakv.node.admission import Admission, SessionLimits
from rdmakv.node.session import POLL_INTERVAL, Session
from rdmakv.node.store import KVStore
from rdmakv.transport import NodeDataPath, NodeHandler, NodeSession, get_transport
from rdmakv.transport.base import CONFINE_WINDOWS
from rdmakv.transport.congestion import apply_congestion
from rdmakv.wire.batches import (
    MAX_REPORTED_NAMESPACES,
    decode_alloc_request,
    decode_commit_request,
    decode_keys,
    decode_keys_request,
    decode_report,
    decode_u64_list,
    encode_extent_table,
    encode_flag_bytes,
    encode_flags,
    encode_json,
    encode_lookup_results,
)
from rdmakv.wire.format import (
    COMMIT_FLAG_REQUIRE_WRITTEN,
    LOOKUP_FLAG_LEASE,
    MAX_BULK_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    U32,
    Header,
    NodeInfo,
    Op,
)

log = logging.getLogger("rdmakv.node")

SWEEP_INTERVAL_S = 0.5
"""How often the accept loop closes connections past the handshake deadline or idle timeout."""

SHUTDOWN_JOIN_TIMEOUT = 5.0
"""How long shutdown waits for each session thread after waking it."""

KEEPALIVE_IDLE_S = 60

KEEPALIVE_INTERVAL_S = 10

KEEPALIVE_PROBES = 3

_KEEPALIVE = [
    (opt, value)
    for name, value in (
        ("TCP_KEEPIDLE", KEEPALIVE_IDLE_S),
        ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
        ("TCP_KEEPCNT", KEEPALIVE_PROBES),
    )
    if (opt := getattr(socket, name, None)) is not None
]

LISTEN_BACKLOG = 128

NODE_ID_LEN = 16


class KVNode:
    """A KV node serving one pool: ``start()`` binds, ``serve_forever()`` runs until ``stop()``."""

    def __init__(
        self,
        *,
        pool_size: int,
        block_size: int,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        transports: Sequence[str] = ("tcp",),
        lease_timeout: float = DEFAULT_LEASE_TIMEOUT,
        token: bytes | None = None,
        lock_pool: bool = True,
        optional_transports: bool = False,
        metrics_host: str = DEFAULT_HOST,
        metrics_port: int | None = None,
        session_limits: SessionLimits | None = None,
        lease_quota_bytes: int | None = None,
        max_leases_per_block: int = DEFAULT_MAX_LEASES_PER_BLOCK,
        rdma_confinement: str = CONFINE_WINDOWS,
    ) -> None:
        """``rdma_confinement``: ``"windows"`` (default) confines each RDMA client to
        the extents handed to it (per-extent memory windows; a device without them
        cannot serve rdma); ``"none"`` exposes the whole pool to every RDMA client.

        ``optional_transports``: a data path beyond tcp that fails to come up
        (e.g. ``auto`` found a device but registering the pool failed) is logged
        with its reason and left out, instead of failing the node's start.

        ``metrics_port`` (None = off, 0 = any free port): serve ``/metrics``,
        ``/healthz`` and ``/readyz`` there (:mod:`rdmakv.metrics.node`). It
        starts first, so probes see the node alive but not ready while a large
        pool is still being pinned and registered.

        ``session_limits``: connection hygiene (:mod:`rdmakv.node.admission`).
        ``lease_quota_bytes`` (default: half the pool) and ``max_leases_per_block``
        bound what one session may pin with read leases (:class:`KVStore`).
        """
        self.admission = Admission(session_limits or SessionLimits())
        self._last_sweep = 0.0
        self.host = host
        self.port = port
        self.token = token or None
        self.node_id = os.urandom(NODE_ID_LEN)
        self._ready = False
        self.transports: tuple[str, ...] = ()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._counts: dict[str, int] = {
            "sessions_total": 0,
            "protocol_errors": 0,
            "bytes_leased_one_sided": 0,
            "exists_native": 0,  # EXISTS answered by the native loop (node/native_loop.py)
            **{f"refused_{r}": 0 for r in REFUSAL_REASONS},
        }
        self._reported: dict[str, dict[str, Any]] = {}
        """Namespaces clients reported quarantined (REPORT), oldest first; in STATS."""
        self.request_timers: dict[int, Callable[[float], None]] = {}
        """opcode -> histogram observe; empty when metrics are off (no cost then)."""
        self.metrics: NodeMetrics | None = None
        self.metrics_server: MetricsServer | None = None
        if metrics_port is not None:
            self.metrics = NodeMetrics(
                # Scrapes may come while the pool is still being pinned: no store yet.
                lambda: self.stats() if hasattr(self, "store") else dict(self._counts),
                lambda: self._ready,
                lambda: {
                    "version": str(PROTOCOL_VERSION),
                    "node_id": self.node_id.hex(),
                    "transports": ",".join(self.transports),
                },
            )
            self.metrics_server = MetricsServer(
                self.metrics.registry, host=metrics_host, port=metrics_port,
                ready=lambda: self._ready,
            )
        try:
            self._init_pool(
                pool_size, block_size, transports, lock_pool, optional_transports, rdma_confinement
            )
            self.store = KVStore(
                self.pool,
                lease_timeout=lease_timeout,
                rkey=next((dp.rkey for dp in self.datapaths if dp.rkey), 0),
                lease_quota_bytes=lease_quota_bytes,
                max_leases_per_block=max_leases_per_block,
                guard=next((dp.guard for dp in self.datapaths if dp.guard), None),
            )
            self._init_handlers()
        except BaseException:
            if self.metrics_server is not None:
                self.metrics_server.close()
            raise
        if self.metrics is not None:
            self.request_timers = {
                op: self.metrics.request_timer(_op_label(op)) for op in self.handlers
            }
        self._sessions: dict[int, tuple[Session, threading.Thread]] = {}
        self._next_session = 1
        self._listener: socket.socket | None = None
        self._started = time.monotonic()

    def _init_pool(
        self,
        pool_size: int,
        block_size: int,
        transports: Sequence[str],
        lock_pool: bool,
        optional_transports: bool,
        rdma_confinement: str = CONFINE_WINDOWS,
    ) -> None:
        self.pool = Slab(pool_size, block_size, lock=lock_pool, shared_refcounts=True)
        names = list(dict.fromkeys(["tcp", *transports]))  # tcp always serves control + fallback
        self.datapaths: list[NodeDataPath] = []
        for name in names:
            try:
                self.datapaths.append(
                    get_transport(name).node(self.pool, confinement=rdma_confinement)
                )
            except RdmakvError as e:
                if name == "tcp" or not optional_transports:
                    raise
                log.warning("transport %s unavailable, serving without it: %s", name, e)
        self.transports = tuple(dp.name for dp in self.datapaths)
        self.native_get = any(dp.native_get for dp in self.datapaths)
        """Whether sessions' native loops may answer GET (see NodeDataPath.native_get)."""

    def _init_handlers(self) -> None:
        self.handlers: dict[int, NodeHandler] = {
            Op.ALLOC: self._alloc,
            Op.COMMIT: self._commit,
            Op.ABORT: self._abort,
            Op.LOOKUP: self._lookup,
            Op.RELEASE: self._release,
            Op.DELETE: self._delete,
            Op.EXISTS: self._exists,
            Op.STATS: self._stats,
            Op.REPORT: self._report,
        }
        for dp in self.datapaths:
            for op, h in dp.handlers().items():
                if op in self.handlers:
                    raise ConfigError(f"transport {dp.name!r} claims opcode {op} already in use")
                self.handlers[op] = h

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    @property
    def ready(self) -> bool:
        """Pool registered and the listener accepting clients (``/readyz``)."""
        return self._ready

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + n

    def refuse(self, reason: str) -> None:
        """Count a refused request or connection (``rdmakv_node_refused_total{reason}``)."""
        self.count(f"refused_{reason}")

    def info(self, session_id: int) -> NodeInfo:
        return NodeInfo(
            version=PROTOCOL_VERSION,
            rkey=self.store.rkey,
            block_size=self.pool.block_size,
            pool_base=self.pool.base_addr,
            pool_len=self.pool.nbytes,
            node_id=self.node_id,
            session_id=session_id,
            max_payload=MAX_PAYLOAD,
            max_keys=MAX_KEYS_PER_REQUEST,
            max_bulk=MAX_BULK_BYTES,
            transports=self.transports,
        )

    # -- lifecycle ------------------------------------------------------------------
    def start(self) -> tuple[str, int]:
        """Bind and listen; returns the bound (host, port) (port 0 picks a free one)."""
        ls = socket.create_server((self.host, self.port), backlog=LISTEN_BACKLOG, reuse_port=False)
        ls.settimeout(POLL_INTERVAL)
        self._listener = ls
        self.host, self.port = ls.getsockname()[:2]
        return self.host, self.port

    def serve_forever(self) -> None:
        if self._listener is None:
            self.start()
        ls = self._listener
        assert ls is not None
        self._ready = True
        try:
            while not self._stop.is_set():
                try:
                    sock, addr = ls.accept()
                except TimeoutError:
                    self._sweep()
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                self._admit(sock, addr)
                self._sweep()
        finally:
            self._shutdown()

    def _admit(self, sock: socket.socket, addr: tuple[str, int]) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        apply_congestion(sock)  # this end sends every GET's values
        # A client whose machine vanished never sends FIN: keepalive ends its
        # session, so its uncommitted extents and leases are reclaimed.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for opt, value in _KEEPALIVE:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, opt, value)
        with self._lock:
            sid = self._next_session
            self._next_session += 1
            session = Session(self, sid, sock, addr[0], addr[1])
            admitted, shed = self.admission.admit(session, time.monotonic())
            self._counts["refused_over_limit"] += len(shed) + (0 if admitted else 1)
            if admitted:
                self._counts["sessions_total"] += 1
                t = threading.Thread(target=session.run, name=f"rdmakv-session-{sid}", daemon=True)
                self._sessions[sid] = (session, t)
        for victim in shed:
            log.info("closing %s to admit %s (connection limits)", victim.peer, session.peer)
            victim.shed()
        if not admitted:
            log.warning("refusing %s: every connection slot is busy", session.peer)
            sock.close()
            return
        log.debug("session %d from %s", sid, session.peer)
        t.start()

    def _sweep(self) -> None:
        """Close connections past the handshake deadline or the idle timeout."""
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_INTERVAL_S:
            return
        self._last_sweep = now
        with self._lock:
            late = self.admission.expired(now)
            self._counts["refused_timeout"] += len(late)
        for conn, _ in late:
            why = "idle timeout" if conn.authenticated else "handshake deadline passed"
            log.info("closing %s: %s", conn.peer, why)
            conn.shed()

    def session_ended(self, session: Session) -> None:
        # Data paths first: once the session's RDMA QP is gone no remote write
        # can land, so its uncommitted extents are safe to free and reuse.
        for dp in self.datapaths:
            try:
                dp.session_closed(session)
            except Exception:
                log.exception(
                    "data path %s failed to tear down session %d", dp.name, session.session_id
                )
        self.store.session_closed(session.session_id)
        session.channel.close()
        with self._lock:
            self._sessions.pop(session.session_id, None)
            self.admission.remove(session)

    def stop(self) -> None:
        """Ask the node to stop (safe from a signal handler): sessions end within POLL_INTERVAL."""
        self._stop.set()

    def _shutdown(self) -> None:
        self._ready = False
        self._stop.set()
        if self._listener is not None:
            self._listener.close()
        with self._lock:
            sessions = list(self._sessions.values())
        for session, _ in sessions:
            # Wakes a session blocked mid-frame on a stalled client, so shutdown
            # does not wait for IO_TIMEOUT; idle sessions notice the flag anyway.
            with contextlib.suppress(OSError):
                session.channel.sock.shutdown(socket.SHUT_RDWR)
        for _, t in sessions:
            t.join(SHUTDOWN_JOIN_TIMEOUT)
        for dp in self.datapaths:
            dp.close()
        self.pool.close()
        if self.metrics_server is not None:
            self.metrics_server.close()
        log.info("node stopped")

    # -- control handlers ----------------------------------------------------------------
    def _alloc(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_alloc_request(payload)
        s.reply(req, encode_extent_table(self.store.alloc_table(s.session_id, request)))

    def _commit(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_commit_request(payload)
        strict = bool(req.flags & COMMIT_FLAG_REQUIRE_WRITTEN)
        done = self.store.commit(s.session_id, request.keys, request.checksums,
                                 require_written=strict)
        s.reply(req, encode_flags(done))

    def _abort(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        keys = decode_keys(payload, "ABORT")
        s.reply(req, encode_flags(self.store.abort(s.session_id, keys)))

    def _lookup(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        keys = decode_keys(payload, "LOOKUP")
        lease = bool(req.flags & LOOKUP_FLAG_LEASE)
        found = self.store.lookup(s.session_id, keys, lease)
        if lease and s.one_sided:  # the bytes will move by RDMA READ, not through us
            self.count("bytes_leased_one_sided", sum(r.extent.length for r in found if r))
        s.reply(req, encode_lookup_results(found))

    def _release(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        ids = decode_u64_list(payload, "RELEASE")
        s.reply(req, U32.pack(self.store.release(s.session_id, ids)))

    def _delete(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        keys = decode_keys(payload, "DELETE")
        s.reply(req, encode_flags(self.store.delete(keys)))

    def _exists(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        flags = self.store.exists_flags(decode_keys_request(payload, "EXISTS"))
        s.reply(req, encode_flag_bytes(flags))

    def _stats(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        if payload:
            raise ProtocolError(f"STATS takes no payload, got {len(payload)} bytes")
        s.reply(req, encode_json(self.stats()))

    def _report(self, s: NodeSession, req: Header, payload: bytearray) -> None:
        """A client's quarantine report (rdmakv.wire.format, REPORT): kept for STATS only."""
        label, reason = decode_report(payload)
        with self._lock:
            old = self._reported.pop(label, None)
            if reason is not None:
                self._reported[label] = {
                    "reason": reason,
                    "reports": (old or {}).get("reports", 0) + 1,
                    "reported_at": round(time.time(), 3),
                }
                while len(self._reported) > MAX_REPORTED_NAMESPACES:
                    del self._reported[next(iter(self._reported))]
        if reason is not None:
            log.warning("a client quarantined namespace %s: %s", label, reason)
        else:
            log.info("a client cleared its quarantine of namespace %s", label)
        s.reply(req, b"")

    def stats(self) -> dict[str, Any]:
        out = self.store.stats()
        with self._lock:
            out.update(self._counts)
            out["sessions_active"] = len(self._sessions)
            out["quarantined_namespaces"] = {k: dict(v) for k, v in self._reported.items()}
        out.update(
            protocol_version=PROTOCOL_VERSION,
            transports=list(self.transports),
            node_id=self.node_id.hex(),
            uptime_s=round(time.monotonic() - self._started, 3),
        )
        return out


def _op_label(opcode: int) -> str:
    try:
        return Op(opcode).name.lower()
    except ValueError:
        return f"op{opcode}"
