"""The node side of the ``tcp`` transport: :class:`TcpNodeDataPath` answers GET and PUT.

A GET's hits are sent from the pool with the native loop, a PUT's values
received straight into the extents the store just handed out (the bytes of
refused values into a bounded scratch buffer and dropped).
"""

from __future__ import annotations

from collections.abc import Mapping

from rdmakv.errors import ProtocolError
from rdmakv.transport.base import (
    NodeDataPath,
    NodeHandler,
    NodeSession,
    ReceivingValues,
)
from rdmakv.transport.tcp.loop import address_of, recv_iov_from, send_iov, u64_array
from rdmakv.wire.batches import (
    AllocRequest,
    decode_alloc_request,
    decode_get_request,
    encode_put_answer,
)
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    HEADER,
    MAX_BULK_BYTES,
    RESPONSE_BIT,
    AllocStatus,
    Header,
    LimitExceeded,
    Op,
    Status,
)

PUT_DRAIN_BYTES = 1024 * 1024
"""Scratch a PUT's refused values are received into (and dropped), at most."""


class TcpNodeDataPath(NodeDataPath):
    """Node side: PUT receives values straight into pool extents, GET sends
    them from there (both name keys; the store picks the extents)."""

    name = "tcp"

    @property
    def native_get(self) -> bool:
        return True

    def handlers(self) -> Mapping[int, NodeHandler]:
        return {Op.GET: self._get, Op.PUT: self._put}

    def _get(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_get_request(payload)
        found = session.pin_values(request)
        try:
            if found.nbytes > MAX_BULK_BYTES:  # the answer would be over the frame limit
                raise LimitExceeded(
                    f"GET of {request.count} keys finds {found.nbytes} bytes, more than "
                    f"{MAX_BULK_BYTES} in one answer"
                )
            answer = found.answer
            # header, answer and the values in one system call: the client wakes once
            head = HEADER.pack(
                req.opcode | RESPONSE_BIT, 0, Status.OK, len(answer), found.nbytes, req.req_id
            ) + answer
            table = found.iov
            table[0] = (address_of(head), len(head))
            # the pins keep the blocks; the pool stays mapped
            session.channel.flush()  # answers held back go first (Channel.send)
            send_iov(session.channel.sock, table)
        finally:
            found.unpin()

    def _put(self, session: NodeSession, req: Header, payload: bytearray) -> None:
        request = decode_alloc_request(payload, "PUT")
        total = request.total_bytes()
        if total != req.bulk_len:
            raise ProtocolError(
                f"PUT items name {total} bytes but the frame carries {req.bulk_len}"
            )
        values = session.alloc_received(request)
        try:
            self._receive_values(session.channel, request, values, total)
        except BaseException:  # nothing half-written stays allocated
            session.abort([key for (key, _, _), st in
                           zip(request.items, values.statuses, strict=True)
                           if st == AllocStatus.OK])
            raise
        values.received()  # only now: every byte of every allocated value is in the pool
        # the client reads a PUT's answer with its COMMIT's, sent right behind it
        session.reply(req, encode_put_answer(values.statuses), may_wait=True)

    def _receive_values(
        self,
        ch: Channel,
        request: AllocRequest,
        values: ReceivingValues,
        total: int,
    ) -> None:
        """A PUT's bulk: each reserved value into its extent (``values.iov``),
        the bytes of the values refused into a scratch buffer."""
        extents = values.iov
        if len(extents) == request.count:  # the common case: nothing refused
            recv_iov_from(ch, extents, total)  # the store's extents: inside the pool
            return
        refused = total - int(extents[:, 1].sum())
        scratch = bytearray(min(refused, PUT_DRAIN_BYTES))
        step = len(scratch) or 1
        where = address_of(scratch) if scratch else 0  # never a pool address
        reserved = iter(extents.tolist())
        rows: list[int] = []  # (address, length) pairs, flat
        for (_, size, _), st in zip(request.items, values.statuses, strict=True):
            if st == AllocStatus.OK:
                rows += next(reserved)  # an extent the store just handed out
                continue
            for s in range(0, size, step):
                rows += (where, min(step, size - s))
        recv_iov_from(ch, u64_array(rows).reshape(-1, 2), total)  # `scratch` lives meanwhile
