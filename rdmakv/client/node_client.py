"""KVClient: batched put/get/exists/delete against one KV node.

The client keeps the connection (connect, handshake, retry, drop), checks a
call's arguments before anything is sent, and hands a put or get to the
connection's transport, which owns how the batch moves
(:class:`~rdmakv.transport.base.Transport`): tcp by key, a PUT carrying the
values and a GET answer bringing them back; rdma by extent, ALLOC or LOOKUP
and then one-sided writes or reads (:mod:`rdmakv.transport.extents`). A
value whose stored digest differs from the digest the caller expects, or
whose bytes fail their checksum, is a miss: never wrong KV; the client
DELETEs the latter on the node so the next put stores a good copy.

Every wait is bounded by ``timeout`` (no progress for that long raises
:class:`~rdmakv.errors.TransportTimeout`). A connection failure raises a
:class:`~rdmakv.errors.TransportError` subclass and drops the connection; the
next call reconnects (``connect_retries`` attempts); a call that finds its
idle connection dead (the node restarted) retries once on a fresh one, so a
restarted node is picked up transparently. Callers that prefer misses catch
``RdmakvError``. Everything the node sends is treated as remote input: the
handshake limits are validated and clamped, and a looked-up value longer than
a slab block is a miss.

Ownership: the caller owns the slab blocks it passes and must keep them
referenced for the duration of the call; the client never incref/decrefs.
Thread-safe: calls are serialised on the one connection.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from rdmakv.blocks.slab import Slab
from rdmakv.defaults import DEFAULT_TIMEOUT
from rdmakv.errors import (
    AuthError,
    ConfigError,
    ConnectionLost,
    ProtocolError,
    RdmaError,
    RdmakvError,
    TransportError,
    TransportTimeout,
    UnknownOpcode,
    VersionMismatch,
)
from rdmakv.transport import Transport, get_transport, resolve_transport

# re-exported: how a transport splits a put/get
from rdmakv.transport.base import MIN_SUB_BATCH as MIN_SUB_BATCH
from rdmakv.transport.base import PIPELINE_WINDOW as PIPELINE_WINDOW
from rdmakv.transport.base import sub_batch_sizes as sub_batch_sizes
from rdmakv.transport.congestion import apply_congestion
from rdmakv.wire.batches import (
    BatchEncoder,
    decode_flags,
    decode_json,
    encode_keys,
    encode_report,
    encode_uniform_keys,
)
from rdmakv.wire.channel import Channel, wrap_socket_errors
from rdmakv.wire.format import (
    MAX_BULK_BYTES,
    MAX_KEYS_PER_REQUEST,
    MAX_PAYLOAD,
    PROTOCOL_VERSION,
    NodeInfo,
    Op,
    check_digests,
    check_keys,
    decode_node_info,
    encode_hello,
    version_mismatch,
)

log = logging.getLogger("rdmakv.client")
_T = TypeVar("_T")

DEFAULT_CONNECT_RETRIES = 3
RETRY_BACKOFF = 0.1
"""First pause between connection attempts (seconds); doubles each attempt."""


@runtime_checkable
class NodeClient(Protocol):
    """What the manager needs from its remote tier: one node, a cluster, another store.

:class:`KVClient` is the reference; every implementation keeps its contract:
lists in the caller's order, a digest mismatch is a miss, every wait bounded
by the client's timeout, bad arguments raise :class:`ConfigError` first.
"""

    @property
    def transport_name(self) -> str | None: ...

    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        nbytes: int | Sequence[int],
        digests: Sequence[bytes],
    ) -> list[bool]: ...

    def get(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[bool]: ...

    def get_sizes(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[int | None]: ...

    def exists(self, keys: Sequence[bytes]) -> list[bool]: ...

    def delete(self, keys: Sequence[bytes]) -> list[bool]: ...

    def stats(self) -> dict[str, Any]: ...

    def report(self, label: str, reason: str | None) -> bool: ...

    def close(self) -> None: ...


class KVClient:
    """Client of one KV node. ``slab`` may be None for a control-only client (stats)."""

    def __init__(
        self,
        host: str,
        port: int,
        slab: Slab | None,
        *,
        token: bytes | str | None = None,
        transport: str = "tcp",
        timeout: float = DEFAULT_TIMEOUT,
        connect_retries: int = DEFAULT_CONNECT_RETRIES,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        if connect_retries < 1:
            raise ConfigError(f"connect_retries must be >= 1, got {connect_retries}")
        self.host = host
        self.port = port
        self.slab = slab
        self.token = token.encode() if isinstance(token, str) else token
        self.timeout = timeout
        self.connect_retries = connect_retries
        self._want_transport = transport
        get_transport(transport) if transport != "auto" else None  # fail fast on a bad name
        self._lock = threading.RLock()
        self._ch: Channel | None = None
        self._tp: Transport | None = None
        self.info: NodeInfo | None = None
        self.transport_name: str | None = None
        self.reconnects = 0
        self._closed = False
        self.checksum_mismatches = 0
        """Values read back whose bytes failed their checksum (returned as misses)."""
        with self._lock:
            self._connect()

    # -- connection management ------------------------------------------------------------
    def _connect(self) -> None:
        delay = RETRY_BACKOFF
        last: Exception | None = None
        for attempt in range(self.connect_retries):
            try:
                self._connect_once()
                return
            except (AuthError, TransportTimeout, VersionMismatch):
                # A node that accepted but did not answer within the timeout is
                # stalled (SIGSTOP, overload), not starting: trying again would
                # multiply the wait; the caller's next call tries anew. A wrong
                # token or protocol version stays wrong however often we ask.
                self._drop()
                raise
            except (TransportError, ProtocolError, OSError) as e:
                last = e
                self._drop()
                if attempt + 1 < self.connect_retries:
                    time.sleep(delay)
                    delay *= 2
        if isinstance(last, TransportError):
            raise last
        raise ConnectionLost(
            f"cannot connect to rdmakv node {self.host}:{self.port} after "
            f"{self.connect_retries} attempts: {last}"
        ) from last

    def _connect_once(self) -> None:
        """Connect, handshake, set up the transport; on any failure nothing stays open."""
        what = f"connect to {self.host}:{self.port}"
        try:
            sock = socket.create_connection((self.host, self.port), timeout=self.timeout)
        except OSError as e:
            raise wrap_socket_errors(what, e) from e
        ch = Channel(sock)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            apply_congestion(sock)
            _, payload = ch.call(Op.HELLO, encode_hello(self.token), "HELLO")
            info = _sane_node_info(decode_node_info(payload))
            name = resolve_transport(self._want_transport, info.transports)
            try:
                tp = get_transport(name).client(ch, info, self.timeout)
            except RdmaError as e:  # RDMA set-up with this peer failed: auto falls back to TCP
                if self._want_transport != "auto" or "tcp" not in info.transports:
                    raise
                log.warning(
                    "rdma set-up with %s:%d failed (%s); using tcp", self.host, self.port, e
                )
                name = "tcp"
                tp = get_transport(name).client(ch, info, self.timeout)
            if self.slab is not None:
                tp.register_local(self.slab)
        except OSError as e:
            ch.close()
            raise wrap_socket_errors(what, e) from e
        except BaseException:
            ch.close()
            raise
        if self.info is not None and self.info.node_id != info.node_id:
            log.info("node %s:%d restarted; reconnected", self.host, self.port)
        self._ch, self._tp = ch, tp
        self.info, self.transport_name = info, name

    def _drop(self) -> None:
        if self._tp is not None:
            with contextlib.suppress(RdmakvError):
                self._tp.close()
        if self._ch is not None:
            self._ch.close()
        self._ch = self._tp = None

    def _conn(self) -> tuple[Channel, Transport]:
        if self._closed:
            raise ConfigError("KVClient is closed")
        if self._ch is None or self._tp is None:
            self.reconnects += 1
            self._connect()
        assert self._ch is not None and self._tp is not None
        self._ch.set_timeout(self.timeout)
        return self._ch, self._tp

    def _call(self, opcode: Op, payload: bytes, what: str, flags: int = 0) -> bytearray:
        ch, _ = self._conn()
        try:
            return ch.call(opcode, payload, what, flags=flags)[1]
        except OSError as e:
            self._drop()
            raise wrap_socket_errors(what, e) from e
        except (TransportError, ProtocolError):
            self._drop()  # the stream can no longer be trusted
            raise

    def _chunks(self, n: int) -> Iterator[tuple[int, int]]:
        step = self.info.max_keys if self.info else 1
        for s in range(0, n, step):
            yield s, min(n, s + step)

    def _retrying(self, fn: Callable[[], _T]) -> _T:
        """Run ``fn``; if a connection that was already open turns out dead, retry
        once on a fresh one. A node that restarted while we were idle closed our
        old socket: the first call after that should just work. Every op here is
        safe to repeat (a put of a key already stored reports True)."""
        reused = self._ch is not None
        try:
            return fn()
        except ConnectionLost:
            if not reused or self._closed:
                raise
            self._drop()
            log.info("connection to %s:%d lost; retrying on a new one", self.host, self.port)
            return fn()

    def _guard(self, exc: BaseException) -> None:
        """After a failure mid-operation: drop the connection unless the node merely refused."""
        if not isinstance(exc, RdmakvError) or isinstance(exc, TransportError | ProtocolError):
            self._drop()

    # -- API -----------------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        nbytes: int | Sequence[int],
        digests: Sequence[bytes],
    ) -> list[bool]:
        """Store slab blocks ``handles`` under ``keys``; True where the node now holds the key.

        ``nbytes`` is the value length (one for all, or per key), at most the
        node's block size. A key already present counts as stored; a key
        another client is writing right now, or no space, gives False.
        """
        return self.put_checked(
            keys, handles, check_put(self._need_slab(), keys, handles, nbytes, digests)
        )

    def put_checked(
        self, keys: Sequence[bytes], handles: Sequence[int], checked: CheckedPut
    ) -> list[bool]:
        """:meth:`put` of arguments :func:`check_put` has passed for this
        client's slab (``checked`` covers exactly ``keys``, as
        :meth:`CheckedPut.part` gives a run of a larger batch): nothing is
        checked again. A batch split across connections is checked once."""
        sizes, encoder = checked

        def run() -> list[bool]:
            _, tp = self._conn()
            try:
                done = tp.put(keys, handles, sizes, encoder, self.timeout)
                if done.refused is not None:
                    raise done.refused
                return done.ok
            except OSError as e:
                self._drop()
                raise wrap_socket_errors("put", e) from e
            except (TransportError, ProtocolError):
                self._drop()  # the stream can no longer be trusted
                raise

        with self._lock:
            return self._retrying(run)

    def get(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[bool]:
        """Fetch ``keys`` into slab blocks ``handles``, a block of its own per
        key (two keys naming one block are a ConfigError); True per hit.

        A stored digest different from ``digests[i]`` is a miss (block left as is).
        """
        return [n is not None for n in self.get_sizes(keys, handles, digests)]

    def get_sizes(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[int | None]:
        """Like :meth:`get` but returns the value length per hit (None per miss)."""
        encoder = check_get(self._need_slab(), keys, handles, digests)
        return self.get_checked(keys, handles, digests, encoder)

    def get_checked(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        digests: Sequence[bytes],
        encoder: BatchEncoder,
    ) -> list[int | None]:
        """:meth:`get_sizes` of arguments :func:`check_get` has passed for this
        client's slab, ``encoder`` the one it returned for exactly ``keys``
        (or its :meth:`~rdmakv.wire.batches.BatchEncoder.part` for them): nothing
        is checked again."""

        def run() -> list[int | None]:
            ch, tp = self._conn()
            try:
                got = tp.get(keys, handles, digests, encoder, self.timeout)
                if got.corrupt:
                    self._drop_corrupt(ch, got.corrupt)
                if got.refused is not None:
                    raise got.refused
                return got.sizes
            except OSError as e:
                self._drop()
                raise wrap_socket_errors("get", e) from e
            except BaseException as e:  # a signal handler's too: an answer may be half read
                self._guard(e)
                raise

        with self._lock:
            return self._retrying(run)

    def _drop_corrupt(self, ch: Channel, keys: list[bytes]) -> None:
        """Values whose bytes did not match their checksum were misses; DELETE them so
        the next put stores a good copy (a put of a present key would keep the bad one)."""
        self.checksum_mismatches += len(keys)
        log.warning(
            "get: %d values from %s:%d failed their checksum (corrupted on the wire or "
            "in the node's pool); returned as misses and deleted on the node",
            len(keys), self.host, self.port,
        )
        for s, e in self._chunks(len(keys)):
            ch.send_nowait(Op.DELETE, encode_keys(keys[s:e]))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed on the node (one round trip per batch)."""
        return self._flags_op(Op.EXISTS, keys, "EXISTS")

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove keys; True per key that was present."""
        return self._flags_op(Op.DELETE, keys, "DELETE")

    def _flags_op(self, opcode: Op, keys: Sequence[bytes], what: str) -> list[bool]:
        # A scheduler waits for this answer. On an open connection, keys of one
        # length go out and their answer comes back in one native call; else
        # the keys are checked and encoded in one set of passes (check_keys
        # only names a bad key, or passes keys of several lengths to the
        # per-key encoder).
        def run() -> list[bool]:
            flags = self._native_flags(opcode, keys, what) if keys else None
            if flags is not None:
                return flags
            whole = encode_uniform_keys(keys)
            if whole is None:
                check_keys(keys)
            if not keys:  # nothing to ask: no round trip (a stalled node must not delay it)
                return []
            try:
                if self.info is not None and len(keys) <= self.info.max_keys:  # one request
                    payload = whole if whole is not None else encode_keys(keys)
                    return decode_flags(self._call(opcode, payload, what), len(keys), what)
                out: list[bool] = []
                for s, e in self._chunks(len(keys)):
                    chunk = keys[s:e]
                    reply = self._call(opcode, encode_keys(chunk), what)
                    out.extend(decode_flags(reply, len(chunk), what))
                return out
            except ProtocolError:
                self._drop()  # an answer that does not fit its request: as _call does
                raise

        with self._lock:
            return self._retrying(run)

    def _native_flags(self, opcode: Op, keys: Sequence[bytes], what: str) -> list[bool] | None:
        """:meth:`_flags_op` of one request on the open connection in one native
        call (:meth:`Channel.call_flags`); None where that does not apply (no
        connection yet, more keys than one request takes, keys it leaves to
        Python). A connection found dead is a ConnectionLost, which
        :meth:`_retrying` asks again on a new one."""
        ch = self._ch
        if ch is None or self.info is None or len(keys) > self.info.max_keys:
            return None
        try:
            return ch.call_flags(opcode, keys, what, self.timeout)
        except BaseException as e:  # a signal handler raising too: the answer maybe unread
            self._guard(e)  # the node's error answer, read whole, keeps the connection
            if isinstance(e, OSError):  # ConnectionLost is one too
                raise wrap_socket_errors(what, e) from e
            raise

    def stats(self) -> dict[str, Any]:
        """The node's counters and gauges (see ``rdmakv stats``)."""
        with self._lock:
            return self._retrying(
                lambda: decode_json(self._call(Op.STATS, b"", "STATS"), "STATS response")
            )

    def report(self, label: str, reason: str | None) -> bool:
        """Tell the node namespace ``label`` is quarantined here for ``reason`` (None:
        cleared); False when the node predates REPORT (rdmakv.wire.format)."""
        payload = encode_report(label, reason)
        with self._lock:
            try:
                self._retrying(lambda: self._call(Op.REPORT, payload, "REPORT"))
            except UnknownOpcode:
                return False
        return True

    def close(self) -> None:
        with self._lock:
            self._drop()
            self._closed = True

    def __enter__(self) -> KVClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _need_slab(self) -> Slab:
        if self.slab is None:
            raise ConfigError("this KVClient has no slab: pass one to put/get blocks")
        return self.slab

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("connected" if self._ch else "disconnected")
        return f"KVClient({self.host}:{self.port}, transport={self.transport_name}, {state})"


def _sane_node_info(info: NodeInfo) -> NodeInfo:
    """Refuse a handshake whose numbers would make this client misbehave, and
    never use limits above this client's own (the node's figures are remote input)."""
    if info.version != PROTOCOL_VERSION:
        raise VersionMismatch(version_mismatch(info.version, PROTOCOL_VERSION))
    for name in ("block_size", "max_keys", "max_bulk", "max_payload"):
        if getattr(info, name) < 1:
            raise ProtocolError(f"node reported {name}={getattr(info, name)}: must be >= 1")
    return dataclasses.replace(
        info,
        max_keys=min(info.max_keys, MAX_KEYS_PER_REQUEST),
        max_bulk=min(info.max_bulk, MAX_BULK_BYTES),
        max_payload=min(info.max_payload, MAX_PAYLOAD),
    )


class CheckedPut(NamedTuple):
    """A put's arguments once :func:`check_put` passed them."""

    sizes: list[int]
    """The value length per key."""
    encoder: BatchEncoder
    """The call's request records (its checks were made on the way): the
    transport lays its sub-batches out from it, not from the lists again."""

    def part(self, start: int, end: int) -> CheckedPut:
        """The checked arguments of keys ``[start, end)`` of the put."""
        return CheckedPut(self.sizes[start:end], self.encoder.part(start, end))


def check_put(
    slab: Slab,
    keys: Sequence[bytes],
    handles: Sequence[int],
    nbytes: int | Sequence[int],
    digests: Sequence[bytes],
) -> CheckedPut:
    """The checks of a put's arguments every :class:`NodeClient` makes before
    sending anything."""
    sizes = [nbytes] * len(keys) if isinstance(nbytes, int) else list(nbytes)
    same_len(keys, handles=handles, nbytes=sizes, digests=digests)
    encoder = _checked_encoder(keys, digests, sizes)
    slab.check_handles(handles)
    distinct = (nbytes,) if isinstance(nbytes, int) else sizes  # one check for one size
    if sizes and not (min(distinct) > 0 and max(distinct) <= slab.block_size):
        bad = next(n for n in distinct if not (0 < n <= slab.block_size))
        raise ConfigError(f"nbytes {bad} outside (0, slab block size {slab.block_size}]")
    return CheckedPut(sizes, encoder)


def check_get(
    slab: Slab, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
) -> BatchEncoder:
    """The checks of a get's arguments every :class:`NodeClient` makes first;
    the call's request records, laid out on the way (see :class:`CheckedPut`)."""
    same_len(keys, handles=handles, digests=digests)
    encoder = _checked_encoder(keys, digests)
    slab.check_handles(handles)
    _check_distinct(handles)
    return encoder


def _check_distinct(handles: Sequence[int]) -> None:
    """ConfigError naming a block that two keys of a get would land in: each
    value is checked against its checksum once its bytes are in, and another
    value landing in the same block first would fail that check, so a good
    value would be reported corrupt (and deleted on the node)."""
    if len(set(handles)) == len(handles):
        return
    first: dict[int, int] = {}
    for i, h in enumerate(handles):
        if h in first:
            raise ConfigError(
                f"block handle {h} is named twice (#{first[h]} and #{i}): "
                "each key of a get needs a block of its own"
            )
        first[h] = i


def _checked_encoder(
    keys: Sequence[bytes], digests: Sequence[bytes], sizes: Sequence[int] | None = None
) -> BatchEncoder:
    """The batch's encoder, once its keys and digests are known to be valid.
    An engine's batch (one key length, ``bytes`` throughout) is checked by the
    encoder's own C-level passes (:attr:`BatchEncoder.uniform`); only another
    one is checked key by key, which names a bad key or digest. The sizes are
    checked by the caller: a uniform encoder only vouches for them fitting
    their field, not for the slab's block size."""
    encoder = BatchEncoder(keys, digests, sizes)
    if not encoder.uniform:
        check_keys(keys)
        check_digests(digests)
    return encoder


def same_len(keys: Sequence[bytes], **others: Sequence[Any]) -> None:
    """ConfigError unless every sequence of ``others`` is as long as ``keys``."""
    for name, seq in others.items():
        if len(seq) != len(keys):
            raise ConfigError(f"{len(keys)} keys but {len(seq)} {name}")
