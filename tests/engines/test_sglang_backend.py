"""RdmakvHiCacheStorage against the real sglang 0.5.23 classes, on CPU, with a real node.

Real: ``HiCacheStorage`` (subclass check), the ``dynamic`` backend factory
(``StorageBackendFactory.create_backend`` -> ``cls(storage_config, kwargs)``),
``MHATokenToKVPoolHost`` host pools in every layout built from a real
``MHATokenToKVPool`` device pool (and ``MLATokenToKVPoolHost`` pools from a
real ``MLATokenToKVPool``), and the real ``HiCacheController`` (its
backup thread calling ``batch_set_v1``, prefetch thread calling
``batch_exists``, IO thread calling ``batch_get_v1``). Not run: the SGLang
scheduler / HiRadixCache (we hand the controller what the radix cache would),
device<->host copies (CUDA kernels).

Zero copy is proven by what the backend registers (the host buffer's own
address and size as the client's slab), by the absence of any staging slab,
by its memcpy counter staying 0, and by the bytes landing in SGLang's pages
(and nowhere else in the pool).
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

if os.environ.get("RDMAKV_REQUIRE_ENGINES") != "1":  # deploy/engines.sh: missing = failure
    pytest.importorskip("sglang", reason="needs the engine venv: bash deploy/engines.sh")

import torch
import torch.distributed as dist

from rdmakv.errors import ConfigError

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("torchvision_stand_in")]

PAGE = 16
LAYERS = 2
HEADS = 2
HEAD = 8
DEVICE_TOKENS = 256
LAYOUTS = ["page_first", "layer_first", "page_first_direct", "page_head"]
BACKEND = {
    "backend_name": "rdmakv",
    "module_path": "rdmakv.connectors.sglang",
    "class_name": "RdmakvHiCacheStorage",
    "interface_v1": 1,
}


def _pools(layout: str) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=torch.float32,
        head_num=HEADS,
        head_dim=HEAD,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )
    host = MHATokenToKVPoolHost(
        dev._mha_buffer_info(),
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
    )
    return dev, host


def _config(node: str, *, is_mla: bool = False, **extra: Any) -> Any:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="tiny",
        extra_config={**BACKEND, "node": node, "transport": "tcp", "lock_slab": False, **extra},
    )


def _page(host: Any, indices: torch.Tensor, i: int) -> torch.Tensor:
    return host.get_data_page(indices[i * PAGE]).clone()


@pytest.fixture
def backends() -> Iterator[list[Any]]:
    made: list[Any] = []
    yield made
    for b in made:
        b.close()


def _create(
    node: str, host: Any, made: list[Any], *, is_mla: bool = False, **extra: Any
) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    cfg = _config(node, is_mla=is_mla, **extra)
    be = StorageBackendFactory.create_backend("dynamic", cfg, host)
    made.append(be)
    return be


def test_is_a_hicache_storage() -> None:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    assert issubclass(RdmakvHiCacheStorage, HiCacheStorage)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_factory_backend_round_trips_pages_through_the_node(
    layout: str, node_factory: Any, backends: list[Any]
) -> None:
    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    node = node_factory()
    _, host = _pools(layout)
    writer = _create(node.endpoint, host, backends)
    assert isinstance(writer, RdmakvHiCacheStorage)
    writer.register_mem_pool_host(host)  # what HiCacheController does right after creation
    idx = host.alloc(3 * PAGE)
    host.kv_buffer.view(-1).copy_(torch.arange(host.kv_buffer.numel(), dtype=torch.float32))
    want = [_page(host, idx, i) for i in range(3)]
    keys = [f"{i:064x}" for i in (1, 2, 3)]
    assert writer.batch_set_v1(keys, idx) == [True, True, True]

    # A second backend (another SGLang instance) reads them back.
    host.kv_buffer.zero_()
    reader = _create(node.endpoint, host, backends)
    reader.register_mem_pool_host(host)
    assert reader.batch_exists([*keys, f"{9:064x}"]) == 3
    assert reader.exists(keys[0]) and not reader.exists(f"{9:064x}")
    idx2 = host.alloc(3 * PAGE)
    assert reader.batch_get_v1(keys, idx2) == [True, True, True]
    for i in range(3):
        assert torch.equal(_page(host, idx2, i), want[i])
    assert reader.batch_get_v1([f"{9:064x}"], idx2[:PAGE]) == [False]


def _mla_pools(layout: str) -> tuple[Any, Any]:
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=torch.float32,
        kv_lora_rank=HEAD,
        qk_rope_head_dim=HEAD,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        dev._mla_buffer_info(),
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=DEVICE_TOKENS,
        start_layer=0,
        end_layer=LAYERS,
        target_layer_num=LAYERS,
    )
    return dev, host


# (pool kind, layout, node values per page). SGLang 0.5.23 keeps K and V in the two
# halves of an MHA host buffer, so a page-major MHA page is two spans (K, V; one
# node value each); an MLA page is one span.
ZERO_COPY_CASES = [
    ("mha", "page_first", 2),
    ("mha", "page_first_direct", 2),
    ("mha", "page_head", 2),
    ("mla", "page_first", 1),
    ("mla", "page_first_direct", 1),
]


@pytest.mark.parametrize(("kind", "layout", "parts"), ZERO_COPY_CASES)
def test_page_major_layouts_move_pages_with_no_copy(
    kind: str, layout: str, parts: int, node_factory: Any, backends: list[Any]
) -> None:
    """The host pool IS the client's slab: no staging slab, no memcpy, bytes land in place."""
    node = node_factory()
    _, host = (_mla_pools if kind == "mla" else _pools)(layout)
    buf = host.kv_buffer
    be = _create(node.endpoint, host, backends, is_mla=kind == "mla")
    be.register_mem_pool_host(host)
    assert be.zero_copy and be.parts == parts
    assert be.staging_slab is None  # no staging memory was ever allocated
    assert be.client.slab is be.slab and be.slab.external
    # What the transport registers is exactly SGLang's host KV buffer.
    assert be.slab.base_addr == buf.data_ptr()
    assert be.slab.nbytes == buf.numel() * buf.element_size()
    assert be.part_bytes * parts == be.value_bytes

    idx = host.alloc(4 * PAGE)
    buf.view(-1).copy_(torch.randn(buf.numel(), generator=torch.Generator().manual_seed(3)))
    want = [_page(host, idx, i) for i in range(4)]
    keys = [f"{i:064x}" for i in (11, 12, 13, 14)]
    assert be.batch_set_v1(keys, idx) == [True] * 4
    buf.zero_()
    idx2 = host.alloc(4 * PAGE)
    assert be.batch_exists(keys) == 4
    assert be.batch_get_v1(keys, idx2) == [True] * 4
    for i in range(4):
        assert torch.equal(_page(host, idx2, i), want[i])
    # Only the pages asked for were written: everything else is still zero.
    touched = torch.zeros(buf.numel() * buf.element_size(), dtype=torch.bool)
    for spans in be._spans(keys, idx2):
        for p, n in spans:
            touched[p - buf.data_ptr() : p - buf.data_ptr() + n] = True
    raw = buf.view(-1).view(torch.uint8)
    assert not bool(raw[~touched].any()) and bool(raw[touched].any())
    assert be.copied_spans == 0  # not one host memcpy on either path
    assert be.staging_slab is None


def test_layer_first_keeps_the_copy_path(node_factory: Any, backends: list[Any]) -> None:
    """2 x layers small spans per page: gathered into one value through a staging slab."""
    node = node_factory()
    _, host = _pools("layer_first")
    be = _create(node.endpoint, host, backends)
    be.register_mem_pool_host(host)
    assert not be.zero_copy and be.parts == 1
    assert be.staging_slab is be.slab and not be.slab.external
    idx = host.alloc(2 * PAGE)
    host.kv_buffer.view(-1).copy_(torch.arange(host.kv_buffer.numel(), dtype=torch.float32))
    want = [_page(host, idx, i) for i in range(2)]
    keys = [f"{i:064x}" for i in (21, 22)]
    assert be.batch_set_v1(keys, idx) == [True, True]
    spans_per_page = 2 * LAYERS
    assert be.copied_spans == 2 * spans_per_page
    host.kv_buffer.zero_()
    assert be.batch_get_v1(keys, idx) == [True, True]
    assert be.copied_spans == 4 * spans_per_page
    assert all(torch.equal(_page(host, idx, i), want[i]) for i in range(2))


def test_copy_and_zero_copy_engines_share_pages(node_factory: Any, backends: list[Any]) -> None:
    """"zero_copy": false stores the same values, so either path reads the other's pages."""
    node = node_factory()
    _, host = _pools("page_first")
    copier = _create(node.endpoint, host, backends, zero_copy=False)
    copier.register_mem_pool_host(host)
    direct = _create(node.endpoint, host, backends)
    direct.register_mem_pool_host(host)
    assert not copier.zero_copy and copier.staging_slab is not None and direct.zero_copy
    idx = host.alloc(2 * PAGE)
    host.kv_buffer.view(-1).copy_(torch.arange(host.kv_buffer.numel(), dtype=torch.float32))
    want = [_page(host, idx, i) for i in range(2)]
    a, b = f"{31:064x}", f"{32:064x}"
    assert copier.batch_set_v1([a], idx[:PAGE]) == [True]
    assert copier.copied_spans == 2  # K and V copied into staging blocks
    assert direct.batch_set_v1([b], idx[PAGE:]) == [True]
    host.kv_buffer.zero_()
    assert direct.batch_get_v1([a], idx[:PAGE]) == [True]
    assert copier.batch_get_v1([b], idx[PAGE:]) == [True]
    assert torch.equal(_page(host, idx, 0), want[0]) and torch.equal(_page(host, idx, 1), want[1])
    assert direct.copied_spans == 0


def test_a_page_is_there_only_with_all_its_parts(node_factory: Any, backends: list[Any]) -> None:
    node = node_factory()
    _, host = _pools("page_first")
    be = _create(node.endpoint, host, backends)
    be.register_mem_pool_host(host)
    idx = host.alloc(3 * PAGE)
    host.kv_buffer.view(-1).copy_(torch.arange(host.kv_buffer.numel(), dtype=torch.float32))
    want0 = _page(host, idx, 0)
    keys = [f"{i:064x}" for i in (41, 42, 43)]
    assert be.batch_set_v1(keys, idx) == [True] * 3
    v_of_page_1 = be._node_keys([keys[1]])[1]
    assert be.client.delete([v_of_page_1]) == [True]  # the node lost page 1's V span
    assert be.batch_exists(keys) == 1
    host.kv_buffer.zero_()
    assert be.batch_get_v1(keys, idx) == [True, False, True]
    assert torch.equal(_page(host, idx, 0), want0)


def test_bad_host_indices_are_refused_before_any_io(
    node_factory: Any, backends: list[Any]
) -> None:
    """Indices past the pool would make spans outside SGLang's buffer: a miss, nothing written."""
    node = node_factory()
    _, host = _pools("page_first")
    be = _create(node.endpoint, host, backends)
    be.register_mem_pool_host(host)
    idx = host.alloc(PAGE)
    key = f"{51:064x}"
    assert be.batch_set_v1([key], idx) == [True]
    host.kv_buffer.zero_()
    past = torch.arange(host.size, host.size + PAGE)
    assert be.batch_get_v1([key], past) == [False]
    assert be.batch_set_v1([f"{52:064x}"], past) == [False]
    assert be.batch_get_v1([key, key], idx) == [False, False]  # 2 keys, 1 page of indices
    assert not bool(host.kv_buffer.any())
    assert not be.exists(f"{52:064x}")


def test_zero_copy_option_is_checked(node_factory: Any) -> None:
    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    node = node_factory()
    with pytest.raises(ConfigError, match="zero_copy"):
        RdmakvHiCacheStorage(_config(node.endpoint, zero_copy="no"), {})


def test_audit_options_are_refused_not_ignored(node_factory: Any) -> None:
    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    node = node_factory()
    with pytest.raises(ConfigError, match="audit_rate"):
        RdmakvHiCacheStorage(_config(node.endpoint, audit_rate=0.1), {})


def test_a_down_node_gives_misses_not_errors(node_factory: Any, backends: list[Any]) -> None:
    node = node_factory()
    _, host = _pools("page_first")
    be = _create(node.endpoint, host, backends, timeout=2)
    be.register_mem_pool_host(host)
    idx = host.alloc(PAGE)
    key = f"{7:064x}"
    assert be.batch_set_v1([key], idx) == [True]
    node.kill()
    assert be.batch_exists([key]) == 0
    assert be.batch_get_v1([key], idx) == [False]
    assert be.batch_set_v1([key], idx) == [False]


def test_interface_v1_is_required(node_factory: Any) -> None:
    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    node = node_factory()
    cfg = _config(node.endpoint)
    cfg.extra_config = {k: v for k, v in cfg.extra_config.items() if k != "interface_v1"}
    with pytest.raises(ConfigError, match="interface_v1"):
        RdmakvHiCacheStorage(cfg, {})


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_hicache_controller_backs_up_and_prefetches(node_factory: Any) -> None:
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.runtime_context import get_parallel

    from rdmakv.connectors.sglang import RdmakvHiCacheStorage

    if not dist.is_initialized():
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
        )
    node = node_factory()
    dev, host = _pools("page_first")
    alloc = PagedTokenToKVPoolAllocator(
        DEVICE_TOKENS, PAGE, torch.float32, "cpu", dev, need_sort=False
    )
    # The controller reads parallel widths from SGLang's runtime context (set by the
    # server at start-up); a single-rank CPU run has to provide them.
    with get_parallel().override(
        attn_dcp_size=1,
        attn_dcp_rank=0,
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_size=1,
        attn_cp_rank=0,
        attn_tp_size=1,
        attn_tp_rank=0,
        attn_dp_rank=0,
    ):
        ctl = HiCacheController(
            alloc,
            host,
            PAGE,
            dist.group.WORLD,
            threading.Event(),
            storage_backend="dynamic",
            model_name="tiny",
            storage_backend_extra_config={
                **BACKEND,
                "node": node.endpoint,
                "transport": "tcp",
                "lock_slab": False,
            },
        )
        try:
            assert isinstance(ctl.storage_backend, RdmakvHiCacheStorage)
            # interface_v1 selected SGLang's zero-copy page functions.
            assert "zero_copy" in ctl.page_get_func.__name__
            assert "zero_copy" in ctl.page_set_func.__name__

            tokens = list(range(3 * PAGE))
            hidx = host.alloc(3 * PAGE)
            host.kv_buffer.view(-1).copy_(torch.arange(host.kv_buffer.numel(), dtype=torch.float32))
            want = [_page(host, hidx, i) for i in range(3)]
            hashes = get_storage_hash_str(tokens, None, page_size=PAGE)
            ctl.write_storage(hidx, tokens, hash_value=hashes)  # backup thread
            ack = ctl.ack_backup_queue.get(timeout=30)
            assert ack.completed_tokens == 3 * PAGE

            host.kv_buffer.zero_()
            op = ctl.prefetch("req-1", [*tokens, 1, 2, 3])  # prefetch thread: batch_exists
            hit = ctl.prefetch_hit_queue.get(timeout=30)
            assert hit is op
            assert hit.storage_hit_count == 3 * PAGE
            # What HiRadixCache does on the scheduler thread: host pages for the hit.
            hit.host_indices = host.alloc(hit.storage_hit_count)
            ctl.prefetch_buffer.put(hit)
            done = False
            while not done:  # IO thread: batch_get_v1
                a = ctl.ack_prefetch_queue.get(timeout=30)
                done = bool(a.completed_req)
            for i in range(3):
                assert torch.equal(_page(host, hit.host_indices, i), want[i])
            # page_first: SGLang's threads moved every page between its host pool and
            # the node with no staging slab and no memcpy.
            be = ctl.storage_backend
            assert be.zero_copy and be.slab.base_addr == host.kv_buffer.data_ptr()
            assert be.copied_spans == 0 and be.staging_slab is None
        finally:
            backend = ctl.storage_backend
            ctl.detach_storage_backend()  # SGLang's own shutdown of the storage threads
            backend.close()


def test_tensor_interface_round_trips_one_page(node_factory: Any, backends: list[Any]) -> None:
    """get/set/batch_get/batch_set (what SGLang uses without interface_v1) still work."""
    node = node_factory()
    _, host = _pools("page_first")
    be = _create(node.endpoint, host, backends)
    be.register_mem_pool_host(host)
    value = torch.arange(be.value_bytes // 4, dtype=torch.float32)
    assert be.set(f"{5:064x}", value)
    got = be.get(f"{5:064x}")
    assert got is not None and bytes(got.numpy()) == bytes(value.numpy())
    target = torch.zeros_like(value)
    assert be.batch_get([f"{5:064x}", f"{6:064x}"], [target, torch.zeros_like(value)])[1] is None
    assert torch.equal(target, value)
    with pytest.raises(ConfigError, match="one value tensor per key"):
        be.batch_set([f"{5:064x}"], [])
    assert be.set(f"{8:064x}", torch.zeros(3)) is False  # wrong size: refused, not stored
    assert not be.exists(f"{8:064x}")
