"""SGLang HiCache storage backend: SGLang's host KV pool <-> an rdmakv KV node.

Load it as a *dynamic* backend (checked against sglang 0.5.23)::

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "rdmakv",
            "module_path": "rdmakv.connectors.sglang", "class_name": "RdmakvHiCacheStorage",
            "interface_v1": 1, "node": "10.0.0.5:7070"}'

``"interface_v1": 1`` is required: it makes SGLang call :meth:`batch_get_v1` /
:meth:`batch_set_v1` with host-pool page indices instead of materialising a
tensor per page. The other keys are
:class:`~rdmakv.connectors.group_stores.StoreOptions` (``"rdmakv_config": PATH`` takes
their defaults from an rdmakv config file's ``client`` section), plus
``"zero_copy"`` (default true; see below). ``l1_bytes`` sizes the staging slab
of the copy path.

Values: SGLang names each page by a 64-hex chained hash of its tokens;
``get_page_buffer_meta`` gives the page's spans in the host pool. A page is
stored as ``parts`` node values:

* **Split pages** (each page is at most two equal spans, K then V, or one span
  for MLA): one value per span. SGLang 0.5.23 MHA pools in ``page_first``,
  ``page_first_direct`` and ``page_head`` have two spans per page (K and V of
  all layers: the K/V axis is the outermost axis of the host buffer, so a
  page's K and V are never adjacent); MLA pools in ``page_first`` /
  ``page_first_direct`` have one.
* **Gathered pages** (``layer_first``: ``2 x layers`` small spans per page,
  one per layer and K/V): one value, the spans concatenated. Storing each span
  as its own value would multiply node keys, lookups and per-value overhead by
  ``2 x layers``.

Data path:

* **Zero copy** (split pages whose spans lie on a grid of span-sized blocks
  of the host buffer -- true for all the split layouts above): the host
  pool's ``kv_buffer`` itself is the KV client's slab
  (:meth:`Slab.over_buffer`, blocks = the span size), registered once with the
  transport. A put writes each span from SGLang's page to the node one-sided,
  a get reads the node's value straight into SGLang's page: no staging slab,
  no host memcpy. The slab's blocks are *borrowed*: SGLang owns every page,
  this backend never allocates or frees them, and SGLang guarantees a page is
  not reused while a backup/prefetch call on it runs. Because a get writes into
  the page directly, a page reported False may have been partly written (e.g.
  its K span hit, its V span missed): SGLang only keeps the leading run of
  True pages of a prefetch and frees the rest, so that is harmless.
* **Copy path** (``layer_first``, or ``"zero_copy": false``, or a pool whose
  spans do not fit a block grid): spans are copied between the host pool and
  blocks of a registered staging slab, one ``memmove`` per span, and the node
  I/O goes through the staging blocks. A page reported False is left untouched.

The value format does not depend on the data path, so engines with and
without zero copy share pages (same layout required: it is in the keys).

Keys: ``XXH3-128(namespace seed || page hash || part)`` with a BLAKE2b digest
of the same input as the value digest, so a key collision is a miss. The
namespace holds the model, dtype, host layout, page geometry and split, the
PP rank, and the TP rank when heads are split across ranks (not MLA). MLA
ranks share keys and only SGLang's designated writer ranks store. A page
exists only when all its parts do.

Threads: SGLang calls a backend from its prefetch, IO and backup threads at
once. The KV client serialises its own calls; the staging slab (not
thread-safe) is guarded by a lock here and every staging block is freed before
a call returns. Failures (node down, timeouts, misses, bad page indices)
return False / 0, never raise into SGLang's threads.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import threading
from collections.abc import Generator, Sequence
from typing import Any

import torch
import xxhash
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
)

from rdmakv.blocks.keys import KeyNamespace
from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import NodeClient
from rdmakv.client.remote import open_remote
from rdmakv.connectors.group_stores import AUDIT_OPTIONS, StoreOptions
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.wire.format import DIGEST_LEN

log = logging.getLogger("rdmakv.connectors.sglang")

KEY_FORMAT = "sglang-hicache.v2"
"""Version of the value format (pages split into per-span parts) in the key namespace."""
FACTORY_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")
"""Extra-config keys that belong to SGLang's backend factory, not to rdmakv."""
BACKEND_KEYS = ("zero_copy",)
"""Extra-config keys of this backend that are not :class:`StoreOptions`."""
STORAGE_BATCH_PAGES = 128
"""Pages SGLang hands a backend per call (sglang's STORAGE_BATCH_SIZE)."""
DEFAULT_STAGING_BATCHES = 2
"""Staging slab: two full batches, so a get and a set can run at once."""
MAX_SPLIT_PARTS = 2
"""A page of at most this many equal spans (K and V) is stored one value per
span; more spans (layer_first: one per layer and K/V) are gathered into one."""
_DIGEST_PERSON = b"rdmakv.sgl.v2"


class RdmakvHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """rdmakv as an SGLang HiCache storage backend; see the module docstring.

    Constructed by SGLang's factory as ``cls(storage_config, kwargs)``; usable
    once SGLang has called :meth:`register_mem_pool_host`. After that,
    :attr:`zero_copy` says which data path ``batch_get_v1`` / ``batch_set_v1``
    take, :attr:`slab` is the KV client's slab (the host pool itself when zero
    copy), and :attr:`copied_spans` counts host memcpys done by the page
    interface (it stays 0 on the zero-copy path).
    """

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise ConfigError(
                'RdmakvHiCacheStorage needs "interface_v1": 1 in '
                "--hicache-storage-backend-extra-config (the zero-copy page interface)"
            )
        self.options = StoreOptions.from_mapping(extra, ignore=(*FACTORY_KEYS, *BACKEND_KEYS))
        audit = sorted(self.options.given & set(AUDIT_OPTIONS))
        if audit:
            raise ConfigError(
                f"{audit}: KV audits exist in the vLLM connector only (HiCache gives a "
                "storage backend no recompute to compare with)"
            )
        want = extra.get("zero_copy", True)
        if not isinstance(want, bool | int) or want not in (0, 1):
            raise ConfigError(f'"zero_copy" must be true or false, got {want!r}')
        self.want_zero_copy = bool(want)
        self.config: HiCacheStorageConfig = storage_config
        self.model = self.options.model or storage_config.model_name
        if not self.model:
            raise ConfigError('no model name for the keys: set "model" in the extra config')
        self.writer = bool(getattr(storage_config, "is_storage_writer", True))
        self.mem_pool_host: Any = None
        self.slab: Slab | None = None
        self.client: NodeClient | None = None
        self.zero_copy = False
        self.value_bytes = 0
        self.parts = 1
        self.part_bytes = 0
        self.copied_spans = 0
        self._staging: tuple[Slab, NodeClient] | None = None
        self._seed = b""
        self._lock = threading.Lock()
        self._pool_range = (0, 0)

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Work out the page split and data path, then connect to the node."""
        super().register_mem_pool_host(mem_pool_host)
        page = int(mem_pool_host.page_size)
        ptrs, sizes = mem_pool_host.get_page_buffer_meta(torch.arange(page))
        sizes = [int(s) for s in sizes]
        self.value_bytes = sum(sizes)
        if 1 <= len(sizes) <= MAX_SPLIT_PARTS and len(set(sizes)) == 1:
            self.parts, self.part_bytes = len(sizes), sizes[0]
        else:
            self.parts, self.part_bytes = 1, self.value_bytes
        buf = mem_pool_host.kv_buffer
        self._pool_range = (buf.data_ptr(), buf.data_ptr() + buf.numel() * buf.element_size())
        cfg = self.config
        split = not cfg.is_mla_model and cfg.tp_size > 1
        ns = KeyNamespace(
            model=self.model,
            dtype=str(mem_pool_host.dtype).removeprefix("torch."),
            kv_layout=(
                f"{KEY_FORMAT}:{mem_pool_host.layout}:{type(mem_pool_host).__name__}:"
                f"page{page}:{self.value_bytes}B:{self.parts}x{self.part_bytes}B:"
                f"pp{cfg.pp_rank}/{cfg.pp_size}"
            ),
            tp_rank=cfg.tp_rank if split else None,
            tp_size=cfg.tp_size if split else None,
        )
        self._seed = ns.seed()
        why_not = self._zero_copy_refusal(buf, [int(p) for p in ptrs])
        if why_not is None:
            self.slab = Slab.over_buffer(buf, self.part_bytes)
            self.client = self._connect(self.slab)
            self.zero_copy = True
            log.info(
                "rdmakv HiCache: zero copy, host pool (%s, %d bytes) is the slab: %d blocks "
                "of %d bytes, %d per page",
                mem_pool_host.layout,
                self.slab.nbytes,
                self.slab.num_blocks,
                self.part_bytes,
                self.parts,
            )
        else:
            self.slab, self.client = self._open_staging()
            self._staging = (self.slab, self.client)
            log.info("rdmakv HiCache: copy path through a staging slab (%s)", why_not)

    def _zero_copy_refusal(self, buf: Any, first_page: Sequence[int]) -> str | None:
        """Why the host pool cannot be the slab (None when it can)."""
        if not self.want_zero_copy:
            return '"zero_copy": false'
        if self.parts == 1 and len(first_page) > 1:
            return (
                f"layout {self.mem_pool_host.layout!r} has {len(first_page)} spans per page "
                f"(zero copy needs at most {MAX_SPLIT_PARTS} of equal size); they are "
                "gathered into one value"
            )
        if not isinstance(buf, torch.Tensor) or buf.device.type != "cpu":
            return "the host KV buffer is not a CPU tensor"
        if not buf.is_contiguous():
            return "the host KV buffer is not contiguous"
        lo, hi = self._pool_range
        if (hi - lo) % self.part_bytes:
            return f"the host KV buffer is not a whole number of {self.part_bytes}-byte spans"
        for p in first_page:
            if not (lo <= p < hi) or (p - lo) % self.part_bytes:
                return "the page spans do not lie on a span-sized grid of the host KV buffer"
        return None

    def _connect(self, slab: Slab) -> NodeClient:
        return open_remote(
            self.options.node,
            slab,
            token=self.options.secret(),
            transport=self.options.transport,
            timeout=self.options.timeout,
            replication=self.options.replication,
            streams=self.options.streams,
        )

    def _open_staging(self) -> tuple[Slab, NodeClient]:
        """A staging slab of part-sized blocks and a client over it."""
        staging = self.options.l1_bytes
        if "l1_bytes" not in self.options.given:  # neither the extra config nor rdmakv_config
            staging = self.value_bytes * STORAGE_BATCH_PAGES * DEFAULT_STAGING_BATCHES
        if staging < self.value_bytes:
            raise ConfigError(
                f"l1_bytes {staging} is smaller than one {self.value_bytes}-byte page"
            )
        slab = Slab(staging, self.part_bytes, lock=self.options.lock_slab)
        try:
            return slab, self._connect(slab)
        except BaseException:
            slab.close()
            raise

    def _ready(self) -> NodeClient:
        if self.client is None:
            raise ConfigError("register_mem_pool_host was not called before the first transfer")
        return self.client

    def _staging_pair(self) -> tuple[Slab, NodeClient]:
        """The staging slab and its client; on the zero-copy path made on first use
        (only the tensor interface needs one there)."""
        self._ready()
        with self._lock:
            if self._staging is None:
                self._staging = self._open_staging()
            return self._staging

    @property
    def staging_slab(self) -> Slab | None:
        """The staging slab, or None while none was needed (zero copy, page interface)."""
        return self._staging[0] if self._staging is not None else None

    # -- keys ----------------------------------------------------------------------------------
    def _part_input(self, key: str, part: int) -> bytes:
        # Page hashes are hex, never NUL: the separator keeps (key, part) unambiguous.
        return self._seed + key.encode() + b"\0" + part.to_bytes(1, "little")

    def _node_keys(self, keys: Sequence[str]) -> list[bytes]:
        """Per page, its ``parts`` node keys, flattened in page order."""
        return [
            bytes(xxhash.xxh3_128_digest(self._part_input(k, j)))
            for k in keys
            for j in range(self.parts)
        ]

    def _digests(self, keys: Sequence[str]) -> list[bytes]:
        out = []
        for k in keys:
            for j in range(self.parts):
                h = hashlib.blake2b(digest_size=DIGEST_LEN, person=_DIGEST_PERSON)
                h.update(self._part_input(k, j))
                out.append(h.digest())
        return out

    def _per_page(self, flags: Sequence[bool]) -> list[bool]:
        """A page is there / stored / loaded only when all its parts are."""
        n = self.parts
        return [all(flags[i : i + n]) for i in range(0, len(flags), n)]

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
            if self.parts > 1 and len(spans) != self.parts:
                raise ConfigError(
                    f"page of key #{i} has {len(spans)} spans, the pool had {self.parts} per page"
                )
            for p, s in spans:
                if p < lo or p + s > hi:
                    raise ConfigError(f"page span 0x{p:x}+{s} lies outside the host KV pool")
            out.append(spans)
        return out

    def _part_spans(self, page: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
        """A page's spans grouped per stored part (one span each, or all in one)."""
        return [[s] for s in page] if self.parts > 1 else [page]

    def _pool_handles(self, pages: Sequence[list[tuple[int, int]]]) -> list[int]:
        """Zero copy: the host-pool slab block of each part, in page order (bounds-checked)."""
        lo, _ = self._pool_range
        bs = self.part_bytes
        out = []
        for page in pages:
            for p, s in page:
                if s != bs or (p - lo) % bs:
                    raise ConfigError(f"page span 0x{p:x}+{s} is not one {bs}-byte pool block")
                out.append((p - lo) // bs)
        return out

    def _alloc(self, slab: Slab, n: int) -> list[int]:
        with self._lock:
            return slab.alloc_many(n)

    def _free(self, slab: Slab, handles: Sequence[int]) -> None:
        with self._lock:
            for h in handles:
                slab.decref(h)

    def _chunks(self, slab: Slab, n: int) -> list[tuple[int, int]]:
        """Page ranges that fit half the staging slab (a get and a set can run at once)."""
        step = max(1, slab.num_blocks // DEFAULT_STAGING_BATCHES // self.parts)
        return [(s, min(n, s + step)) for s in range(0, n, step)]

    # -- page interface (interface_v1) -------------------------------------------------------
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
            client = self._ready()
            spans = self._spans(keys, host_indices)
            if self.zero_copy:
                # The node reads SGLang's pages in place: one-sided writes from the pool.
                stored = client.put(
                    self._node_keys(keys),
                    self._pool_handles(spans),
                    self.part_bytes,
                    self._digests(keys),
                )
                return self._per_page(stored)
            slab, client = self._staging_pair()
            out: list[bool] = []
            for s, e in self._chunks(slab, len(keys)):
                handles = self._alloc(slab, (e - s) * self.parts)
                try:
                    parts = [ps for page in spans[s:e] for ps in self._part_spans(page)]
                    for h, part in zip(handles, parts, strict=True):
                        self._gather(slab.addr(h), part)
                    stored = client.put(
                        self._node_keys(keys[s:e]),
                        handles,
                        self.part_bytes,
                        self._digests(keys[s:e]),
                    )
                    out += self._per_page(stored)
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
            client = self._ready()
            spans = self._spans(keys, host_indices)
            if self.zero_copy:
                # One-sided reads land in SGLang's pages; nothing to copy afterwards.
                sizes = client.get_sizes(
                    self._node_keys(keys), self._pool_handles(spans), self._digests(keys)
                )
                return self._per_page([n == self.part_bytes for n in sizes])
            out: list[bool] = []
            with contextlib.closing(self._staged_get(keys)) as staged:
                for page, (hit, addrs) in zip(spans, staged, strict=True):
                    if hit:  # a miss leaves the page untouched
                        for addr, part in zip(addrs, self._part_spans(page), strict=True):
                            self._scatter(addr, part)
                    out.append(hit)
            return out
        except RdmakvError as e:
            log.warning("HiCache get of %d pages failed, all misses: %s", len(keys), e)
            return [False] * len(keys)

    def batch_exists(
        self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None
    ) -> int:
        """How many leading ``keys`` the node holds (all parts): one batched call."""
        if not keys:
            return 0
        try:
            present = self._per_page(self._ready().exists(self._node_keys(keys)))
        except RdmakvError as e:
            log.warning("HiCache exists of %d pages failed, counting misses: %s", len(keys), e)
            return 0
        n = 0
        while n < len(present) and present[n]:
            n += 1
        return n

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def _staged_get(self, keys: Sequence[str]) -> Generator[tuple[bool, list[int]], None, None]:
        """Read ``keys`` through the staging slab, a chunk at a time; yield
        (hit, the staging addresses of the page's parts) per key, in order.

        A chunk's staging blocks are freed when the caller asks for the next
        page after it (or closes the generator): copy a page out before that.
        """
        slab, client = self._staging_pair()
        for s, e in self._chunks(slab, len(keys)):
            handles = self._alloc(slab, (e - s) * self.parts)
            try:
                sizes = client.get_sizes(
                    self._node_keys(keys[s:e]), handles, self._digests(keys[s:e])
                )
                hit = self._per_page([n == self.part_bytes for n in sizes])
                for i in range(e - s):
                    mine = handles[i * self.parts : (i + 1) * self.parts]
                    yield hit[i], [slab.addr(h) for h in mine]
            finally:
                self._free(slab, handles)

    def _gather(self, dst: int, spans: Sequence[tuple[int, int]]) -> None:
        off = 0
        for p, s in spans:
            ctypes.memmove(dst + off, p, s)
            off += s
        with self._lock:  # SGLang's threads copy concurrently
            self.copied_spans += len(spans)

    def _scatter(self, src: int, spans: Sequence[tuple[int, int]]) -> None:
        off = 0
        for p, s in spans:
            ctypes.memmove(p, src + off, s)
            off += s
        with self._lock:  # SGLang's threads copy concurrently
            self.copied_spans += len(spans)

    # -- tensor interface (SGLang uses it only without interface_v1) ----------------------------
    # A value tensor is one flat page whose bytes are the page's parts in order
    # (SGLang's flat data page for the split layouts), so it interoperates with
    # the page interface. It always goes through the staging slab.
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
            with contextlib.closing(self._staged_get(keys)) as staged:
                for t, (hit, addrs) in zip(targets, staged, strict=True):
                    if not hit:
                        out.append(None)
                        continue
                    dst = t if t is not None else torch.empty(self.value_bytes, dtype=torch.uint8)
                    _check_tensor(dst, self.value_bytes)
                    for j, addr in enumerate(addrs):
                        ctypes.memmove(dst.data_ptr() + j * self.part_bytes, addr, self.part_bytes)
                    out.append(dst)
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
        stored: list[bool] = []
        try:
            slab, client = self._staging_pair()
            for s, e in self._chunks(slab, len(keys)):
                handles = self._alloc(slab, (e - s) * self.parts)
                try:
                    for i, v in enumerate(values[s:e]):
                        _check_tensor(v, self.value_bytes)
                        for j in range(self.parts):
                            h = handles[i * self.parts + j]
                            ctypes.memmove(
                                slab.addr(h), v.data_ptr() + j * self.part_bytes, self.part_bytes
                            )
                    stored += client.put(
                        self._node_keys(keys[s:e]),
                        handles,
                        self.part_bytes,
                        self._digests(keys[s:e]),
                    )
                finally:
                    self._free(slab, handles)
        except RdmakvError as e:
            log.warning("HiCache set of %d values failed: %s", len(keys), e)
            return False
        return all(stored)

    # -- lifetime ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Close the clients and slabs (a host-pool slab only drops its views, never the pool)."""
        pairs = [(self.slab, self.client)]
        if self._staging is not None and self._staging[0] is not self.slab:
            pairs.append(self._staging)
        self.slab = self.client = self._staging = None
        for slab, client in pairs:
            if client is not None:
                client.close()
            if slab is not None:
                slab.close()


def _check_tensor(t: Any, nbytes: int) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cpu" or not t.is_contiguous():
        raise ConfigError("values must be contiguous CPU tensors")
    if t.numel() * t.element_size() != nbytes:
        raise ConfigError(f"value tensor has {t.numel() * t.element_size()} bytes, a page {nbytes}")


__all__ = ["RdmakvHiCacheStorage"]
