"""Software one-sided I/O over the control connection (the ``tcp`` transport).

The node serves WRITE/READ requests naming ``(absolute pool address, length)``
lists. Bytes move with scatter-gather socket calls straight between the
socket and slab/pool blocks (``sendmsg`` of block views, ``recvmsg_into`` of
block views): no intermediate ``bytes``. A batch is split into requests within
the node's advertised limits, and requests are pipelined ``PIPELINE_DEPTH``
deep so the socket never idles between them.

The data ops share the control socket, so control and data stay ordered and
the node can tie every op to the session that received the extents.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rdmakv.errors import ProtocolError, RdmakvError
from rdmakv.protocol import (
    Channel,
    Header,
    NodeInfo,
    Op,
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

PIPELINE_DEPTH = 2
"""Requests in flight per batch. Two keeps the socket busy while the previous
response is parsed; more only adds buffered request bytes (deadlock risk with
READ replies filling the other direction)."""


class TcpTransport(Transport):
    """Client side. Completes each batch before returning (a finished IoFuture).

    On any socket failure the channel is left unusable and the error raised;
    the owner (KVClient) drops the connection and reconnects on the next call.
    """

    name = "tcp"

    def __init__(self, channel: Channel, info: NodeInfo, timeout: float) -> None:
        self._ch = channel
        self._info = info
        self._timeout = timeout
        self._slab: Slab | None = None
        self._local: memoryview | None = None

    def register_local(self, slab: Slab) -> None:
        self._slab = slab
        self._local = slab.buffer

    def _run(self, opcode: Op, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        check_local_ops(ops, self._slab)
        assert self._local is not None
        local = self._local
        ch = self._ch
        what = "WRITE" if opcode == Op.WRITE else "READ"
        chunks = list(chunk_ops([op.length for op in ops], self._info.max_ops, self._info.max_bulk))
        pending: list[tuple[int, int, int]] = []  # (req_id, start, end)
        first_error: RdmakvError | None = None
        try:
            ch.sock.settimeout(timeout)

            def finish(req: tuple[int, int, int]) -> None:
                nonlocal first_error
                rid, s, e = req
                try:
                    hdr, _ = ch.expect(opcode, rid, what)
                    if opcode == Op.READ:
                        views = [
                            local[op.local_offset : op.local_offset + op.length] for op in ops[s:e]
                        ]
                        if hdr.bulk_len != sum(len(v) for v in views):
                            raise ProtocolError(
                                f"READ response carries {hdr.bulk_len} bytes, asked for "
                                f"{sum(len(v) for v in views)}"
                            )
                        ch.recv_bulk(views)
                except ProtocolError:
                    raise
                except RdmakvError as e:  # node refused this request; stream still in sync
                    if first_error is None:
                        first_error = e

            for start, end in chunks:
                batch = ops[start:end]
                payload = encode_data_ops([(op.remote_addr, op.length) for op in batch])
                rid = ch.next_req_id()
                if opcode == Op.WRITE:
                    views = [local[op.local_offset : op.local_offset + op.length] for op in batch]
                    ch.send(
                        opcode,
                        payload,
                        req_id=rid,
                        bulk=views,
                        bulk_len=sum(op.length for op in batch),
                    )
                else:
                    ch.send(opcode, payload, req_id=rid)
                pending.append((rid, start, end))
                if len(pending) >= PIPELINE_DEPTH:
                    finish(pending.pop(0))
            while pending:
                finish(pending.pop(0))
        except (TimeoutError, OSError) as e:
            raise wrap_socket_errors(what, e) from e
        return IoFuture.completed(first_error)

    def write(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        return self._run(Op.WRITE, ops, timeout)

    def read(self, ops: Sequence[IoOp], timeout: float) -> IoFuture:
        return self._run(Op.READ, ops, timeout)

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
        views = session.writable_views(ops)  # raises BadAddress; the bulk is then skipped
        session.channel.recv_bulk(views)
        session.reply(req)

    @staticmethod
    def _read(session: NodeSession, req: Header, payload: bytearray) -> None:
        ops = decode_data_ops(payload, "READ")
        views, unpin = session.pin_readable(ops)
        try:
            session.reply(req, bulk=views)
        finally:
            unpin()
