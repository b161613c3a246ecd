"""InfiniStore as a remote tier: rdmakv's keys and digests over an InfiniStore server.

Address: ``infinistore://host:port`` (the server's ``--service-port``). Needs
the ``infinistore`` package (``pip install 'rdmakv[infinistore]'``) and an RDMA
device on both sides: InfiniStore's server refuses to start without one, and
this tier uses only its RDMA path (its TCP read of a missing key never returns).

How rdmakv's guarantees are kept on a store that knows nothing of them:

* **Digests.** A value is stored under ``rdmakv/v1/<key hex>/<digest hex>``, so
  a get for other tokens asks for a different name and misses: never wrong KV.
  A small *marker* ``rdmakv/v1/<key hex>`` holding the digest answers
  ``exists``, which names keys only, like :meth:`KVClient.exists`, and lets
  ``delete`` find the value's name.
* **Whole blocks.** InfiniStore reads a batch with one block size and cannot
  say how long a value is, so this tier stores whole slab blocks only
  (``nbytes`` must equal the slab's block size; other values are not stored).
* **Batches.** One put is one batched RDMA write of the values and one of the
  markers; one get is one batched RDMA read. InfiniStore rejects a whole read
  batch when any key is missing (404), so a rejected batch is split in halves
  until the missing keys are found: ``O(misses * log n)`` round trips, one when
  everything hits. ``exists`` and ``delete`` are one TCP round trip per key
  (InfiniStore has no batched form of them).
* **One registration.** The client slab is registered once per connection,
  by its base address (InfiniStore looks regions up by base pointer), plus a
  small buffer of this tier's own for the markers.
* **Every wait bounded.** InfiniStore's calls have no timeouts; each runs on
  this tier's own thread and is abandoned after ``timeout`` seconds
  (:class:`~rdmakv.errors.TransportTimeout`). The connection is then dropped
  and the next call reconnects; a call still stuck inside the library keeps
  its thread, which is a daemon, until the library returns.
* **Evictions are misses.** The server evicts least recently used values when
  its pool fills, silently; a value gone while its marker stays is a get miss.

Ownership: as with :class:`~rdmakv.client.node_client.KVClient`, the caller owns the slab
blocks it passes and keeps them referenced for the call. Thread-safe: calls
are serialised on the one connection.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Callable, Coroutine, Sequence
from functools import partial
from typing import Any, TypeVar

import numpy as np

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import check_get, check_put
from rdmakv.defaults import DEFAULT_TIMEOUT
from rdmakv.errors import (
    ConfigError,
    ConnectionLost,
    RdmaUnavailable,
    TransportError,
    TransportTimeout,
)
from rdmakv.transport.rdma import verbs
from rdmakv.wire.format import DIGEST_LEN, check_keys

log = logging.getLogger("rdmakv.tiers.infinistore")
_T = TypeVar("_T")

SCHEME = "infinistore://"
KEY_PREFIX = "rdmakv/v1/"
"""Namespace of rdmakv's names in the store; ``v1`` is this naming scheme's version."""
MARKER_BYTES = DIGEST_LEN
"""A marker's value: the digest of the value it names."""
MAX_BATCH = 1024
"""Keys per InfiniStore request at most (checked in the soft-RoCE VM)."""
NOT_FOUND_CLASS = "InfiniStoreKeyNotFound"


def parse_address(spec: str) -> tuple[str, int]:
    """``(host, port)`` of ``infinistore://host:port``; ConfigError naming what is wrong."""
    if not spec.startswith(SCHEME):
        raise ConfigError(f"InfiniStore address must be {SCHEME}HOST:PORT, got {spec!r}")
    host, sep, port = spec[len(SCHEME) :].rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"InfiniStore address must be {SCHEME}HOST:PORT, got {spec!r}")
    return host.strip("[]"), int(port)


def value_name(key: bytes, digest: bytes) -> str:
    return f"{KEY_PREFIX}{key.hex()}/{digest.hex()}"


def marker_name(key: bytes) -> str:
    return f"{KEY_PREFIX}{key.hex()}"


class InfiniStoreTier:
    """The :class:`~rdmakv.client.node_client.NodeClient` API over one InfiniStore server.

    ``slab`` may be None for a control-only client (``exists``, ``delete``,
    ``stats``). Connects at construction: ConnectionLost names the address
    when the server does not answer within ``timeout``.
    """

    def __init__(
        self,
        host: str,
        port: int,
        slab: Slab | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        device: str | None = None,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        try:
            import infinistore
        except ImportError as e:
            raise ConfigError(
                f"{SCHEME} needs the infinistore package: pip install 'rdmakv[infinistore]' ({e})"
            ) from e
        self._lib: Any = infinistore
        self.host, self.port, self.slab, self.timeout = host, port, slab, timeout
        try:
            self._rdma = verbs.select(device)
        except RdmaUnavailable as e:
            raise RdmaUnavailable(f"{SCHEME}{host}:{port} needs an RDMA device: {e}") from e
        self.transport_name = "rdma"
        self._lock = threading.RLock()
        self._conn: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        # Markers go out from and come back into this buffer (registered too).
        self._scratch = np.zeros(MAX_BATCH * MARKER_BYTES, dtype=np.uint8)
        self.counters = {"puts": 0, "stored": 0, "gets": 0, "hits": 0, "split_reads": 0}
        with self._lock:
            self._connect()

    # -- connection -------------------------------------------------------------------
    def _connect(self) -> None:
        lib = self._lib
        cfg = lib.ClientConfig(
            host_addr=self.host,
            service_port=self.port,
            dev_name=self._rdma.device,
            ib_port=self._rdma.port,
            link_type=lib.LINK_ETHERNET
            if self._rdma.link_layer == "Ethernet"
            else lib.LINK_IB,
            connection_type=lib.TYPE_RDMA,
            log_level="warning",
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="infinistore")
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, name="infinistore-io", daemon=True).start()
        self._loop = loop
        conn = lib.InfinityConnection(cfg)
        try:
            self._blocking(conn.connect, "connect")
            regions = [(self._scratch.ctypes.data, self._scratch.nbytes)]
            if self.slab is not None:
                regions.append((self.slab.base_addr, self.slab.nbytes))
            for addr, length in regions:
                self._blocking(partial(conn.register_mr, addr, length), "register memory")
        except TransportError as e:
            self._drop()
            raise ConnectionLost(f"InfiniStore {self.host}:{self.port}: {e}") from e
        self._conn = conn

    def _drop(self) -> None:
        """Forget the connection (a stuck call keeps its daemon thread)."""
        conn, self._conn = self._conn, None
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop = None
        if conn is not None:
            try:
                conn.close()
            except Exception as e:  # the library raises plain Exception
                log.debug("closing InfiniStore connection: %s", e)

    def _ready(self) -> Any:
        if self._conn is None:
            self._connect()
        return self._conn

    def _blocking(self, fn: Callable[[], _T], what: str) -> _T:
        assert self._pool is not None
        return self._wait(self._pool.submit(fn), what)

    def _async(self, coro: Coroutine[Any, Any, _T], what: str) -> _T:
        assert self._loop is not None
        return self._wait(asyncio.run_coroutine_threadsafe(coro, self._loop), what)

    def _wait(self, fut: concurrent.futures.Future[_T], what: str) -> _T:
        try:
            return fut.result(self.timeout)
        except concurrent.futures.TimeoutError as e:
            self._drop()
            raise TransportTimeout(
                f"InfiniStore {self.host}:{self.port}: {what} took over {self.timeout} s"
            ) from e
        except Exception as e:
            if type(e).__name__ == NOT_FOUND_CLASS:
                raise
            self._drop()
            raise ConnectionLost(f"InfiniStore {self.host}:{self.port}: {what}: {e}") from e

    # -- API ----------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        nbytes: int | Sequence[int],
        digests: Sequence[bytes],
    ) -> list[bool]:
        """Store whole slab blocks ``handles`` under ``keys``; True where stored."""
        slab = self._need_slab()
        sizes = check_put(slab, keys, handles, nbytes, digests).sizes
        whole = [i for i, n in enumerate(sizes) if n == slab.block_size]
        out = [False] * len(keys)
        with self._lock:
            conn = self._ready()
            base = slab.base_addr
            for lo in range(0, len(whole), MAX_BATCH):
                idx = whole[lo : lo + MAX_BATCH]
                values = [(value_name(keys[i], digests[i]), slab.offset(handles[i])) for i in idx]
                markers = [(marker_name(keys[i]), j * MARKER_BYTES) for j, i in enumerate(idx)]
                self._scratch[: len(idx) * MARKER_BYTES] = np.frombuffer(
                    b"".join(digests[i] for i in idx), dtype=np.uint8
                )
                # Value first: a marker never names a value that was not written.
                self._async(conn.rdma_write_cache_async(values, slab.block_size, base), "write")
                self._async(
                    conn.rdma_write_cache_async(markers, MARKER_BYTES, self._scratch.ctypes.data),
                    "mark",
                )
                for i in idx:
                    out[i] = True
        self.counters["puts"] += len(keys)
        self.counters["stored"] += sum(out)
        return out

    def get(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[bool]:
        """Fetch ``keys`` into slab blocks ``handles``; True per hit (digest included)."""
        return [n is not None for n in self.get_sizes(keys, handles, digests)]

    def get_sizes(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[int | None]:
        """Like :meth:`get`; a hit's size is the slab's block size (whole blocks only)."""
        slab = self._need_slab()
        check_get(slab, keys, handles, digests)
        out: list[int | None] = [None] * len(keys)
        with self._lock:
            conn = self._ready()
            for lo in range(0, len(keys), MAX_BATCH):
                idx = list(range(lo, min(lo + MAX_BATCH, len(keys))))
                for i in self._read(conn, slab, idx, keys, handles, digests):
                    out[i] = slab.block_size
        self.counters["gets"] += len(keys)
        self.counters["hits"] += sum(n is not None for n in out)
        return out

    def _read(
        self,
        conn: Any,
        slab: Slab,
        idx: list[int],
        keys: Sequence[bytes],
        handles: Sequence[int],
        digests: Sequence[bytes],
    ) -> list[int]:
        """Indexes of ``idx`` read; a rejected batch is halved until its misses are found.

        A rejected batch moved no bytes (InfiniStore checks every key first),
        so a miss leaves its block as it was.
        """
        if not idx:
            return []
        blocks = [(value_name(keys[i], digests[i]), slab.offset(handles[i])) for i in idx]
        try:
            self._async(conn.rdma_read_cache_async(blocks, slab.block_size, slab.base_addr), "read")
            return idx
        except Exception as e:
            if type(e).__name__ != NOT_FOUND_CLASS:
                raise
        if len(idx) == 1:
            return []
        self.counters["split_reads"] += 1
        half = len(idx) // 2
        return self._read(conn, slab, idx[:half], keys, handles, digests) + self._read(
            conn, slab, idx[half:], keys, handles, digests
        )

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether a value is stored under each key (any digest), like KVClient.exists."""
        check_keys(keys)
        with self._lock:
            conn = self._ready()
            names = [marker_name(k) for k in keys]
            return self._blocking(lambda: [bool(conn.check_exist(n)) for n in names], "exists")

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove each key's value and marker; True where the key was stored."""
        check_keys(keys)
        out = self.exists(keys)
        with self._lock:
            conn = self._ready()
            present = [i for i, hit in enumerate(out) if hit]
            for lo in range(0, len(present), MAX_BATCH):
                idx = present[lo : lo + MAX_BATCH]
                markers = [(marker_name(keys[i]), j * MARKER_BYTES) for j, i in enumerate(idx)]
                names = [m for m, _ in markers]
                try:
                    self._async(
                        conn.rdma_read_cache_async(
                            markers, MARKER_BYTES, self._scratch.ctypes.data
                        ),
                        "read markers",
                    )
                    raw = self._scratch[: len(idx) * MARKER_BYTES].tobytes()
                    names += [
                        value_name(keys[i], raw[j * MARKER_BYTES : (j + 1) * MARKER_BYTES])
                        for j, i in enumerate(idx)
                    ]
                except Exception as e:  # a marker evicted meanwhile: its value is orphaned
                    if type(e).__name__ != NOT_FOUND_CLASS:
                        raise
                self._blocking(partial(conn.delete_keys, names), "delete")
        return out

    def stats(self) -> dict[str, Any]:
        """This client's counters (the server's own figures are on its manage port)."""
        return {"tier": "infinistore", "address": f"{self.host}:{self.port}", **self.counters}

    def report(self, label: str, reason: str | None) -> bool:
        """InfiniStore has no place for client reports: never recorded."""
        return False

    def close(self) -> None:
        with self._lock:
            self._drop()

    def __enter__(self) -> InfiniStoreTier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _need_slab(self) -> Slab:
        if self.slab is None:
            raise ConfigError("this InfiniStore client was opened without a slab (control only)")
        return self.slab

    def __repr__(self) -> str:
        return f"InfiniStoreTier({self.host}:{self.port}, {self._rdma.describe()})"


__all__ = ["SCHEME", "InfiniStoreTier", "marker_name", "parse_address", "value_name"]
