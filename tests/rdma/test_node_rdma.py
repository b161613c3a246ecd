"""The node/client integration scenarios over the ``rdma`` transport: a real
``rdmakv serve --transport rdma`` process, a KVClient with its slab registered
on the same device, bytes verified end to end."""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from rdmakv.blocks.slab import Slab
from rdmakv.client import streams
from rdmakv.client.node_client import KVClient, sub_batch_sizes
from rdmakv.client.remote import open_remote
from rdmakv.client.streams import (
    MIN_SPLIT_BATCH_BYTES,
    MIN_SPLIT_VALUE_BYTES,
    MIN_SPLIT_VALUE_BYTES_RDMA,
    STREAMS_RDMA,
    MultiStreamClient,
    default_streams,
    usable_cpus,
)
from rdmakv.errors import ConfigError, RdmaError, TransportError, TransportTimeout
from rdmakv.transport.base import IoOp, make_op_table
from rdmakv.transport.rdma import verbs
from rdmakv.transport.rdma.client_side import RdmaTransport
from rdmakv.transport.rdma.device import RdmaOpsFailed
from rdmakv.wire.batches import decode_extent_table, decode_lookup_table, encode_alloc, encode_keys
from rdmakv.wire.format import AllocStatus, Op

pytestmark = pytest.mark.timeout(180)

BLOCK = 16384
NBLOCKS = 96
POOL = 256 * BLOCK
CLIENT_TIMEOUT = 20.0  # soft-RoCE under emulation is slow; never a timing assertion
READY_LINE_TIMEOUT = 90.0


class Node:
    """A real ``rdmakv serve`` subprocess."""

    def __init__(self, transport: str = "rdma", block: int = BLOCK, pool: int = POOL) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rdmakv.cli", "serve", "--port", "0", "--pool-size",
             str(pool), "--block-size", str(block), "--transport", transport],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if "ready on" not in line:
            self.proc.kill()
            _, err = self.proc.communicate(timeout=READY_LINE_TIMEOUT)
            raise AssertionError(f"node did not start: {line!r} {err}")
        self.line = line
        self.port = int(line.split("ready on ", 1)[1].split()[0].rsplit(":", 1)[1])

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)


@pytest.fixture()
def node() -> Iterator[Node]:
    n = Node()
    yield n
    n.kill()


@pytest.fixture()
def slab() -> Iterator[Slab]:
    s = Slab(NBLOCKS * 2 * BLOCK, BLOCK)
    yield s
    s.close()


def fill(slab: Slab, handles: list[int]) -> None:
    for h in handles:
        slab.numpy(h)[:] = memoryview(bytearray(os.urandom(BLOCK)))


def digests(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1_000_003 + i).to_bytes(16, "little") for i in range(n)]


def rdma_of(c: KVClient) -> RdmaTransport:
    tp = c._tp  # the test inspects the live transport (no way to get it otherwise)
    assert isinstance(tp, RdmaTransport)
    return tp


def test_node_offers_rdma(node: Node) -> None:
    assert "rdma" in node.line.split("transports=", 1)[1].split()[0].split(",")


def test_batched_put_get_bytes_verified(node: Node, slab: Slab) -> None:
    src = slab.alloc_many(NBLOCKS)
    dst = slab.alloc_many(NBLOCKS)
    fill(slab, src)
    keys = [b"k%d" % i for i in range(NBLOCKS)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.transport_name == "rdma"
        assert c.put(keys, src, BLOCK, digests(NBLOCKS)) == [True] * NBLOCKS
        put_stats = rdma_of(c).last_stats
        assert put_stats is not None and put_stats.failed_ops == 0
        assert put_stats.wrs < NBLOCKS  # SGL batching gathered blocks
        assert c.get(keys, dst, digests(NBLOCKS)) == [True] * NBLOCKS
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
        assert c.stats()["leases_active"] == 0  # every READ lease given back
        # a digest mismatch is a miss and leaves the block alone
        slab.numpy(dst[0])[:] = 7
        assert c.get(keys[:1], dst[:1], digests(1, salt=9)) == [False]
        assert bytes(slab.view(dst[0])) == bytes([7]) * BLOCK


def test_values_put_over_one_transport_read_back_over_the_other(node: Node, slab: Slab) -> None:
    """The RDMA transport hashes each op's slab bytes in one native call (the
    writer's checksums as a write is submitted, the reader's once a read is
    done). Were those hashes of other bytes than the values', a put over
    RDMA read back over TCP (whose loop hashes the bytes that arrive), or
    the other way round, would be a checksum mismatch: a miss."""
    n = NBLOCKS // 2
    src, dst = slab.alloc_many(2 * n), slab.alloc_many(2 * n)
    fill(slab, src)
    sizes = [BLOCK - 7 * i for i in range(2 * n)]  # short values too: lengths matter
    over_rdma, over_tcp = [b"r%d" % i for i in range(n)], [b"t%d" % i for i in range(n)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as r, \
            KVClient("127.0.0.1", node.port, slab, transport="tcp", timeout=CLIENT_TIMEOUT) as t:
        assert (r.transport_name, t.transport_name) == ("rdma", "tcp")
        assert rdma_of(r).checksums(make_op_table([0], [0], [BLOCK], [0])) is not None
        assert r.put(over_rdma, src[:n], sizes[:n], digests(n)) == [True] * n
        assert t.put(over_tcp, src[n:], sizes[n:], digests(n, 1)) == [True] * n
        assert t.get_sizes(over_rdma, dst[:n], digests(n)) == sizes[:n]
        assert r.get_sizes(over_tcp, dst[n:], digests(n, 1)) == sizes[n:]
        assert r.checksum_mismatches == t.checksum_mismatches == 0
    for s_, d, size in zip(src, dst, sizes, strict=True):
        assert bytes(slab.view(d, size)) == bytes(slab.view(s_, size))


@pytest.mark.parametrize("transport", ["rdma", "tcp"])
def test_a_value_corrupted_in_the_pool_is_a_miss_and_dropped(
    node: Node, slab: Slab, transport: str
) -> None:
    """One byte of one stored value flipped in the node's pool (written
    through /proc/PID/mem, the node being this test's child): the get that
    reads it checks its bytes against its writer's checksum, gives a miss for
    that key alone, deletes it on the node, and leaves the others whole."""
    n = 8
    src, dst = slab.alloc_many(n), slab.alloc_many(n)
    fill(slab, src)
    keys = [b"%s-c%d" % (transport.encode(), i) for i in range(n)]
    with KVClient("127.0.0.1", node.port, slab, transport=transport,
                  timeout=CLIENT_TIMEOUT) as c:
        assert c.transport_name == transport
        assert c.put(keys, src, BLOCK, digests(n)) == [True] * n
        where = decode_lookup_table(c._call(Op.LOOKUP, encode_keys(keys[3:4]), "LOOKUP"), 1)
        assert where["found"][0]
        addr = int(where["addr"][0]) + 1000
        with open(f"/proc/{node.proc.pid}/mem", "r+b", buffering=0) as mem:
            mem.seek(addr)
            (byte,) = mem.read(1)
            mem.seek(addr)
            mem.write(bytes([byte ^ 0x40]))
        hits = c.get(keys, dst, digests(n))
        assert hits == [i != 3 for i in range(n)]
        assert c.checksum_mismatches == 1
        assert c.exists(keys) == [i != 3 for i in range(n)]  # dropped: the next put stores it
    for i, (s_, d) in enumerate(zip(src, dst, strict=True)):
        if i != 3:
            assert bytes(slab.view(d)) == bytes(slab.view(s_))


def test_slab_registered_once_across_reconnects(node: Node, slab: Slab) -> None:
    h = slab.alloc_many(4)
    fill(slab, h)
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        dev = rdma_of(c).device
        before = dev.registrations
        c._drop()  # next call reconnects: new QP, same slab MR
        assert c.put([b"a%d" % i for i in range(4)], h, BLOCK, digests(4)) == [True] * 4
        assert rdma_of(c).device is dev
        assert dev.registrations == before
        assert c.reconnects >= 1


def test_two_slabs_over_one_buffer_share_one_registration(node: Node) -> None:
    """Two live slabs laid over one buffer (two managers over one host KV pool, two
    bench drivers over one arena) are one range of pages: the second client must
    reuse the first's region, not re-register it under the first's feet (which left
    the first client's QP with a dead lkey: every WRITE a local QP error)."""
    buf = np.frombuffer(bytearray(os.urandom(32 * BLOCK)), dtype=np.uint8)
    a, b = Slab.over_buffer(buf, BLOCK), Slab.over_buffer(buf, BLOCK)
    keys = [b"shared%d" % i for i in range(16)]
    with KVClient("127.0.0.1", node.port, a, transport="rdma", timeout=CLIENT_TIMEOUT) as ca:
        dev = rdma_of(ca).device
        before = dev.registrations
        with KVClient(
            "127.0.0.1", node.port, b, transport="rdma", timeout=CLIENT_TIMEOUT
        ) as cb:
            assert dev.registrations == before
            assert ca.put(keys, range(16), BLOCK, digests(16)) == [True] * 16
            assert cb.get(keys, range(16, 32), digests(16)) == [True] * 16
            assert cb.put([b"b%d" % i for i in range(4)], range(4), BLOCK, digests(4)) == [
                True
            ] * 4
        assert bytes(buf[16 * BLOCK :]) == bytes(buf[: 16 * BLOCK])
        assert ca.get(keys[:4], range(16, 20), digests(4)) == [True] * 4  # b closed: a goes on


@pytest.mark.parametrize("block", [MIN_SPLIT_VALUE_BYTES_RDMA, MIN_SPLIT_VALUE_BYTES])
def test_multi_stream_client_splits_a_big_batch_over_two_queue_pairs(block: int) -> None:
    # over RDMA from the smaller floor: 16 KiB values split, unlike over TCP
    n = MIN_SPLIT_BATCH_BYTES // block
    node = Node(block=block, pool=(n + 16) * block)
    slab = Slab(2 * n * block, block)
    try:
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        for h in src:
            slab.numpy(h)[:] = memoryview(bytearray(os.urandom(block)))
        keys = [b"ms%d" % i for i in range(n)]
        with MultiStreamClient(
            "127.0.0.1", node.port, slab, streams=2, transport="rdma", timeout=CLIENT_TIMEOUT
        ) as c:
            assert c.transport_name == "rdma"
            assert c.min_split_value == c.min_split_get_value == MIN_SPLIT_VALUE_BYTES_RDMA
            qps = {id(rdma_of(k).qp) for k in c.clients}
            assert len(qps) == 2  # one queue pair per connection
            assert c.put(keys, src, block, digests(n)) == [True] * n
            assert c.get(keys, dst, digests(n)) == [True] * n
            assert c.split_batches == 2
            assert all(rdma_of(k).last_stats is not None for k in c.clients)  # both moved bytes
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
    finally:
        slab.close()
        node.kill()


def test_unset_streams_is_two_queue_pairs_over_rdma_and_the_tcp_default_over_tcp() -> None:
    n = MIN_SPLIT_BATCH_BYTES // BLOCK
    node = Node(pool=(n + 16) * BLOCK)
    tcp_node = Node(transport="tcp")
    slab = Slab(2 * n * BLOCK, BLOCK)
    try:
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        fill(slab, src)
        keys = [b"d%d" % i for i in range(n)]
        c = open_remote(f"127.0.0.1:{node.port}", slab, transport="auto", timeout=CLIENT_TIMEOUT)
        with c:
            assert isinstance(c, MultiStreamClient) and c.streams == STREAMS_RDMA == 2
            assert [k.transport_name for k in c.clients] == ["rdma", "rdma"]
            assert len({id(rdma_of(k).qp) for k in c.clients}) == 2
            assert c.put(keys, src, BLOCK, digests(n)) == [True] * n
            assert c.get(keys, dst, digests(n)) == [True] * n
            assert c.split_batches == 2
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
        one = open_remote(f"127.0.0.1:{node.port}", slab, transport="rdma", streams=1,
                          timeout=CLIENT_TIMEOUT)
        with one:
            assert isinstance(one, KVClient) and one.transport_name == "rdma"
        # auto that lands on TCP (the node offers no RDMA): TCP's count for this host,
        # every connection over TCP (never a mix)
        tcp = open_remote(f"127.0.0.1:{tcp_node.port}", slab, transport="auto",
                          timeout=CLIENT_TIMEOUT)
        with tcp:
            want = default_streams("tcp", usable_cpus())
            conns = tcp.clients if isinstance(tcp, MultiStreamClient) else [tcp]
            assert len(conns) == want and tcp.transport_name == "tcp"
            assert [k.transport_name for k in conns] == ["tcp"] * want
    finally:
        slab.close()
        node.kill()
        tcp_node.kill()


def test_unset_streams_goes_on_with_one_queue_pair_when_a_second_fails(
    node: Node, slab: Slab, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    opened: list[KVClient] = []

    def second_fails(*args: Any, **kwargs: Any) -> KVClient:
        if opened:  # fault injection: the node's device is out of QPs, say
            raise RdmaError("injected: ibv_create_qp failed")
        opened.append(KVClient(*args, **kwargs))
        return opened[0]

    monkeypatch.setattr(streams, "KVClient", second_fails)
    src, dst = slab.alloc_many(8), slab.alloc_many(8)
    fill(slab, src)
    keys = [b"g%d" % i for i in range(8)]
    with caplog.at_level(logging.WARNING, logger="rdmakv.client.streams"):
        c = streams.MultiStreamClient(
            "127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT
        )
    with c:
        assert c.streams == 1 and c.clients == opened and c.transport_name == "rdma"
        assert any("connection 2 of 2" in r.getMessage() for r in caplog.records)
        assert c.put(keys, src, BLOCK, digests(8)) == [True] * 8
        assert c.get(keys, dst, digests(8)) == [True] * 8
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
    opened.clear()
    with pytest.raises(RdmaError, match="injected"):  # asked for two: as loud as one client
        streams.MultiStreamClient(
            "127.0.0.1", node.port, slab, streams=2, transport="rdma", timeout=CLIENT_TIMEOUT
        )


def test_bad_remote_address_is_refused_before_posting(node: Node, slab: Slab) -> None:
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.info is not None
        outside = c.info.pool_base + c.info.pool_len
        with pytest.raises(ConfigError, match="outside the node pool"):
            rdma_of(c).write([IoOp(0, outside, BLOCK)], CLIENT_TIMEOUT)


def test_bad_rkey_fails_the_ops_then_recovers(node: Node, slab: Slab) -> None:
    src = slab.alloc_many(8)
    dst = slab.alloc_many(8)
    fill(slab, src)
    keys = [b"r%d" % i for i in range(8)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.put(keys, src, BLOCK, digests(8)) == [True] * 8
        tp = rdma_of(c)
        assert tp._remote is not None and c.info is not None
        # Fault injection: a wrong rkey, as a confused or stale peer would send.
        tp._remote = dataclasses.replace(tp._remote, rkey=tp._remote.rkey ^ 0x3C3C)
        ops = [IoOp(slab.offset(dst[i]), c.info.pool_base + i * BLOCK, BLOCK) for i in range(4)]
        with pytest.raises(RdmaOpsFailed) as ei:
            tp.read(ops, CLIENT_TIMEOUT).result()
        assert ei.value.failed == [0, 1, 2, 3]
        assert all(s == verbs.ST_REMOTE_ACCESS for s in ei.value.statuses.values())
        assert tp.reconnects >= 1  # QP reset and reconnected with the node's real rkey
        assert c.get(keys, dst, digests(8)) == [True] * 8
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))


def test_qp_error_recovers_on_the_next_batch(node: Node, slab: Slab) -> None:
    src = slab.alloc_many(6)
    dst = slab.alloc_many(6)
    fill(slab, src)
    keys = [b"q%d" % i for i in range(6)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.put(keys, src, BLOCK, digests(6)) == [True] * 6
        tp = rdma_of(c)
        tp.qp.force_error()  # fault injection: the QP breaks under us
        # flushed ops are retried on a reconnected QP: the get still succeeds
        assert c.get(keys, dst, digests(6)) == [True] * 6
        assert tp.reconnects == 1
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))


def test_node_killed_gives_errors_not_hangs_then_reconnects(slab: Slab) -> None:
    src = slab.alloc_many(8)
    dst = slab.alloc_many(8)
    fill(slab, src)
    keys = [b"n%d" % i for i in range(8)]
    n = Node()
    try:
        c = KVClient("127.0.0.1", n.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT,
                     connect_retries=1)
        assert c.put(keys, src, BLOCK, digests(8)) == [True] * 8
        n.kill()
        with pytest.raises(TransportError):
            c.get(keys, dst, digests(8))
        n2 = Node()
        try:
            c.port = n2.port  # the node came back (on a new port)
            assert c.put(keys, src, BLOCK, digests(8)) == [True] * 8
            assert c.transport_name == "rdma"
            assert c.get(keys, dst, digests(8)) == [True] * 8
            for s, d in zip(src, dst, strict=True):
                assert bytes(slab.view(d)) == bytes(slab.view(s))
        finally:
            c.close()
            n2.kill()
    finally:
        n.kill()


def test_auto_uses_tcp_when_node_has_no_rdma(slab: Slab, caplog: pytest.LogCaptureFixture) -> None:
    n = Node(transport="tcp")
    try:
        with KVClient("127.0.0.1", n.port, slab, transport="auto", timeout=CLIENT_TIMEOUT) as c:
            assert c.transport_name == "tcp"
            h = slab.alloc_many(2)
            fill(slab, h)
            assert c.put([b"t0", b"t1"], h, BLOCK, digests(2)) == [True, True]
    finally:
        n.kill()


def test_auto_falls_back_to_tcp_when_rdma_setup_fails(
    node: Node, slab: Slab, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_connect(self: verbs.QueuePair, remote: verbs.ConnInfo) -> None:
        raise RdmaError("injected: modify_qp(RTR) failed")

    monkeypatch.setattr(verbs.QueuePair, "connect", broken_connect)  # fault injection
    src = slab.alloc_many(4)
    dst = slab.alloc_many(4)
    fill(slab, src)
    keys = [b"f%d" % i for i in range(4)]
    with caplog.at_level(logging.WARNING):
        c = KVClient("127.0.0.1", node.port, slab, transport="auto", timeout=CLIENT_TIMEOUT)
    with c:
        assert c.transport_name == "tcp"
        assert any("using tcp" in r.getMessage() for r in caplog.records)
        assert c.put(keys, src, BLOCK, digests(4)) == [True] * 4
        assert c.get(keys, dst, digests(4)) == [True] * 4
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
    with pytest.raises(RdmaError):  # an explicit "rdma" never falls back silently
        KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT,
                 connect_retries=1)


def test_batch_past_its_deadline_times_out_then_recovers(node: Node, slab: Slab) -> None:
    src = slab.alloc_many(NBLOCKS)
    dst = slab.alloc_many(NBLOCKS)
    fill(slab, src)
    keys = [b"d%d" % i for i in range(NBLOCKS)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        tp = rdma_of(c)
        # Extents the node really granted this session (ALLOC over the client's
        # own connection, keys the put below does not use): with per-extent
        # memory windows any other address is refused by the device, and a
        # refusal could complete before a 1 us deadline is checked.
        spare = [b"t%d" % i for i in range(NBLOCKS)]
        answer = c._call(
            Op.ALLOC, encode_alloc(spare, [BLOCK] * NBLOCKS, digests(NBLOCKS, salt=7)), "ALLOC"
        )
        ext = decode_extent_table(answer, NBLOCKS)
        assert (ext["status"] == AllocStatus.OK).all()
        ops = make_op_table([slab.offset(h) for h in src], ext["addr"], ext["length"], ext["rkey"])
        # A deadline far shorter than moving 1.5 MiB takes: a real timeout.
        with pytest.raises(TransportTimeout):
            tp.write(ops, 1e-6).result()
        assert tp.reconnects >= 1
        assert c.put(keys, src, BLOCK, digests(NBLOCKS)) == [True] * NBLOCKS
        assert c.get(keys, dst, digests(NBLOCKS)) == [True] * NBLOCKS
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))


class _MisaimOneOp:
    """Fault injection: the real QP, with op ``index`` of the first batch of
    ``opcode`` redirected just past the node's registered pool, so the device
    really fails exactly that op with a remote access error (the other ops,
    flushed behind it, are retried by the transport). A wrong address inside
    the pool cannot be produced otherwise: the node's MR covers all of it, and
    the client refuses addresses outside it before posting."""

    def __init__(self, opcode: int, index: int, pool_end: int) -> None:
        self.opcode = opcode
        self.index = index
        self.pool_end = pool_end
        self.real_run = verbs.QueuePair.run
        self.done = False

    def run(self, qp: verbs.QueuePair, opcode: int, mr: verbs.MemoryRegion, rkey: int,
            ops: object, timeout: float, **kw: int) -> tuple[list[int], verbs.JobStats]:
        if opcode == self.opcode and not self.done and len(ops) > self.index:
            self.done = True
            ops = np.array(ops, dtype=np.uint64)  # a copy, IoOps or a table alike
            ops[self.index, 1] = self.pool_end
        return self.real_run(qp, opcode, mr, rkey, ops, timeout, **kw)


def _inject(monkeypatch: pytest.MonkeyPatch, inj: _MisaimOneOp | _StallOnce) -> None:
    """Route every ``QueuePair.run`` through ``inj.run``, which calls the real one."""

    def run(qp: verbs.QueuePair, *args: object, **kw: int) -> tuple[list[int], verbs.JobStats]:
        return inj.run(qp, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(verbs.QueuePair, "run", run)


def _misaim(
    monkeypatch: pytest.MonkeyPatch, c: KVClient, opcode: int, index: int
) -> _MisaimOneOp:
    assert c.info is not None
    inj = _MisaimOneOp(opcode, index, c.info.pool_base + c.info.pool_len)
    _inject(monkeypatch, inj)
    return inj


def _filled(slab: Slab, n: int, prefix: bytes) -> tuple[list[int], list[int], list[bytes]]:
    """``n`` source blocks filled with bytes, ``n`` destination blocks, ``n`` keys."""
    src = slab.alloc_many(n)
    dst = slab.alloc_many(n)
    fill(slab, src)
    return src, dst, [b"%s%d" % (prefix, i) for i in range(n)]


class _StallOnce:
    """Fault injection: the real QP's first READ batch ends as the native loop
    ends one on a stall (``test_verbs`` produces a real one): the QP forced
    to ERROR and every op reported ``ST_STALLED``, its bytes zeroed as if the
    device never delivered them. A device that stops completing cannot be
    produced on demand against a live node (soft-RoCE once left a batch
    without completions for 120 s)."""

    def __init__(self) -> None:
        self.real_run = verbs.QueuePair.run
        self.stalled = 0
        self.reads = 0

    def run(self, qp: verbs.QueuePair, opcode: int, mr: verbs.MemoryRegion, rkey: int,
            ops: object, timeout: float, **kw: int) -> tuple[list[int], verbs.JobStats]:
        status, stats = self.real_run(qp, opcode, mr, rkey, ops, timeout, **kw)
        if opcode != verbs.OP_READ:
            return status, stats
        self.reads += 1
        if self.stalled:
            return status, stats
        table = np.asarray(ops, dtype=np.uint64)
        view = np.frombuffer((ctypes.c_char * mr.length).from_address(mr.addr), np.uint8)
        for local, _remote, length in table[:, :3].tolist():
            view[local : local + length] = 0
        qp.force_error()
        self.stalled = len(table)
        return [verbs.ST_STALLED] * len(table), dataclasses.replace(
            stats, first_error=verbs.ST_STALLED, failed_ops=len(table)
        )


@pytest.mark.parametrize(("n", "sub_batches"), [(64, 1), (NBLOCKS, 2)])
def test_a_stalled_read_batch_is_moved_again_on_a_reset_qp(
    node: Node, slab: Slab, monkeypatch: pytest.MonkeyPatch, n: int, sub_batches: int
) -> None:
    """The stalled batch is moved again on a reset QP. With two sub-batches the
    second LOOKUP was sent ahead, so its leases were granted on the old QP: the
    node rebinds their windows on the new one and the transport maps their
    rkeys, so every sub-batch still moves."""
    sizes = sub_batch_sizes(n, 1 << 14)
    assert len(sizes) == sub_batches
    src, dst, keys = _filled(slab, n, b"st")
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.put(keys, src, BLOCK, digests(n)) == [True] * n
        tp = rdma_of(c)
        reconnects = tp.reconnects
        inj = _StallOnce()
        _inject(monkeypatch, inj)
        hits = c.get(keys, dst, digests(n))
        if sub_batches == 1:
            assert inj.stalled == n and inj.reads == 2  # one stalled batch, then moved again
        else:
            assert inj.stalled > 0
        assert hits == [True] * n
        assert tp.reconnects > reconnects  # on a reset QP
        for i in range(n):
            assert bytes(slab.view(dst[i])) == bytes(slab.view(src[i])), f"key {i}"
        assert c.stats()["leases_active"] == 0


def test_failed_read_ops_are_misses_for_exactly_those_keys(
    node: Node, slab: Slab, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 12
    bad = 5  # every key hits, so read op #5 of the (single) batch is key #5
    src, dst, keys = _filled(slab, n, b"g")
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        assert c.put(keys, src, BLOCK, digests(n)) == [True] * n
        tp = rdma_of(c)
        reconnects = tp.reconnects
        inj = _misaim(monkeypatch, c, verbs.OP_READ, bad)
        hits = c.get(keys, dst, digests(n))
        assert inj.done  # the device really saw the bad op
        assert hits == [i != bad for i in range(n)]
        assert tp.reconnects > reconnects  # the QP was reset after the error
        for i in range(n):
            if i != bad:
                assert bytes(slab.view(dst[i])) == bytes(slab.view(src[i])), f"key {i}"
        assert c.stats()["leases_active"] == 0  # every lease released, the failed op's too
        monkeypatch.undo()
        assert c.get(keys[bad : bad + 1], dst[bad : bad + 1], digests(n)[bad : bad + 1]) == [True]
        assert bytes(slab.view(dst[bad])) == bytes(slab.view(src[bad]))


def test_failed_write_ops_are_false_and_aborted_for_exactly_those_keys(
    node: Node, slab: Slab, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 12
    bad = 3  # every key is new, so write op #3 of the (single) batch is key #3
    src, dst, keys = _filled(slab, n, b"w")
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        inj = _misaim(monkeypatch, c, verbs.OP_WRITE, bad)
        ok = c.put(keys, src, BLOCK, digests(n))
        assert inj.done  # the device really saw the bad op
        assert ok == [i != bad for i in range(n)]
        monkeypatch.undo()
        st = c.stats()
        assert st["pending"] == 0  # the failed op's extent was aborted, not left dangling
        assert st["entries"] == n - 1
        assert c.exists(keys) == [i != bad for i in range(n)]
        assert c.get(keys, dst, digests(n)) == [i != bad for i in range(n)]
        for i in range(n):
            if i != bad:
                assert bytes(slab.view(dst[i])) == bytes(slab.view(src[i])), f"key {i}"
        # the key can be stored again once the fault is gone
        one = slice(bad, bad + 1)
        assert c.put(keys[one], src[one], BLOCK, digests(n)[one]) == [True]
        assert c.get(keys[one], dst[one], digests(n)[one]) == [True]
        assert bytes(slab.view(dst[bad])) == bytes(slab.view(src[bad]))
