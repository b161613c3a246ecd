"""MultiStreamClient against a real ``rdmakv serve``: a big batch split over
several connections moves every byte, in the caller's order; small batches
and control ops use one; a failed part fails the call only after every part
finished. The one fake wraps a real KVClient to fail one part on purpose."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest
from conftest import NodeProcess
from test_client_kv import BLOCK, fill, keys_for

import rdmakv.client.node_client as client_module
import rdmakv.client.streams as streams_module
from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient
from rdmakv.client.remote import open_remote
from rdmakv.client.streams import (
    MANY_CPUS,
    MAX_STREAMS,
    MIN_SPLIT_BATCH_BYTES,
    MIN_SPLIT_GET_VALUE_BYTES,
    MIN_SPLIT_VALUE_BYTES,
    MIN_SPLIT_VALUE_BYTES_MANY_CPUS,
    MIN_SPLIT_VALUE_BYTES_RDMA,
    STREAMS_RDMA,
    STREAMS_TCP,
    STREAMS_TCP_ONE_CPU,
    TWO_CPUS,
    MultiStreamClient,
    default_streams,
    usable_cpus,
)
from rdmakv.engine.manager import KVCacheManager
from rdmakv.errors import ConfigError, ConnectionLost, RdmakvError

BIG = MIN_SPLIT_BATCH_BYTES // BLOCK + 36  # enough 64 KiB blocks to be split


def test_a_big_batch_moves_over_every_connection_in_order(
    node: NodeProcess, client_slab: Slab
) -> None:
    src, dst = client_slab.alloc_many(BIG), client_slab.alloc_many(BIG)
    digests = fill(client_slab, src, seed=3)
    keys = keys_for("ms", BIG)
    sizes = [BLOCK - 5 * i for i in range(BIG)]  # every part holds short values too
    with MultiStreamClient(*node.address, client_slab, streams=3) as c:
        assert c.streams == 3 and c.transport_name == "tcp"
        assert c.stats()["sessions_active"] == 3  # one node session per connection
        assert c.put(keys, src, sizes, digests) == [True] * BIG
        bad = list(digests)
        bad[BIG - 2] = bytes(16)  # a foreign digest in the last part: a miss there only
        got = c.get_sizes(keys, dst, bad)
        assert c.split_batches == 2
        assert c.exists(keys) == [True] * BIG
    assert got == [*sizes[: BIG - 2], None, sizes[BIG - 1]]
    for i, (s, d) in enumerate(zip(src, dst, strict=True)):
        if i != BIG - 2:
            assert bytes(client_slab.view(s, sizes[i])) == bytes(client_slab.view(d, sizes[i]))


def test_small_batches_use_one_connection(node: NodeProcess, client_slab: Slab) -> None:
    src, dst = client_slab.alloc_many(8), client_slab.alloc_many(8)
    digests = fill(client_slab, src, seed=4)
    keys = keys_for("small", 8)
    with MultiStreamClient(*node.address, client_slab, streams=2) as c:
        assert c.put(keys, src, BLOCK, digests) == [True] * 8
        assert c.get(keys, dst, digests) == [True] * 8
        assert c.split_batches == 0
        assert c.delete(keys[:3]) == [True] * 3
        assert c.exists(keys) == [False] * 3 + [True] * 5
    assert [bytes(client_slab.view(h)) for h in dst] == [bytes(client_slab.view(h)) for h in src]


@pytest.mark.parametrize("cpus", [2, 16])
def test_over_tcp_small_values_are_split_for_a_put_only_with_many_cpus_for_a_get_always(
    node_factory: Callable[..., NodeProcess], monkeypatch: pytest.MonkeyPatch, cpus: int
) -> None:
    # 16 KiB values, > 4 MiB in all. On 2 cores two threads putting (hashing and
    # sending while two node threads receive) contend for the GIL and the
    # cores: one connection. Two getting (receiving and verifying while the
    # node threads only send) use the second core: split. With a core per
    # connection's thread both are split. The CPU count is set here: a host
    # has only the cores it has.
    monkeypatch.setattr(streams_module, "usable_cpus", lambda: cpus)
    value = MIN_SPLIT_VALUE_BYTES_MANY_CPUS
    assert MIN_SPLIT_VALUE_BYTES_RDMA <= value < MIN_SPLIT_VALUE_BYTES
    assert value >= MIN_SPLIT_GET_VALUE_BYTES
    many = cpus >= MANY_CPUS
    n = MIN_SPLIT_BATCH_BYTES // value + 8
    node = node_factory(block_size=str(value), pool_size=str(2 * n * value))
    with Slab(2 * n * value, value, lock=False) as slab:
        src, dst = slab.alloc_many(n), slab.alloc_many(n)
        digests = fill(slab, src, seed=7)
        keys = keys_for("small-values", n)
        with MultiStreamClient(*node.address, slab, streams=2) as c:
            assert c.min_split_value == (
                MIN_SPLIT_VALUE_BYTES_MANY_CPUS if many else MIN_SPLIT_VALUE_BYTES
            )
            assert c.min_split_get_value == MIN_SPLIT_GET_VALUE_BYTES
            assert c.put(keys, src, value, digests) == [True] * n
            assert c.split_batches == (1 if many else 0)
            assert c.get(keys, dst, digests) == [True] * n
            assert c.split_batches == (2 if many else 1)
        assert [bytes(slab.view(h)) for h in dst] == [bytes(slab.view(h)) for h in src]


def test_one_stream_is_one_kvclient(node: NodeProcess, client_slab: Slab) -> None:
    src = client_slab.alloc_many(BIG)
    digests = fill(client_slab, src, seed=5)
    with MultiStreamClient(*node.address, client_slab, streams=1, transport="auto") as c:
        assert c.streams == 1 and c.transport_name == "tcp"
        assert c.put(keys_for("one", BIG), src, BLOCK, digests) == [True] * BIG
        assert c.split_batches == 0


def test_unset_streams_follow_the_transport_and_the_usable_cpus(
    node: NodeProcess, client_slab: Slab
) -> None:
    # over TCP two wherever a second stream's thread can run beside the first
    # (TWO_CPUS); two over RDMA on any host (tests/rdma/test_node_rdma.py)
    assert default_streams("tcp", 1) == STREAMS_TCP_ONE_CPU == 1
    for cpus in (TWO_CPUS, MANY_CPUS, 64):
        assert default_streams("tcp", cpus) == STREAMS_TCP == 2
    assert default_streams("rdma", 1) == default_streams("rdma", 64) == STREAMS_RDMA
    with MultiStreamClient(*node.address, client_slab, transport="auto") as c:
        assert c.transport_name == "tcp" and c.streams == default_streams("tcp", usable_cpus())


def test_usable_cpus_is_the_affinity_mask() -> None:
    """A process pinned to one CPU (a container's cpuset, taskset) gets one TCP
    stream whatever the host has, and ``rdmakv doctor`` says so."""
    code = (
        "import os; os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); "
        "from rdmakv.client.streams import default_streams, usable_cpus; "
        "from rdmakv import doctor; "
        "print(usable_cpus(), default_streams('tcp')); print(doctor.render(doctor.diagnose()))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=False, timeout=60).stdout.splitlines()
    assert out[0].split() == ["1", str(STREAMS_TCP_ONE_CPU)]
    assert f"tcp connections per node, streams unset: {STREAMS_TCP_ONE_CPU} (1 usable CPU)" in out


def test_a_failed_part_fails_the_call_after_the_others_finished(
    node: NodeProcess, client_slab: Slab
) -> None:
    src = client_slab.alloc_many(BIG)
    digests = fill(client_slab, src, seed=6)
    keys = keys_for("fail", BIG)
    with MultiStreamClient(*node.address, client_slab, streams=2) as c:
        second = c.clients[1]

        def failing_put(*args: object) -> list[bool]:
            raise ConnectionLost("injected: the second connection dropped")

        second.put_checked = failing_put  # type: ignore[method-assign]
        with pytest.raises(ConnectionLost, match="injected"):
            c.put(keys, src, BLOCK, digests)
        # the first part ran to its end: its keys are stored, the second's are not
        half = BIG // 2
        assert c.exists(keys) == [True] * half + [False] * (BIG - half)


def test_a_split_batch_is_checked_once_as_a_whole(
    node: NodeProcess, client_slab: Slab, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = client_slab.alloc_many(BIG), client_slab.alloc_many(BIG)
    digests = fill(client_slab, src, seed=8)
    keys = keys_for("once", BIG)
    checks: list[tuple[str, int]] = []

    def counting(name: str, real: Callable[..., object]) -> Callable[..., object]:
        def check(slab: Slab, keys: list[bytes], *args: object) -> object:
            checks.append((name, len(keys)))
            return real(slab, keys, *args)
        return check

    # KVClient.put / get_sizes call the client module's checks; a part must not
    for name in ("check_put", "check_get"):
        monkeypatch.setattr(client_module, name, counting(name, getattr(client_module, name)))
    with MultiStreamClient(*node.address, client_slab, streams=2) as c:
        assert c.put(keys, src, BLOCK, digests) == [True] * BIG
        assert c.get(keys, dst, digests) == [True] * BIG
        assert c.split_batches == 2
        assert checks == []  # the parts were checked by nobody but the whole
        small = keys_for("once-small", 4)
        assert c.put(small, src[:4], BLOCK, digests[:4]) == [True] * 4
        assert checks == [("check_put", 4)]  # a small batch: by its one KVClient
    for s, d in zip(src, dst, strict=True):
        assert bytes(client_slab.view(s, BLOCK)) == bytes(client_slab.view(d, BLOCK))


def test_bad_arguments_fail_before_anything_is_sent(node: NodeProcess, client_slab: Slab) -> None:
    for bad in (0, MAX_STREAMS + 1, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="streams must be an integer"):
            MultiStreamClient(*node.address, client_slab, streams=bad)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="streams must be an integer"):
            open_remote(node.endpoint, client_slab, streams=bad)  # type: ignore[arg-type]
    src = client_slab.alloc_many(BIG)
    with MultiStreamClient(*node.address, client_slab, streams=2) as c:
        with pytest.raises(ConfigError):
            c.put(keys_for("bad", BIG), src[:-1], BLOCK, [bytes(16)] * BIG)
        with pytest.raises(ConfigError):
            c.get(keys_for("bad", BIG), src, [b"short"] * BIG)
        # a batch too small to split goes to the first connection unchecked
        # here: that KVClient's checks still refuse it before sending anything
        small = keys_for("bad-small", 4)
        with pytest.raises(ConfigError, match="digest"):
            c.put(small, src[:4], BLOCK, [bytes(16)] * 3 + [b"short"])
        with pytest.raises(ConfigError, match="nbytes"):
            c.put(small, src[:4], BLOCK + 1, [bytes(16)] * 4)
        with pytest.raises(ConfigError, match="digest"):
            c.get(small, src[:4], [b"short"] * 4)
        assert c.exists(small) == [False] * 4
        assert c.split_batches == 0
        assert c.stats()["allocs"] == 0  # nothing reached the node
    with MultiStreamClient(*node.address, None, streams=2) as ctl, pytest.raises(
        ConfigError, match="slab"
    ):
        ctl.get([b"k"], [0], [bytes(16)])


def test_a_dead_node_raises_instead_of_hanging(
    node_factory: Callable[..., NodeProcess], client_slab: Slab
) -> None:
    n = node_factory()
    src = client_slab.alloc_many(BIG)
    digests = fill(client_slab, src, seed=7)
    with MultiStreamClient(*n.address, client_slab, streams=2, timeout=2.0) as c:
        n.kill()
        with pytest.raises(RdmakvError):
            c.put(keys_for("dead", BIG), src, BLOCK, digests)


def test_an_unreachable_node_is_as_loud_as_for_one_kvclient(client_slab: Slab) -> None:
    with pytest.raises(ConnectionLost):
        KVClient("127.0.0.1", 1, client_slab, timeout=1.0)
    with pytest.raises(ConnectionLost):
        MultiStreamClient("127.0.0.1", 1, client_slab, streams=2, timeout=1.0)


def test_open_remote_and_the_manager_take_streams_for_one_node(node: NodeProcess) -> None:
    unset = open_remote(node.endpoint, None)  # over auto -> TCP here: this host's default
    if default_streams("tcp", usable_cpus()) == 1:
        assert isinstance(unset, KVClient) and unset.transport_name == "tcp"
    else:
        assert isinstance(unset, MultiStreamClient) and unset.transport_name == "tcp"
        assert unset.streams == default_streams("tcp", usable_cpus())
    unset.close()
    one = open_remote(node.endpoint, None, streams=1, transport="tcp")
    assert isinstance(one, KVClient)
    one.close()
    remote = open_remote(node.endpoint, None, streams=2)
    assert isinstance(remote, MultiStreamClient) and remote.streams == 2
    remote.close()
    for spec in ("127.0.0.1:1,127.0.0.1:2", "infinistore://127.0.0.1:1"):
        with pytest.raises(ConfigError, match="streams"):
            open_remote(spec, None, streams=2)
    ns = KeyNamespace(model="m", dtype="bf16", kv_layout="x")
    with KVCacheManager(
        namespace=ns, block_tokens=4, block_bytes=BLOCK, l1_bytes=8 * BLOCK,
        node=node.endpoint, transport="tcp", lock_slab=False, streams=3,
    ) as kv:
        assert isinstance(kv.client, MultiStreamClient) and kv.client.streams == 3
        tokens = list(range(4 * 3))
        blocks = kv.allocate_for(3)
        kv.put(tokens, blocks, first_block=0, keep=True)
        kv.flush()
        assert kv.exists(tokens) == len(tokens)  # every block reached the node
