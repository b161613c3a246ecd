"""SGLang HiCache storage backend: SGLang's host KV pool <-> an rdmakv KV node.

Load it as a *dynamic* backend (checked against sglang 0.5.23)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "rdmakv",
            "module_path": "rdmakv.connectors.sglang", "class_name": "RdmakvHiCacheStorage",
            "interface_v1": 1, "node": "10.0.0.5:7070"}'

``"interface_v1": 1`` is required: it makes SGLang call :meth:`batch_get_v1` /
:meth:`batch_set_v1` with host-pool page indices (its zero-copy interface)
instead of materialising a tensor per page. The other keys are
:class:`~rdmakv.connectors.store.StoreOptions` (``l1_bytes`` sizes the staging
slab here).

Data path: SGLang names each page by a 64-hex chained hash of its tokens. A
page's value is the concatenation of the host-pool spans that
``get_page_buffer_meta`` reports for it (K and V, all layers). A put copies
those spans into a slab block with one ``memmove`` each, then the KV client
writes the block to the node one-sided; a get reads into a slab block and
copies it out to the page's spans. So there is one host memcpy per span
between SGLang's pool and the registered slab: the pool itself is not
registered with the transport (that would need a slab over foreign memory).

Keys: ``XXH3-128(namespace seed || page hash)`` with a BLAKE2b digest of the
same input as the value digest, so a key collision is a miss. The namespace
holds the model, dtype, host layout and page geometry, the PP rank, and the
TP rank when heads are split across ranks (not MLA). MLA ranks share keys and
only SGLang's designated writer ranks store.

Threads: SGLang calls a backend from its prefetch, IO and backup threads at
once. The KV client serialises its own calls; the staging slab (not
thread-safe) is guarded by a lock here. Every staging block is freed before a
call returns. Failures (node down, timeouts, misses) return False / 0, never
raise into SGLang's threads.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from rdmakv.client import KVClient
from rdmakv.connectors.store import StoreOptions
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.keys import DIGEST_BYTES, KeyNamespace
from rdmakv.slab import Slab

log = logging.getLogger("rdmakv.connectors.sglang")

KEY_FORMAT = "sglang-hicache.v1"
"""Version of the value format (concatenated page spans) in the key namespace."""
FACTORY_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
"""Extra-config keys that belong to SGLang's backend factory, not to rdmakv."""
STORAGE_BATCH_PAGES = 128
"""Pages SGLang hands a backend per call (sglang's STORAGE_BATCH_SIZE)."""
DEFAULT_STAGING_BATCHES = 2
"""Staging slab: two full batches, so a get and a set can run at once."""
_DIGEST_PERSON = b"rdmakv.sgl.v1"


class RdmakvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """rdmakv as an SGLang HiCache storage backend; see the module docstring.

    Constructed by SGLang's factory as ``cls(storage_config, kwargs)``; usable
    once SGLang has called :meth:`register_mem_pool_host`.
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ConfigError(
                'RdmakvHiCacheStorage needs "interface_v1": 1 in '
                "--hicache-storage-backend-extra-config (the zero-copy page interface)"
            )
        self.options = StoreOptions.from_mapping(extra, ignore=FACTORY_KEYS)
        self.config: HiCacheStorageConfig = storage_config
        self.model = self.options.model or storage_config.model_name
        if not self.model:
            raise ConfigError('no model name for the keys: set "model" in the extra config')
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.mem_pool_host: Any = None
        self.slab: Slab | None = None
        self.client: KVClient | None = None
        self.value_bytes = 0
        self._seed = b""
        self._lock = threading.Lock()
        self._pool_range = (0, 0)

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Size the staging slab from the pool's page geometry and connect to the node."""
        super().register_mem_pool_host(mem_pool_host)
        page = int(mem_pool_host.page_size)
        _, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page))
        self.value_bytes = int(sum(sizes))
        buf = mem_pool_host.kv_buffer
        self._pool_range = (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
        cfg = self.config
        split = not cfg.is_mla_model and cfg.tp_size > 1
        ns = KeyNamespace(
            model=self.model,
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            kv_layout=(
                f"{KEY_FORMAT}:{mem_pool_host.layout}:{type(mem_pool_host).__name__}:"
                f"page{page}:{self.value_bytes}B:pp{cfg.pp_rank}/{cfg.pp_size}"
            ),
            tp_rank=cfg.tp_rank if split else None,
            tp_size=cfg.tp_size if split else None,
        )
        self._seed = ns.seed()
        staging = self.options.l1_bytes
        if "l1_bytes" not in (cfg.extra_config or {}):
            staging = self.value_bytes * STORAGE_BATCH_PAGES * DEFAULT_STAGING_BATCHES
        if staging < self.value_bytes:
            raise ConfigError(
                f"l1_bytes {staging} is smaller than one {self.value_bytes}-byte page"
            )
        self.slab = Slab(staging, self.value_bytes, lock=self.options.lock_slab)
        host, port = self.options.address()
        self.client = KVClient(
            host,
            port,
            self.slab,
            token=self.options.secret(),
            transport=self.options.transport,
            timeout=self.options.timeout,
        )

    def _ready(self) -> tuple[Slab, KVClient]:
        if self.slab is None or self.client is None:
            raise ConfigError("register_mem_pool_host was not called before the first transfer")
        return self.slab, self.client

    # -- keys ----------------------------------------------------------------------------------
    def _key(self, key: str) -> bytes:
        return bytes(xxhash.xxh3_128_digest(self._seed + key.encode()))

    def _digest(self, key: str) -> bytes:
        h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=_DIGEST_PERSON)
        h.update(self._seed + key.encode())
        return h.digest()

    # -- page spans ------------------------------------------------------------------------------
    def _spans(
        self, keys: Sequence[str], host_indices: torch.Tensor
    ) -> list[list[tuple[int, int]]]:
        """Per key, the ``(address, length)`` spans of its host-pool page (bounds-checked)."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices)
        if not keys or len(ptrs) % len(keys) or len(ptrs) != len(sizes):
            raise ConfigError(
                f"{len(keys)} keys but {len(ptrs)} page spans for {len(host_indices)} host indices"
            )
        per = len(ptrs) // len(keys)
        lo, hi = self._pool_range
        out: list[list[tuple[int, int]]] = []
        for i in range(len(keys)):
            spans = [
                (int(p), int(s))
                for p, s in zip(
                    ptrs[i * per : (i + 1) * per], sizes[i * per : (i + 1) * per], strict=True
                )
            ]
            if sum(s for _, s in spans) != self.value_bytes:
                raise ConfigError(
                    f"page of key #{i} has {sum(s for _, s in spans)} bytes, not {self.value_bytes}"
                )
            for p, s in spans:
                if p < lo or p + s > hi:
                    raise ConfigError(f"page span 0x{p:x}+{s} lies outside the host KV pool")
            out.append(spans)
        return out

    def _alloc(self, slab: Slab, n: int) -> list[int]:
        with self._lock:
            return slab.alloc_many(n)

    def _free(self, slab: Slab, handles: Sequence[int]) -> None:
        with self._lock:
            for h in handles:
                slab.decref(h)

    def _chunks(self, n: int) -> list[tuple[int, int]]:
        step = max(1, self._ready()[0].num_blocks // DEFAULT_STAGING_BATCHES)
        return [(s, min(n, s + step)) for s in range(0, n, step)]

    # -- zero-copy interface (interface_v1) -------------------------------------------------
    def batch_set_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Store the host-pool pages at ``host_indices`` under ``keys``; True per stored key."""
        if not keys:
            return []
        if not self.writer:
            return [True] * len(keys)  # MLA: another rank writes the shared pages
        try:
            slab, client = self._ready()
            spans = self._spans(keys, host_indices)
            out: list[bool] = []
            for s, e in self._chunks(len(keys)):
                handles = self._alloc(slab, e - s)
                try:
                    for h, page in zip(handles, spans[s:e], strict=True):
                        _gather(slab.addr(h), page)
                    out += client.put(
                        [self._key(k) for k in keys[s:e]],
                        handles,
                        self.value_bytes,
                        [self._digest(k) for k in keys[s:e]],
                    )
                finally:
                    self._free(slab, handles)
            return out
        except RdmakvError as e:
            log.warning("HiCache set of %d pages failed: %s", len(keys), e)
            return [False] * len(keys)

    def batch_get_v1(
        self,
        keys: list[str],
        host_indices: torch.Tensor,
        extra_info: HiCacheStorageExtraInfo | None = None,
    ) -> list[bool]:
        """Fill the host-pool pages at ``host_indices`` with ``keys``' values; True per hit."""
        if not keys:
            return []
        try:
            slab, client = self._ready()
            spans = self._spans(keys, host_indices)
            out: list[bool] = []
            for s, e in self._chunks(len(keys)):
                handles = self._alloc(slab, e - s)
                try:
                    sizes = client.get_sizes(
                        [self._key(k) for k in keys[s:e]],
                        handles,
                        [self._digest(k) for k in keys[s:e]],
                    )
                    for h, page, n in zip(handles, spans[s:e], sizes, strict=True):
                        ok = n == self.value_bytes
                        if ok:
                            _scatter(slab.addr(h), page)
                        out.append(ok)
                finally:
                    self._free(slab, handles)
            return out
        except RdmakvError as e:
            log.warning("HiCache get of %d pages failed, all misses: %s", len(keys), e)
            return [False] * len(keys)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading ``keys`` the node holds: one batched call."""
        if not keys:
            return 0
        try:
            present = self._ready()[1].exists([self._key(k) for k in keys])
        except RdmakvError as e:
            log.warning("HiCache exists of %d pages failed, counting misses: %s", len(keys), e)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # -- tensor interface (SGLang uses it only without interface_v1) ----------------------------
    def get(
        self, key: str, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location] if target_location is not None else None)
        return got[0] if isinstance(got, list) else None

    def batch_get(
        self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None
    ) -> list[torch.Tensor | None]:
        """Read values into ``target_locations`` tensors (new uint8 tensors when None)."""
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: list[torch.Tensor | None] = []
        try:
            slab, client = self._ready()
            handles = self._alloc(slab, len(keys))
            try:
                sizes = client.get_sizes(
                    [self._key(k) for k in keys], handles, [self._digest(k) for k in keys]
                )
                for h, t, n in zip(handles, targets, sizes, strict=True):
                    if n != self.value_bytes:
                        out.append(None)
                        continue
                    dst = t if t is not None else torch.empty(self.value_bytes, dtype=torch.uint8)
                    _check_tensor(dst, self.value_bytes)
                    ctypes.memmove(dst.data_ptr(), slab.addr(h), self.value_bytes)
                    out.append(dst)
            finally:
                self._free(slab, handles)
        except RdmakvError as e:
            log.warning("HiCache get of %d values failed: %s", len(keys), e)
            return [None] * len(keys)
        return out

    def set(
        self,
        key: str,
        value: Any | None = None,
        target_location: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        """Store contiguous CPU tensors of one page each; True when all were stored."""
        if values is None or len(values) != len(keys):
            raise ConfigError(f"batch_set needs one value tensor per key ({len(keys)} keys)")
        if not self.writer:
            return True
        try:
            slab, client = self._ready()
            handles = self._alloc(slab, len(keys))
            try:
                for h, v in zip(handles, values, strict=True):
                    _check_tensor(v, self.value_bytes)
                    ctypes.memmove(slab.addr(h), v.data_ptr(), self.value_bytes)
                stored = client.put(
                    [self._key(k) for k in keys],
                    handles,
                    self.value_bytes,
                    [self._digest(k) for k in keys],
                )
            finally:
                self._free(slab, handles)
        except RdmakvError as e:
            log.warning("HiCache set of %d values failed: %s", len(keys), e)
            return False
        return all(stored)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.slab is not None:
            self.slab.close()
            self.slab = None


def _gather(dst: int, spans: Sequence[tuple[int, int]]) -> None:
    off = 0
    for p, s in spans:
        ctypes.memmove(dst + off, p, s)
        off += s


def _scatter(src: int, spans: Sequence[tuple[int, int]]) -> None:
    off = 0
    for p, s in spans:
        ctypes.memmove(p, src + off, s)
        off += s


def _check_tensor(t: Any, nbytes: int) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ConfigError("values must be contiguous CPU tensors")
    if t.numel() * t.element_size() != nbytes:
        raise ConfigError(f"value tensor has {t.numel() * t.element_size()} bytes, a page {nbytes}")


__all__ = ["RdmakvHiCacheStorage"]
