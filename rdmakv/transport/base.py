"""The transport interface: how a client's put/get moves a batch, and what the node serves.

Client side (:class:`Transport`): one connection's data path, built over the
authenticated control channel. Each transport owns its put/get strategy:
``tcp`` names keys, its PUT carrying the values and its GET answer bringing
them back (:mod:`rdmakv.transport.tcp`); a one-sided transport (``rdma``)
ALLOCs or LOOKUPs extents and moves the bytes itself, batches of
:class:`IoOp` -- ``(local_offset into the slab, absolute remote address
inside the node's pool, length, rkey)`` -- or the same rows as one
:data:`OpTable` (:mod:`rdmakv.transport.extents`). Every wait is bounded by a
timeout.

Node side (:class:`NodeDataPath`): what the node does per transport. It may
claim opcodes (``handlers``) that the node's dispatch table routes to it, e.g.
GET/PUT for tcp, ``Op.RDMA_CONNECT`` for rdma, and is told when a session
ends. A handler gets a :class:`NodeSession`, through which it reaches the
store on behalf of *that* session.

Ownership: slab blocks named by a put or get, or by an in-flight op, stay
referenced by the caller until it returns or the future completes. Remote
extents stay valid for writes until commit/abort/disconnect, for reads until
the lease is released or expires.

Confinement: a one-sided data path cannot check addresses per op, so the node
lets the device do it. The store tells the data path (:class:`ExtentGuard`)
when it hands an extent to a session and when that session loses it; the rdma
data path then binds a memory window over the extent on that session's QP
(its rkey goes into the extent) and revokes it again.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from typing import ClassVar, NamedTuple, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

from rdmakv.blocks.slab import Slab
from rdmakv.errors import ConfigError, RemoteError, TransportTimeout
from rdmakv.wire.batches import AllocRequest, BatchEncoder, GetRequest
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import Header, NodeInfo

REQUEST_BYTES_AHEAD = 32 * 1024
"""While an answer that carries values (tcp's GET) is not yet read, the node
may be blocked sending it: a caller sends at most this many bytes of further
requests on that connection before reading it, so they fit the node's receive
buffer and neither end waits for the other forever."""

PIPELINE_WINDOW = 4
"""Sub-batches a put/get splits into and keeps in flight: each one's control
round trip (ALLOC, LOOKUP) or request overhead is hidden behind the previous
one's data transfer."""
MIN_SUB_BATCH = 64
"""Keys per sub-batch at least: smaller batches are not worth splitting."""


class IoOp(NamedTuple):
    """One contiguous transfer.

    ``local_offset`` is an offset into the registered local region (the client
    slab); ``remote_addr`` is an absolute node-pool address from an extent.
    """

    local_offset: int
    remote_addr: int
    length: int
    rkey: int = 0
    """The extent's remote key as the node handed it out (0: the connection's)."""


OpTable: TypeAlias = npt.NDArray[np.uint64]
"""A batch of ops as an ``(n, OP_TABLE_FIELDS)`` uint64 array, one row per op in
:class:`IoOp`'s field order (``local_offset, remote_addr, length, rkey``): the
layout the native RDMA loop reads as it is (``rk_op``)."""

OP_TABLE_FIELDS = len(IoOp._fields)

Ops: TypeAlias = "Sequence[IoOp] | OpTable"
"""What a one-sided transport's ``write`` and ``read`` take
(:class:`~rdmakv.transport.extents.ExtentTransport`)."""


def iov_at(base: int, offsets: npt.ArrayLike, lengths: np.ndarray) -> npt.NDArray[np.uint64]:
    """An iovec table for the native core (its loops and hashes read ``(address,
    length)`` rows of uint64): row i is ``(base + offsets[i], lengths[i])``."""
    iov = np.empty((len(lengths), 2), dtype=np.uint64)
    iov[:, 0] = offsets
    iov[:, 0] += np.uint64(base)
    iov[:, 1] = lengths
    return iov


def make_op_table(
    local_offsets: npt.ArrayLike, remote_addrs: npt.ArrayLike, lengths: npt.ArrayLike,
    rkeys: npt.ArrayLike,
) -> OpTable:
    """An :data:`OpTable` from its columns (each a sequence or an array, one entry per op)."""
    table = np.empty((len(np.atleast_1d(lengths)), OP_TABLE_FIELDS), dtype=np.uint64)
    for col, values in enumerate((local_offsets, remote_addrs, lengths, rkeys)):
        table[:, col] = values
    return table


def io_ops(ops: Ops) -> Sequence[IoOp]:
    """``ops`` as :class:`IoOp` s, for code that walks a batch op by op."""
    if isinstance(ops, np.ndarray):
        return [IoOp(*row) for row in ops.tolist()]  # tolist(): Python ints
    return ops


class Fetched(NamedTuple):
    """What :meth:`Transport.get` brought in."""

    sizes: list[int | None]
    """Per key, the value's length where its bytes are now in the slab; None: a miss."""
    corrupt: list[bytes]
    """Keys whose bytes arrived but failed their checksum (misses, to be dropped)."""
    refused: RemoteError | None
    """The node's refusal of one of the requests (its keys are misses), if any."""


class Stored(NamedTuple):
    """What :meth:`Transport.put` did."""

    ok: list[bool]
    """Per key: the node holds it now (stored by this call, or present already)."""
    refused: RemoteError | None
    """The node's refusal of one of the requests (its keys are False), if any."""


class IoFuture:
    """Completion of one batched transfer.

    ``result`` waits at most ``timeout`` seconds (None = the timeout the batch
    was issued with) and raises :class:`TransportTimeout` past it, or the
    batch's error (a :class:`TransportError`, or ``RemoteError`` when the node
    refused an op).
    """

    def __init__(self, default_timeout: float | None = None) -> None:
        self._event = threading.Event()
        self._error: BaseException | None = None
        self._default_timeout = default_timeout
        self.checksums: Sequence[int] | None = None
        """Per op, the :func:`~rdmakv.wire.format.value_checksum` of the bytes it
        moved, when the transport computed it (tcp's native loop hashes each
        block on the way, while it is in cache; rdma hashes a batch's slab
        bytes in one native call, a write's as it is submitted, a read's once
        it is done); valid once the batch completed, for every op that did
        not fail. None: the caller hashes the slab itself."""

    @classmethod
    def completed(cls, error: BaseException | None = None) -> IoFuture:
        fut = cls()
        fut.set_result(error)
        return fut

    def set_result(self, error: BaseException | None = None) -> None:
        """Complete the future (producer side); ``error`` makes result() raise it."""
        self._error = error
        self._event.set()

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> None:
        wait = self._default_timeout if timeout is None else timeout
        if not self._event.wait(wait):
            raise TransportTimeout(f"I/O batch not complete after {wait} s")
        if self._error is not None:
            raise self._error


def check_local_ops(ops: Ops, slab: Slab | None) -> None:
    """Every op must lie inside the registered slab (bad input never corrupts it)."""
    if slab is None:
        raise ConfigError("no local region registered: call register_local(slab) first")
    limit = slab.nbytes
    if isinstance(ops, np.ndarray):
        op = _first_outside(ops[:, 0], ops[:, 2], 0, limit, ops)
        if op is not None:
            raise ConfigError(f"I/O op {op} lies outside the registered {limit}-byte local slab")
        return
    for op in ops:
        if op.length < 0 or op.local_offset < 0 or op.local_offset + op.length > limit:
            raise ConfigError(f"I/O op {op} lies outside the registered {limit}-byte local slab")


def check_remote_ops(table: OpTable, pool_base: int, pool_len: int) -> None:
    """Every op of ``table`` must lie inside the node's pool ``[pool_base,
    pool_base + pool_len)``: a wrong address is a clear error here, never a
    remote access fault (or, without windows, someone else's block)."""
    hi = pool_base + pool_len
    op = _first_outside(table[:, 1], table[:, 2], pool_base, hi, table)
    if op is not None:
        raise ConfigError(f"I/O op {op} lies outside the node pool 0x{pool_base:x}..0x{hi:x}")


def _first_outside(
    start: OpTable, length: OpTable, lo: int, hi: int, table: OpTable
) -> IoOp | None:
    """The first op of ``table`` whose ``[start, start + length)`` leaves ``[lo, hi)``.
    uint64 columns: nothing is negative, and the end is compared as ``length >
    hi - start`` so a huge length cannot wrap around."""
    bad = (start < lo) | (start > hi) | (length > hi - np.minimum(start, hi))
    if not bad.any():
        return None
    return io_ops(table[np.flatnonzero(bad)[:1]])[0]


def sub_batch_sizes(n: int, max_keys: int, *, ramp: bool = True) -> list[int]:
    """Split ``n`` keys so each sub-batch's control round trip overlaps the
    previous sub-batch's data transfer.

    Sub-batches are about ``n / PIPELINE_WINDOW`` keys (at least
    ``MIN_SUB_BATCH``, at most the node's ``max_keys``). With ``ramp`` the
    first and last ones ramp (64, 128, ... keys): where the data waits for a
    control round trip (an ALLOC before a one-sided write, a LOOKUP before a
    read), the first ALLOC/LOOKUP and the last COMMIT are the round trips
    nothing overlaps, so they should be short. Without it (a PUT that carries
    its values, a GET whose answer carries them) no round trip comes before
    the data, and every extra sub-batch only adds a request's fixed work on
    both ends. Sizes sum to ``n`` and none exceeds ``max_keys``.
    """
    if n <= 0:
        return []
    full = min(max_keys, max(MIN_SUB_BATCH, -(-n // PIPELINE_WINDOW)))
    ramp_sizes: list[int] = []
    step = MIN_SUB_BATCH
    while ramp and step < full and 2 * (sum(ramp_sizes) + step) + full <= n:
        ramp_sizes.append(step)
        step *= 2
    middle = n - 2 * sum(ramp_sizes)
    pieces = -(-middle // full)
    even = [middle // pieces + (1 if i < middle % pieces else 0) for i in range(pieces)]
    return [*ramp_sizes, *even, *reversed(ramp_sizes)]


def sub_batches(n: int, max_keys: int, *, ramp: bool = True) -> list[tuple[int, int]]:
    """(start, end) of each sub-batch of ``n`` keys; see :func:`sub_batch_sizes`."""
    out = []
    start = 0
    for size in sub_batch_sizes(n, max_keys, ramp=ramp):
        out.append((start, start + size))
        start += size
    return out


class Transport(ABC):
    """Client side of one connection's data path: its put/get strategy. Not
    thread-safe: the KVClient serialises.

    ``put`` and ``get`` split a batch into sub-batches within the node's
    ``max_keys`` and keep several in flight. A node's refusal of one request
    (a :class:`RemoteError`) is reported in the result, once every answer
    asked for was read, so the connection stays in sync; anything else
    raised leaves the connection to be dropped by its owner.
    """

    name: ClassVar[str]

    @abstractmethod
    def register_local(self, slab: Slab) -> None:
        """Register the client slab (once per slab; RDMA registers the MR here)."""

    @abstractmethod
    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        sizes: Sequence[int],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Stored:
        """Put slab blocks ``handles`` (``sizes`` bytes each) under ``keys``,
        each value published with the checksum of the bytes that went out.
        ``encoder``: the call's :class:`~rdmakv.wire.batches.BatchEncoder` of these
        keys, their digests and ``sizes`` (:func:`rdmakv.client.node_client.check_put`
        made it)."""

    @abstractmethod
    def get(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        digests: Sequence[bytes],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Fetched:
        """Values of ``keys`` stored with ``digests`` into slab blocks
        ``handles``, each checked against its checksum before it counts as a
        hit. ``encoder``: the call's :class:`~rdmakv.wire.batches.BatchEncoder` of
        these keys and digests (:func:`rdmakv.client.node_client.check_get` made it)."""

    @abstractmethod
    def close(self) -> None:
        """Release transport resources (the control channel is closed by its owner)."""


TransportFactory = Callable[[Channel, NodeInfo, float], Transport]
"""Builds a client transport over an authenticated control channel."""


class PinnedValues(NamedTuple):
    """What a GET found (:meth:`NodeSession.pin_values`), in the shape its
    answer is sent in.

    ``answer`` is the answer's payload (:func:`~rdmakv.wire.batches.encode_get_answer`:
    per key its value length and checksum, both 0 for a miss; no stored value
    is empty). ``iov`` is ``uint64`` (1 + hits, 2): row 0 zero, left for the
    caller's frame head, then per hit in key order the (address, length) of
    its value in the pool; ``nbytes`` is the sum of those lengths. The hits'
    blocks stay pinned -- nothing evicts or reuses them -- until ``unpin()``
    is called, once: the caller sends their bytes in between.
    """

    answer: bytes | bytearray
    iov: npt.NDArray[np.uint64]
    nbytes: int
    unpin: Callable[[], None]


class ReceivingValues(NamedTuple):
    """Where a PUT's values go (:meth:`NodeSession.alloc_received`).

    ``statuses`` is per item its ``AllocStatus`` byte (the PUT's answer).
    ``iov`` is ``uint64`` (reserved items, 2): per item reserved (OK), in item
    order, the (address, length) of its extent in the pool; the bytes of the
    others are drained. ``received()`` is to be called once every byte of
    every reserved value is in the pool: it marks them written, so a COMMIT
    that requires it may make them visible.
    """

    statuses: bytearray
    iov: npt.NDArray[np.uint64]
    received: Callable[[], None]


class NodeSession(Protocol):
    """What a node-side handler may use for one client connection."""

    session_id: int
    channel: Channel
    one_sided: bool
    """True while the client can move bytes without the node (an RDMA QP is up)."""

    def alloc_received(self, request: AllocRequest) -> ReceivingValues:
        """ALLOC for values the node receives itself, per (key, size, digest) item."""
        ...

    def abort(self, keys: Sequence[bytes]) -> list[bool]:
        """Free this session's uncommitted extents of ``keys``."""
        ...

    def pin_values(self, request: GetRequest) -> PinnedValues:
        """The values committed under the request's keys with its digests (any
        other: a miss), their blocks pinned until ``unpin()``."""
        ...

    def reply(
        self, req: Header, payload: bytes = b"", bulk: Sequence[memoryview] = (), *,
        may_wait: bool = False,
    ) -> None:
        """Send the OK response for ``req`` (with optional bulk). ``may_wait``:
        the client reads this answer only with the next one's (a PUT's, with
        its COMMIT's), so when the next request is already here the answer may
        go out with that one's, in one system call."""
        ...


NodeHandler = Callable[[NodeSession, Header, bytearray], None]
"""Handles one request; it must consume the request's bulk or leave it to be skipped.
Raising an ``RdmakvError`` sends an error response and keeps the connection."""


CONFINE_WINDOWS = "windows"
CONFINE_NONE = "none"
CONFINEMENTS = (CONFINE_WINDOWS, CONFINE_NONE)


class ExtentGuard(Protocol):
    """What the store tells a one-sided data path about extents it hands out.

    Calls come with the store's lock held, in the order the store decides, so
    a revoke is done before the store makes the extent visible to anyone else
    (commit) or reuses it (abort, expiry, disconnect). Neither method may
    raise: a grant that cannot be made returns rkey 0 (the client's access
    then fails, which it treats as a miss / failed put).
    """

    def grant(self, session: int, extents: Sequence[tuple[int, int]], *, write: bool) -> list[int]:
        """Let ``session`` access each (addr, length) extent remotely (write:
        RDMA WRITE until revoked; else RDMA READ). Returns one rkey per extent.
        Granting the same (addr, kind) twice to a session counts twice."""
        ...

    def revoke(self, session: int, addrs: Sequence[int], *, write: bool) -> None:
        """Undo one grant per address (unknown ones are ignored)."""
        ...


class NodeDataPath(ABC):
    """Node side of a transport: serves data ops against the node's pool.

    ``confinement`` (one-sided data paths): ``"windows"`` (default) confines
    each session to the extents the store handed it, through the device;
    ``"none"`` exposes the whole pool to every connected client (only for
    devices without memory windows, by the operator's explicit choice).
    Data paths that check every op themselves (tcp) ignore it.
    """

    name: ClassVar[str]

    def __init__(self, pool: Slab, *, confinement: str = CONFINE_WINDOWS) -> None:
        if confinement not in CONFINEMENTS:
            raise ConfigError(
                f"rdma_confinement must be one of {', '.join(CONFINEMENTS)}, got {confinement!r}"
            )
        self.pool = pool
        self.confinement = confinement

    @property
    def guard(self) -> ExtentGuard | None:
        """The hook the store must call on grants/revokes (None: not needed)."""
        return None

    @property
    def rkey(self) -> int:
        """Remote key of the pool for this transport (0 when not applicable)."""
        return 0

    @property
    def native_get(self) -> bool:
        """Whether the node's native request loop may answer this data path's
        GET (rdmakv/node/native_loop.py): true where its own GET sends the
        answer and the values straight from the pool in native code too."""
        return False

    @abstractmethod
    def handlers(self) -> Mapping[int, NodeHandler]:
        """Opcodes this data path serves."""

    def session_closed(self, session: NodeSession) -> None:  # noqa: B027 - optional hook
        """Called once when a client connection ends (tear down per-session state)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release device resources at node shutdown."""


class NodeDataPathFactory(Protocol):
    """Builds a node data path over the pool (a :class:`NodeDataPath` subclass)."""

    def __call__(self, pool: Slab, *, confinement: str = CONFINE_WINDOWS) -> NodeDataPath: ...
