"""The vLLM tier's rdmakv half (:class:`~rdmakv.connectors.chunk_tier.ChunkTier`) over RDMA.

The soft-RoCE VM has no vLLM, so this drives the engine-independent half of
the tier, which is everything the vLLM half (``rdmakv.connectors.vllm_tier``)
only maps vLLM's calls onto: a page-aligned buffer of chunk rows stands in for
vLLM's CPU tier (``primary_kv_view``, an mmap of the same shape), registered
once with the NIC as the client's slab; stores write rows one-sided, loads read
the node's values straight into another engine's rows, lookups go through the
batched lookup thread. The vLLM half is tested against the real vLLM classes
over TCP in ``tests/engines/test_vllm_tier.py``.
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator

import numpy as np
import pytest

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.client.node_client import KVClient
from rdmakv.connectors.chunk_tier import ChunkTier, JobOutcome
from rdmakv.connectors.group_stores import StoreOptions
from rdmakv.node.process import LocalNodeProcess

pytestmark = pytest.mark.timeout(300)

CHUNK = 64 * 1024
ROWS = 32
NS = KeyNamespace(model="m", dtype="bfloat16", kv_layout="vllm-tier.v1:test")
CLIENT_TIMEOUT = 20.0  # emulated soft-RoCE is slow; never a timing assertion
WAIT_S = 120.0


@pytest.fixture
def node() -> Iterator[LocalNodeProcess]:
    n = LocalNodeProcess(
        {"pool-size": str(4 * ROWS * CHUNK), "block-size": str(CHUNK), "transport": "rdma"},
        extra_args=["--no-lock"],
    )
    yield n
    n.kill()


def engine(endpoint: str) -> tuple[ChunkTier, np.ndarray]:
    """A tier over an mmap of ``ROWS`` chunk rows, as vLLM's CPU tier lays it out."""
    rows = np.frombuffer(mmap.mmap(-1, ROWS * CHUNK), dtype=np.uint8).reshape(ROWS, CHUNK)
    options = StoreOptions.from_mapping(
        {"node": endpoint, "transport": "rdma", "timeout": CLIENT_TIMEOUT, "offload": "all"}
    )
    return ChunkTier(memoryview(rows), CHUNK, NS, options, label="rdma-test"), rows


def wait_jobs(tier: ChunkTier, n: int) -> list[JobOutcome]:
    deadline = time.monotonic() + WAIT_S
    got: list[JobOutcome] = []
    while len(got) < n:
        got += tier.finished()
        assert time.monotonic() < deadline, "jobs never finished"
        time.sleep(0.005)
    return got


def test_chunk_tier_stores_finds_and_loads_rows_over_rdma(node: LocalNodeProcess) -> None:
    a, rows_a = engine(node.endpoint)
    b, rows_b = engine(node.endpoint)
    try:
        assert a.transport_name == "rdma" and b.transport_name == "rdma"
        names = [f"chunk-{i}".encode() for i in range(16)]
        rng = np.random.default_rng(5)
        rows_a[:16] = rng.integers(0, 256, size=(16, CHUNK), dtype=np.uint8)
        a.store(1, names, range(16), plan=lambda: (list(range(16)), [None] * 16))
        (stored,) = wait_jobs(a, 1)
        assert stored.success and stored.nbytes == 16 * CHUNK
        # the other engine asks: None until the node answered, then found
        assert b.lookup(names[0], "r") is None
        for n in names[1:]:
            b.lookup(n, "r")
        b.flush_lookups()
        deadline = time.monotonic() + WAIT_S
        while not all(b.lookup(n, "r") for n in names):
            assert time.monotonic() < deadline, "lookups never answered"
            time.sleep(0.005)
        # two chunks vanish between lookup and load: the load reports exactly those
        with KVClient(*node.address, None, transport="tcp") as c:
            assert c.delete(b.keys.keys([names[3], names[9]])) == [True, True]
        b.load(2, names, range(16, 32))
        (loaded,) = wait_jobs(b, 1)
        assert loaded.ok == [i not in (3, 9) for i in range(16)]
        for i in range(16):
            if i not in (3, 9):
                assert np.array_equal(rows_b[16 + i], rows_a[i])
        assert b.lookup(names[3], "r") is False  # a failed load reads absent from now on
        b.release_owner("r")
        assert b.lookups is not None and b.lookups.size() == 0
    finally:
        a.close()
        b.close()
