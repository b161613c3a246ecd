"""The put/get strategy of a one-sided transport (``rdma``): extents, then bytes.

Put of a batch = ``ALLOC`` (node reserves extents) -> one-sided ``write`` of
the slab blocks into them -> ``COMMIT`` with each value's checksum (values
become visible). Get = ``LOOKUP`` with leases -> digest check -> one-sided
``read`` into the caller's slab blocks -> checksum check -> ``RELEASE``. A
value whose stored digest differs from the digest the caller expects, or
whose bytes fail their checksum, is a miss: never wrong KV.

A batch is split into up to ``PIPELINE_WINDOW`` sub-batches whose control
requests go out ahead (the node answers in order), so the ALLOC/LOOKUP round
trip of one sub-batch hides behind the data of the previous one; RELEASE is
sent without waiting for its answer. Everything the node sends is remote
input: a looked-up value longer than a slab block is a miss.

A subclass moves the bytes (:meth:`ExtentTransport.write`,
:meth:`ExtentTransport.read`); the node's CPU is not in the data path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from abc import abstractmethod
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from rdmakv.blocks.slab import Slab
from rdmakv.errors import ConfigError, OpsFailed, ProtocolError, RdmakvError, RemoteError
from rdmakv.transport.base import (
    PIPELINE_WINDOW,
    REQUEST_BYTES_AHEAD,
    Fetched,
    IoFuture,
    Ops,
    Stored,
    Transport,
    make_op_table,
    sub_batches,
)
from rdmakv.wire.batches import (
    BatchEncoder,
    decode_extent_table,
    decode_flags,
    decode_lookup_table,
    encode_commit,
    encode_keys,
    encode_u64_list,
)
from rdmakv.wire.channel import Channel, Reply
from rdmakv.wire.format import LOOKUP_FLAG_LEASE, AllocStatus, NodeInfo, Op, value_checksum

log = logging.getLogger("rdmakv.client")  # its warnings are about the caller's put/get

READS_IN_FLIGHT = 1
"""Sub-batch reads queued on the transport besides the one being prepared:
the next sub-batch's LOOKUP is decoded while the previous read moves."""
WRITES_IN_FLIGHT = 1
"""Likewise for writes: a sub-batch's COMMIT goes out while the next one's
write moves, instead of after every write of the batch."""


class ExtentTransport(Transport):
    """A transport that moves bytes one-sided between the client slab and
    extents the node hands out (ALLOC for writes, leased LOOKUP for reads).

    A subclass sets ``_ch`` (the control channel), ``_info`` (the node's
    handshake, limits already clamped) and, in ``register_local``,
    ``_slab``; and moves the bytes of a batch of ops in :meth:`write` and
    :meth:`read`, which report ops the device failed as :class:`OpsFailed`.
    """

    _ch: Channel
    _info: NodeInfo
    _slab: Slab | None

    @abstractmethod
    def write(self, ops: Ops, timeout: float) -> IoFuture:
        """One-sided write: slab ranges -> remote extents allocated to this client."""

    @abstractmethod
    def read(self, ops: Ops, timeout: float) -> IoFuture:
        """One-sided read: remote extents leased to this client -> slab ranges.

        Until the future is collected, the caller sends at most
        :data:`~rdmakv.transport.base.REQUEST_BYTES_AHEAD` bytes of further
        requests on this connection."""

    def _local_slab(self) -> Slab:
        if self._slab is None:
            raise ConfigError("no slab registered with this transport: pass one to put/get blocks")
        return self._slab

    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        sizes: Sequence[int],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Stored:
        """ALLOC sub-batches ahead, write each as its extents arrive, then COMMIT.

        A sub-batch's COMMIT is sent as soon as its write completed, while
        the next sub-batch's write runs. Ops the transport reports as failed
        (:class:`OpsFailed`) are ABORTed and give False for exactly their
        keys; the rest are committed. A write the node refused aborts the
        extents it left uncommitted and is reported in the result.
        """
        ch = self._ch
        slab = self._local_slab()
        bs = slab.block_size  # handles were validated by check_put()
        arena = slab.buffer
        offsets = np.asarray(handles, dtype=np.uint64) * np.uint64(bs)  # slab offset per key
        lengths = np.asarray(sizes, dtype=np.uint64)
        subs = sub_batches(len(keys), self._info.max_keys)
        out = [False] * len(keys)
        allocs: deque[tuple[int, int, Reply]] = deque()
        writing: deque[_PutStage] = deque()
        settled: list[_PutStage] = []
        nxt = 0

        def submit_alloc() -> None:
            nonlocal nxt
            s, e = subs[nxt]
            nxt += 1
            payload = encoder.alloc(s, e)
            allocs.append((s, e, ch.submit(Op.ALLOC, payload, "ALLOC")))

        try:
            while nxt < len(subs) and len(allocs) < PIPELINE_WINDOW:
                submit_alloc()
            while allocs:
                s, e, reply = allocs.popleft()
                ext = decode_extent_table(ch.wait(reply)[1], e - s)
                alloc = ext["status"] == AllocStatus.OK
                for j in np.flatnonzero(~alloc).tolist():  # not ours to write
                    out[s + j] = bool(ext["status"][j] == AllocStatus.EXISTS)
                picked = np.flatnonzero(alloc)
                at = picked + s  # the keys' positions in the put
                got = ext["length"][picked]
                wrong = np.flatnonzero(got != lengths[at])
                if len(wrong):
                    j = int(wrong[0])
                    raise ProtocolError(
                        f"node allocated {got[j]} bytes for a {lengths[at][j]}-byte value"
                    )
                if not len(at):
                    if nxt < len(subs):
                        submit_alloc()
                    continue
                # the ops as one table: no Python object per op
                ops = make_op_table(offsets[at], ext["addr"][picked], got, ext["rkey"][picked])
                idx = at.tolist()
                fut = self.write(ops, timeout)
                # the writer's checksums while the device reads the blocks
                stage = _PutStage(fut, idx, [keys[i] for i in idx],
                                  _op_checksums(fut, arena, offsets[at], got))
                if nxt < len(subs):
                    submit_alloc()  # the node allocates it while this write moves
                writing.append(stage)
                # Settle the previous sub-batch while this one's write runs.
                while len(writing) > WRITES_IN_FLIGHT:
                    settled.append(_settle_write(ch, writing.popleft(), timeout))
            while writing:
                settled.append(_settle_write(ch, writing.popleft(), timeout))
        except BaseException:
            _drain(stage.fut for stage in writing)  # no write may still read the slab
            raise
        refused: RemoteError | None = None
        for stage in settled:
            refused = refused or stage.refused
            if stage.commit is not None:
                flags = decode_flags(ch.wait(stage.commit)[1], len(stage.commit_idx), "COMMIT")
            else:
                flags = [False] * len(stage.commit_idx)
            for j, ok in zip(stage.commit_idx, flags, strict=True):
                out[stage.idx[j]] = ok
            if stage.abort is not None:
                ch.wait(stage.abort)  # failed ops' extents are free again
        return Stored(out, refused)

    def get(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        digests: Sequence[bytes],
        encoder: BatchEncoder,
        timeout: float,
    ) -> Fetched:
        """LOOKUP (leased) sub-batches ahead; read each one's hits; release its leases.

        A sub-batch's read is collected only after the next sub-batch's
        LOOKUP answer was decoded and its read queued, so that Python work
        overlaps the transfer. Ops the transport reports as failed
        (:class:`OpsFailed`) are misses for exactly their keys (their slab
        blocks may have been partly overwritten); every lease is released.
        """
        ch = self._ch
        slab = self._local_slab()
        bs = slab.block_size
        arena = slab.buffer
        offsets = np.asarray(handles, dtype=np.uint64) * np.uint64(bs)  # slab offset per key
        subs = sub_batches(len(keys), self._info.max_keys)
        out: list[int | None] = [None] * len(keys)
        lookups: deque[tuple[int, int, Reply]] = deque()
        reading: deque[_ReadStage] = deque()
        corrupt: list[bytes] = []
        refused: RemoteError | None = None
        nxt = 0

        def submit_lookup() -> None:
            nonlocal nxt
            s, e = subs[nxt]
            nxt += 1
            payload = encoder.keys(s, e)
            while reading and len(payload) > REQUEST_BYTES_AHEAD:  # see read()
                finish(reading.popleft())
            lookups.append((s, e, ch.submit(Op.LOOKUP, payload, "LOOKUP", flags=LOOKUP_FLAG_LEASE)))

        def finish(stage: _ReadStage) -> None:
            nonlocal refused
            n = len(stage.at)
            moved = np.ones(n, dtype=bool)
            try:
                stage.fut.result(timeout)
            except RemoteError as exc:  # node refused a read; the stream is in sync
                refused = refused or exc
                moved[:] = False
            except OpsFailed as exc:  # the device failed these ops only; the rest moved
                log.warning("get: %d of %d reads failed; those keys are misses: %s",
                            len(exc.failed), n, exc)
                moved[[j for j in exc.failed if 0 <= j < n]] = False
            if moved.any():
                got = np.asarray(_op_checksums(stage.fut, arena, offsets[stage.at],
                                               stage.lengths), dtype=np.uint64)
                ok = moved & (got == stage.checksums)
                for i, length in zip(stage.at[ok].tolist(), stage.lengths[ok].tolist(),
                                     strict=True):
                    out[i] = length
                # corrupted on the way or in the pool: a miss
                corrupt.extend(keys[i] for i in stage.at[moved & ~ok].tolist())
            leases = stage.leases
            if leases:  # hits of one LOOKUP share a lease id
                ch.send_nowait(Op.RELEASE, encode_u64_list(sorted(set(leases))))

        try:
            while nxt < len(subs) and len(lookups) < PIPELINE_WINDOW:
                submit_lookup()
            while lookups:
                s, e, reply = lookups.popleft()
                found = decode_lookup_table(ch.wait(reply)[1], e - s)
                present = found["found"] != 0
                leases = found["lease"][present].tolist()
                length = found["length"]
                wanted = np.frombuffer(b"".join(digests[s:e]), dtype=found.dtype["digest"])
                # a collision or a foreign value is a miss, never wrong KV
                picked = np.flatnonzero(
                    present & (found["digest"] == wanted) & (length > 0) & (length <= bs)
                )
                at = picked + s  # the keys' positions in the get
                ops = make_op_table(offsets[at], found["addr"][picked], length[picked],
                                    found["rkey"][picked])
                reading.append(_ReadStage(self.read(ops, timeout), at, length[picked],
                                          found["checksum"][picked], leases))
                if nxt < len(subs):
                    submit_lookup()  # the node looks it up while this read moves
                while len(reading) > READS_IN_FLIGHT:
                    finish(reading.popleft())
            while reading:
                finish(reading.popleft())
        except BaseException:
            _drain(stage.fut for stage in reading)  # no read may still write the slab
            raise
        return Fetched(out, corrupt, refused)


def _settle_write(ch: Channel, stage: _PutStage, timeout: float) -> _PutStage:
    """Wait for one sub-batch's write; send its COMMIT (ops that moved) and
    ABORT (ops that failed) without waiting for the answers."""
    failed: set[int] = set()
    try:
        stage.fut.result(timeout)
    except RemoteError as exc:  # the node refused a write; the stream is in sync
        stage.refused = exc
        failed = set(range(len(stage.keys)))
    except OpsFailed as exc:  # the device failed these ops only; the rest moved
        log.warning("put: %d of %d writes failed; those keys are not stored: %s",
                    len(exc.failed), len(stage.keys), exc)
        failed = {j for j in exc.failed if 0 <= j < len(stage.keys)}
    stage.commit_idx = [j for j in range(len(stage.keys)) if j not in failed]
    if stage.refused is None and stage.commit_idx:
        commit_keys = [stage.keys[j] for j in stage.commit_idx]
        sums = [stage.sums[j] for j in stage.commit_idx]
        stage.commit = ch.submit(Op.COMMIT, encode_commit(commit_keys, sums), "COMMIT")
    else:
        stage.commit_idx = []
    if failed:
        aborted = [stage.keys[j] for j in sorted(failed)]
        stage.abort = ch.submit(Op.ABORT, encode_keys(aborted), "ABORT")
    return stage


@dataclasses.dataclass
class _PutStage:
    """One put sub-batch: its write, and the control requests that follow it.

    ``keys`` / ``idx`` are the written keys and their positions in the put,
    ``sums`` their values' checksums (sent with COMMIT); ``commit_idx``
    indexes ``keys`` and says which keys ``commit`` carries.
    """

    fut: IoFuture
    idx: list[int]
    keys: list[bytes]
    sums: Sequence[int]
    commit: Reply | None = None
    commit_idx: list[int] = dataclasses.field(default_factory=list)
    abort: Reply | None = None
    refused: RemoteError | None = None


class _ReadStage(NamedTuple):
    """One get sub-batch's read of its hits, not yet collected: ``at`` are the
    hits' positions in the get, ``lengths`` and ``checksums`` what the LOOKUP
    said each value holds (columns, one row per op of ``fut``), ``leases``
    the LOOKUP's leases to release once the read is done."""

    fut: IoFuture
    at: npt.NDArray[np.intp]
    lengths: npt.NDArray[np.uint32]
    checksums: npt.NDArray[np.uint64]
    leases: list[int]


def _op_checksums(
    fut: IoFuture, arena: memoryview, offsets: npt.NDArray[np.uint64], lengths: npt.NDArray[Any]
) -> Sequence[int]:
    """The value checksum of each op's slab bytes (``lengths[i]`` bytes at
    ``offsets[i]``): the transport's when it hashed them (rdma in one native
    call), else hashed here."""
    if fut.checksums is not None:
        return fut.checksums
    return [value_checksum(arena[o : o + n])
            for o, n in zip(offsets.tolist(), lengths.tolist(), strict=True)]


def _drain(futures: Iterable[IoFuture]) -> None:
    """After a failure mid-batch: wait (each bounded by its own timeout) until
    no transfer of ``futures`` still touches the slab; their errors are moot."""
    for fut in futures:
        with contextlib.suppress(RdmakvError, OSError):
            fut.result()
