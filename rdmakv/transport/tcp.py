"""Software one-sided I/O over the control connection (the ``tcp`` transport).

The node serves WRITE/READ requests naming ``(absolute pool address, length)``
lists. Bytes move with scatter-gather socket calls straight between the
socket and slab/pool blocks (``sendmsg`` of block views, ``recvmsg_into`` of
block views): no intermediate ``bytes``. A batch is split into requests within
the node's advertised limits (ops and bulk bytes per request); WRITEs are all
sent before their acknowledgements are read, READs run ``READ_PIPELINE_DEPTH``
deep, so the socket never idles between requests.

The data ops share the control socket, so control and data stay ordered and
the node can tie every op to the session that received the extents. Because
the node sees every written byte, it marks an extent *written* only once the
whole extent arrived; the client queues ``COMMIT`` (with
``COMMIT_FLAG_REQUIRE_WRITTEN``) right behind its WRITEs, and an extent whose
write failed is never published.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from rdmakv.errors import ProtocolError, RdmakvError
from rdmakv.protocol import (
    Channel,
    Header,
    NodeInfo,
    Op,
    Reply,
    chunk_ops,
    decode_data_ops,
    encode_data_ops,
    wrap_socket_errors,
)
from rdmakv.slab import Slab
from rdmakv.transport.base import (
    IoFuture,
    IoOp,
    NodeDataPath,
    NodeHandler,
    NodeSession,
    Transport,
    check_local_ops,
)

READ_PIPELINE_DEPTH = 2
"""READ requests in flight. Two keeps the socket busy while the previous
response is parsed; more only adds buffered request bytes (deadlock risk with
READ replies filling the other direction). WRITE responses are 24 bytes, so
every WRITE of a batch is sent before any response is read."""


class TcpWriteFuture(IoFuture):
    """Completes when the node has acknowledged every WRITE of the batch."""

    def __init__(self, channel: Channel, replies: list[Reply], timeout: float) -> None:
        super().__init__(timeout)
        self._ch = channel
        self._replies = replies

    def done(self) -> bool:
        return all(r.done for r in self._replies)

    def result(self, timeout: float | None = None) -> None:
        if not self.done():
            self._ch.sock.settimeout(self._default_timeout if timeout is None else timeout)
            first: RdmakvError | None = None
            try:
                for r in self._replies:
                    try:
                        self._ch.wait(r)
                    except ProtocolError:
                        raise
                    except RdmakvError as e:  # node refused one request; stream in sync
                        first = first or e
            except OSError as e:
                raise wrap_socket_errors("WRITE", e) from e
            self.set_result(first)
        super().result(0)


class TcpTransport(Transport):
    """Client side, over the control channel.

    ``write`` sends every WRITE request of the batch at once and returns a
    future that reads the acknowledgements, so the caller can queue COMMIT
    behind the writes (``node_verifies_writes``). ``read`` completes before it
    returns. On a socket failure the channel is unusable and the error raised;
    the owner (KVClient) drops the connection and reconnects on the next call.
    """

    name = "tcp"
    node_verifies_writes = True

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch = channel
        self._info = info
        self._timeout = timeout
        self._slab: Slab | None = None
        self._local: memoryview | None = None

    def register_local(self, slab: Slab) -> None:
        self._slab = slab
        self._local = slab.buffer

    def _chunks(self, ops: Sequence[IoOp]) -> list[tuple[int, int]]:
        check_local_ops(ops, self._slab)
        return list(chunk_ops([op.length for op in ops], self._info.max_ops, self._info.max_bulk))

    def write(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        chunks = self._chunks(ops)
        assert self._local is not None
        local = self._local
        ch = self._ch
        replies = []
        try:
            ch.sock.settimeout(timeout)
            for start, end in chunks:
                batch = ops[start:end]
                views = [local[op.local_offset : op.local_offset + op.length] for op in batch]
                payload = encode_data_ops([(op.remote_addr, op.length) for op in batch])
                replies.append(
                    ch.submit(
                        Op.WRITE, payload, "WRITE", bulk=views, bulk_len=sum(map(len, views))
                    )
                )
        except OSError as e:
            raise wrap_socket_errors("WRITE", e) from e
        return TcpWriteFuture(ch, replies, timeout)

    def read(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        chunks = self._chunks(ops)
        assert self._local is not None
        local = self._local
        ch = self._ch
        first: RdmakvError | None = None
        pending: list[Reply] = []

        def receiver(batch: Sequence[IoOp]) -> Callable[[Header], None]:
            def on_ok(hdr: Header) -> None:
                views = [local[op.local_offset : op.local_offset + op.length] for op in batch]
                want = sum(map(len, views))
                if hdr.bulk_len != want:
                    raise ProtocolError(
                        f"READ response carries {hdr.bulk_len} bytes, asked for {want}"
                    )
                ch.recv_bulk(views)

            return on_ok

        def finish(reply: Reply) -> None:
            nonlocal first
            try:
                ch.wait(reply)
            except ProtocolError:
                raise
            except RdmakvError as e:  # node refused this request; stream still in sync
                first = first or e

        try:
            ch.sock.settimeout(timeout)
            for start, end in chunks:
                batch = ops[start:end]
                payload = encode_data_ops([(op.remote_addr, op.length) for op in batch])
                pending.append(ch.submit(Op.READ, payload, "READ", on_ok=receiver(batch)))
                if len(pending) >= READ_PIPELINE_DEPTH:
                    finish(pending.pop(0))
            while pending:
                finish(pending.pop(0))
        except OSError as e:
            raise wrap_socket_errors("READ", e) from e
        return IoFuture.completed(first)

    def close(self) -> None:
        self._slab = None
        self._local = None


class TcpNodeDataPath(NodeDataPath):
    """Node side: WRITE receives straight into pool extents, READ sends from them."""

    name = "tcp"

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.WRITE: self._write, Op.READ: self._read}

    @staticmethod
    def _write(session: NodeSession, req: Header, payload: bytearray) -> None:
        ops = decode_data_ops(payload, "WRITE")
        total = sum(n for _, n in ops)
        if total != req.bulk_len:
            raise ProtocolError(
                f"WRITE ops name {total} bytes but the frame carries {req.bulk_len}"
            )
        views, written = session.open_write(ops)  # raises BadAddress; the bulk is then skipped
        session.channel.recv_bulk(views)
        written()  # only now: every byte of the ops is in the pool
        session.reply(req)

    @staticmethod
    def _read(session: NodeSession, req: Header, payload: bytearray) -> None:
        ops = decode_data_ops(payload, "READ")
        views, unpin = session.pin_readable(ops)
        try:
            session.reply(req, bulk=views)
        finally:
            unpin()
