"""The RDMA-side peers of ``rdmakv bench``: InfiniStore over RDMA and perftest.

Both need an RDMA device (soft-RoCE ``rxe0`` in the VM in CI): InfiniStore's
server refuses to start without one. One InfiniStore server serves the whole
module (it takes 20-40 s to start in the VM); its RDMA connection pins about
512 MiB on each side, so the VM runs with ``--mem 6144``.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterator

import numpy as np
import pytest

from rdmakv.perf.driver import Arena, Workload
from rdmakv.perf.drivers.infinistore import (
    InfiniStoreDriver,
    InfiniStoreServer,
    alloc_kib,
    prealloc_gib,
    start_server,
)
from rdmakv.perf.drivers.perftest import PerftestDriver, perftest_gbps
from rdmakv.perf.drivers.rdmakv_node import RdmakvDriver

BLOCK = 64 * 1024
BLOCKS = 8


def arena(nbytes: int) -> tuple[mmap.mmap, Arena]:
    m = mmap.mmap(-1, nbytes)
    return m, np.frombuffer(m, dtype=np.uint8)


@pytest.fixture(scope="module")
def server() -> Iterator[InfiniStoreServer]:
    pytest.importorskip("infinistore", reason="pip install infinistore uvloop==0.21.0")
    s = start_server(1)
    yield s
    s.close()


def test_infinistore_driver_round_trip(server: InfiniStoreServer) -> None:
    work = Workload(block_bytes=BLOCK, blocks=BLOCKS, batch=3)  # batches of 3, 3, 2: a short tail
    (ms, src), (md, dst) = arena(BLOCK * BLOCKS), arena(BLOCK * BLOCKS)
    src[:] = np.random.default_rng(7).integers(0, 256, src.size, dtype=np.uint8)
    drv = InfiniStoreDriver(server=server.address)
    try:
        drv.open(work, src, dst)
        keys = work.keys("t")
        drv.put(keys)
        drv.get(keys)
        assert bytes(dst) == bytes(src)
        assert drv.exists([*keys[:2], b"missing-key-0000"]) == [True, True, False]
        drv.discard(keys[:1])
        assert drv.exists(keys[:2]) == [False, True]
    finally:
        drv.close()
        del src, dst
        ms.close()
        md.close()
    assert server.proc.poll() is None  # a driver given an address leaves the server running


@pytest.mark.anydevice
def test_pool_sizing() -> None:
    assert alloc_kib(16 * 1024) == 16 and alloc_kib(4096) == 16 and alloc_kib(1 << 20) == 64
    assert prealloc_gib(Workload(BLOCK, BLOCKS, 8)) == 1
    # 1000 x 1 MiB with headroom: 2 GiB.
    assert prealloc_gib(Workload(1 << 20, 1000, 64)) == 2


def test_perftest_small() -> None:
    got = perftest_gbps(BLOCK, 200)
    assert set(got) == {"write_gbps", "read_gbps"}
    assert got["write_gbps"] > 0 and got["read_gbps"] > 0


@pytest.mark.parametrize("qps", [1, 2])
def test_perftest_driver_reports_its_own_time(qps: int) -> None:
    work = Workload(block_bytes=BLOCK, blocks=64, batch=64)
    (ms, src), (md, dst) = arena(BLOCK * 64), arena(BLOCK * 64)
    drv = PerftestDriver("rdma", qps=qps)
    try:
        drv.open(work, src, dst)
        drv.put(work.keys("p"))
        assert drv.last_seconds > 0 and drv.last_gbps > 0
        drv.get(work.keys("p"))
        assert drv.last_seconds > 0 and drv.last_gbps > 0
    finally:
        drv.close()
        del src, dst
        ms.close()
        md.close()


@pytest.mark.timeout(300)
def test_rdmakv_driver_reconnects_over_rdma() -> None:
    """``reconnect()`` between repeats over RDMA: new clients to the same node
    (new connections and QPs; the arenas' memory registrations are the
    device's, one per range, and are reused), still RDMA, every byte read
    back before and after."""
    work = Workload(block_bytes=BLOCK, blocks=BLOCKS, batch=BLOCKS)
    (ms, src), (md, dst) = arena(BLOCK * BLOCKS), arena(BLOCK * BLOCKS)
    src[:] = np.random.default_rng(13).integers(0, 256, src.size, dtype=np.uint8)
    drv = RdmakvDriver("rdma")
    try:
        drv.open(work, src, dst)
        for tag in ("before", "after"):
            if tag == "after":
                old, server = drv._put_c, drv.server
                drv.reconnect()
                assert drv._put_c is not old and drv.server == server
            assert drv._put_c is not None and drv._put_c.transport_name == "rdma"
            keys = work.keys(tag)
            dst[:] = 0
            drv.put(keys)
            drv.get(keys)
            assert bytes(dst) == bytes(src), tag
    finally:
        drv.close()
        del src, dst
        ms.close()
        md.close()
