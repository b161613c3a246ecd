"""RDMA confinement with memory windows (issue 13 part 3), on a real device.

A node with ``rdma_confinement="windows"`` (the default) registers its pool
without remote access and binds a type-2 memory window on a session's own QP
for each batch of extents it hands that session: ALLOC'd extents are writable
until COMMIT/ABORT/disconnect, leased ones readable until RELEASE/expiry/
disconnect. These tests attack a real ``rdmakv serve`` process with real RDMA
ops (rkeys of other clients, revoked rkeys, the pool MR's rkey) and check that
the device refuses them and the stored bytes stay as they were.

soft-RoCE (rxe) enforces a window's rkey, QP and lifetime but not its address
range (docs/security.md, rdmakv.transport.rdma.node_side.RdmaNodeDataPath), so no
test here relies on the range check.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from rdmakv import doctor
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.errors import RdmaUnavailable
from rdmakv.node.process import LocalNodeProcess
from rdmakv.node.server import KVNode
from rdmakv.transport.base import IoFuture, IoOp, Ops, io_ops
from rdmakv.transport.rdma import verbs
from rdmakv.transport.rdma.client_side import RdmaTransport
from rdmakv.transport.rdma.device import RdmaOpsFailed
from rdmakv.wire.batches import decode_lookup_results, encode_keys, encode_u64_list
from rdmakv.wire.format import LOOKUP_FLAG_LEASE, LookupResult, Op

pytestmark = pytest.mark.timeout(240)

BLOCK = 16384
NBLOCKS = 16
POOL = 128 * BLOCK
CLIENT_TIMEOUT = 20.0  # soft-RoCE under emulation is slow; never a timing assertion


@pytest.fixture()
def node() -> Iterator[LocalNodeProcess]:
    """A real ``rdmakv serve --transport rdma`` process (confinement: the default)."""
    n = LocalNodeProcess(
        {"pool-size": str(POOL), "block-size": str(BLOCK), "transport": "rdma"},
        extra_args=["--no-lock"],
    )
    yield n
    n.kill()


@pytest.fixture()
def slab() -> Iterator[Slab]:
    s = Slab(NBLOCKS * 4 * BLOCK, BLOCK)
    yield s
    s.close()


def fill(slab: Slab, handles: list[int]) -> None:
    for h in handles:
        slab.numpy(h)[:] = memoryview(bytearray(os.urandom(BLOCK)))


def digests(n: int) -> list[bytes]:
    return [i.to_bytes(16, "little") for i in range(n)]


def rdma_of(c: KVClient) -> RdmaTransport:
    tp = c._tp  # the test inspects the live transport (no way to get it otherwise)
    assert isinstance(tp, RdmaTransport)
    return tp


class _RecordWrites:
    """Wraps a real transport's ``write`` to keep the ops the client posted
    (the test needs the rkeys the node handed out with ALLOC)."""

    def __init__(self, tp: RdmaTransport) -> None:
        self.tp = tp
        self.real = tp.write
        self.ops: list[IoOp] = []
        tp.write = self  # type: ignore[method-assign]

    def __call__(self, ops: Ops, timeout: float) -> IoFuture:
        self.ops.extend(io_ops(ops))  # the client hands over a table
        return self.real(ops, timeout)


def leased_lookup(c: KVClient, keys: list[bytes]) -> list[LookupResult | None]:
    """LOOKUP with a lease over the client's own control channel."""
    assert c._ch is not None
    _, payload = c._ch.call(Op.LOOKUP, encode_keys(keys), "LOOKUP", flags=LOOKUP_FLAG_LEASE)
    return decode_lookup_results(payload, len(keys))


def release(c: KVClient, lease_ids: list[int]) -> None:
    assert c._ch is not None
    c._ch.call(Op.RELEASE, encode_u64_list(lease_ids), "RELEASE")


def refused(tp: RdmaTransport, opcode: int, ops: list[IoOp]) -> bool:
    """True when the device refused the ops: every op failed, with remote
    access errors (ops behind a refused one are only flushed)."""
    run = tp.write if opcode == verbs.OP_WRITE else tp.read
    try:
        run(ops, CLIENT_TIMEOUT).result()
    except RdmaOpsFailed as e:
        codes = set(e.statuses.values())
        return (
            e.failed == list(range(len(ops)))
            and verbs.ST_REMOTE_ACCESS in codes
            and codes <= {verbs.ST_REMOTE_ACCESS, verbs.ST_FLUSHED}
        )
    return False


def test_own_extents_round_trip_through_windows(node: LocalNodeProcess, slab: Slab) -> None:
    src = slab.alloc_many(NBLOCKS)
    dst = slab.alloc_many(NBLOCKS)
    fill(slab, src)
    keys = [b"w%d" % i for i in range(NBLOCKS)]
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
        tp = rdma_of(c)
        rec = _RecordWrites(tp)
        assert c.put(keys, src, BLOCK, digests(NBLOCKS)) == [True] * NBLOCKS
        rkeys = {op.rkey for op in rec.ops}
        assert tp._remote is not None
        assert 0 not in rkeys and tp._remote.rkey not in rkeys  # window rkeys, not the MR's
        stats = tp.last_stats
        assert stats is not None and stats.wrs < NBLOCKS  # contiguous extents share a window
        assert c.get(keys, dst, digests(NBLOCKS)) == [True] * NBLOCKS
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
        assert c.stats()["leases_active"] == 0


def test_other_clients_and_revoked_rkeys_are_refused(node: LocalNodeProcess, slab: Slab) -> None:
    src = slab.alloc_many(4)
    junk = slab.alloc_many(4)
    dst = slab.alloc_many(4)
    fill(slab, src)
    for h in junk:
        slab.numpy(h)[:] = 0xEE
    keys = [b"v%d" % i for i in range(4)]
    with (
        KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as a,
        KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as b,
    ):
        ta, tb = rdma_of(a), rdma_of(b)
        rec = _RecordWrites(ta)
        assert a.put(keys, src, BLOCK, digests(4)) == [True] * 4
        alloc_ops = list(rec.ops)
        addrs = [op.remote_addr for op in alloc_ops]
        assert tb._remote is not None

        # 1. The writer's own ALLOC rkey died at COMMIT.
        again = [IoOp(slab.offset(j), op.remote_addr, BLOCK, op.rkey)
                 for j, op in zip(junk, alloc_ops, strict=True)]
        assert refused(ta, verbs.OP_WRITE, again)

        # 2. Another client: the writer's rkey (bound on the writer's QP only),
        # the pool MR's rkey, and its own READ-only lease rkey are all refused.
        found = leased_lookup(b, keys)
        assert all(f is not None for f in found)
        leases = sorted({f.lease_id for f in found if f is not None})
        read_rkeys = [f.extent.rkey for f in found if f is not None]
        assert [f.extent.addr for f in found if f is not None] == addrs
        for rkeys in ([op.rkey for op in alloc_ops], [tb._remote.rkey] * 4, read_rkeys):
            attack = [IoOp(slab.offset(j), addr, BLOCK, rk)
                      for j, addr, rk in zip(junk, addrs, rkeys, strict=True)]
            assert refused(tb, verbs.OP_WRITE, attack), rkeys

        # 2b. A window is bound to its session's QP: the writer's own live READ
        # lease rkeys do not work from another client.
        mine = leased_lookup(a, keys)
        theirs = [IoOp(slab.offset(d), f.extent.addr, BLOCK, f.extent.rkey)
                  for d, f in zip(dst, mine, strict=True) if f is not None]
        assert len(theirs) == 4
        assert refused(tb, verbs.OP_READ, theirs)
        release(a, sorted({f.lease_id for f in mine if f is not None}))

        # 3. Reads: with the lease's rkeys they work (after B's QP was reset by
        # the refusals above: the node rebound its windows, the transport maps
        # the rkeys); without a lease (the MR's rkey) they are refused.
        reads = [IoOp(slab.offset(d), addr, BLOCK, rk)
                 for d, addr, rk in zip(dst, addrs, read_rkeys, strict=True)]
        tb.read(reads, CLIENT_TIMEOUT).result()
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))
        no_lease = [IoOp(slab.offset(d), addr, BLOCK, 0)
                    for d, addr in zip(dst, addrs, strict=True)]
        assert refused(tb, verbs.OP_READ, no_lease)
        # ... and after RELEASE the lease's rkeys are refused too.
        release(b, leases)
        assert refused(tb, verbs.OP_READ, reads)

        # 4. The stored values never changed.
        for d in dst:
            slab.numpy(d)[:] = 0
        assert a.get(keys, dst, digests(4)) == [True] * 4
        for s, d in zip(src, dst, strict=True):
            assert bytes(slab.view(d)) == bytes(slab.view(s))


def test_windows_are_revoked_at_abort_and_disconnect(node: LocalNodeProcess, slab: Slab) -> None:
    src = slab.alloc_many(2)
    fill(slab, src)
    with KVClient("127.0.0.1", node.port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as a:
        assert a.put([b"x0", b"x1"], src, BLOCK, digests(2)) == [True] * 2
        info: Any = a.stats()
        before = info["blocks_used"]
        # Many clients come and go with leases held: no window outlives them.
        for _ in range(3):
            with KVClient("127.0.0.1", node.port, slab, transport="rdma",
                          timeout=CLIENT_TIMEOUT) as b:
                assert all(f is not None for f in leased_lookup(b, [b"x0", b"x1"]))
        # The node notices a closed connection on its own time: wait (bounded).
        deadline = time.monotonic() + 60
        while a.stats()["leases_active"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert a.stats()["leases_active"] == 0
        assert a.stats()["blocks_used"] == before
        # and the node still binds windows for a new client
        dst = slab.alloc_many(2)
        with KVClient("127.0.0.1", node.port, slab, transport="rdma",
                      timeout=CLIENT_TIMEOUT) as c:
            assert c.get([b"x0", b"x1"], dst, digests(2)) == [True] * 2


def test_confinement_none_exposes_the_pool_by_choice(slab: Slab) -> None:
    n = KVNode(pool_size=POOL, block_size=BLOCK, host="127.0.0.1", port=0,
               transports=("rdma",), lock_pool=False, rdma_confinement="none")
    _, port = n.start()
    t = threading.Thread(target=n.serve_forever, daemon=True)
    t.start()
    try:
        src = slab.alloc_many(2)
        dst = slab.alloc_many(2)
        fill(slab, src)
        with KVClient("127.0.0.1", port, slab, transport="rdma", timeout=CLIENT_TIMEOUT) as c:
            assert c.info is not None and c.info.rkey != 0  # one pool-wide rkey
            assert c.put([b"n0", b"n1"], src, BLOCK, digests(2)) == [True] * 2
            tp = rdma_of(c)
            # No lease, rkey 0 (= the connection's pool rkey): the read succeeds.
            ops = [IoOp(slab.offset(d), c.info.pool_base + i * BLOCK, BLOCK)
                   for i, d in enumerate(dst)]
            tp.read(ops, CLIENT_TIMEOUT).result()
    finally:
        n.stop()
        t.join(30)


def test_a_device_without_windows_is_named_and_served_only_by_choice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """rxe has type-2 windows, so a device without them is injected: the real
    device, answering "no windows" (the one thing such an HCA answers differently).

    Default confinement: rdma refuses to start, naming the setting (auto serves
    tcp alone); ``rdma_confinement="none"`` serves rdma with the pool-wide rkey;
    ``rdmakv doctor`` says NOT supported."""
    monkeypatch.setattr(verbs.Device, "supports_windows", property(lambda self: False))
    common: dict[str, Any] = dict(
        pool_size=POOL, block_size=BLOCK, host="127.0.0.1", port=0, lock_pool=False
    )
    with pytest.raises(RdmaUnavailable, match="rdma_confinement='none'"):
        KVNode(transports=("rdma",), **common)
    auto = KVNode(transports=("rdma",), optional_transports=True, **common)
    opted = KVNode(transports=("rdma",), rdma_confinement="none", **common)
    try:
        assert auto.transports == ("tcp",)
        assert opted.transports == ("tcp", "rdma")
    finally:
        for n in (auto, opted):  # never started: release what construction took
            for dp in n.datapaths:
                dp.close()
            n.pool.close()
    assert doctor._windows(verbs.select()).startswith("NOT supported")
