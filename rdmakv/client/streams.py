"""MultiStreamClient: one node over several connections, a large batch split across them.

One :class:`~rdmakv.client.node_client.KVClient` moves a batch over one connection: over
TCP one stream, whose bytes one client thread sends and one node session
thread receives; over RDMA one queue pair. Where that one stream is
CPU-bound (a Python client and node on a busy host, soft-RoCE, a NIC that
needs several queue pairs to reach line rate), ``streams`` connections moving
disjoint parts of a batch at once go faster: each part's bytes move in the
native loop with the GIL released, the node serves each connection on a
thread of its own, and each RDMA connection has its own queue pair.

Invariants:

* **Same contract as KVClient** (:class:`~rdmakv.client.node_client.NodeClient`): lists
  in the caller's order, a digest mismatch is a miss, every wait bounded by
  ``timeout``, bad arguments raise :class:`~rdmakv.errors.ConfigError` before
  anything is sent.
* **A batch is checked once**: a small one by the first connection's
  KVClient, a big one here as a whole (errors name its keys' positions in
  the whole batch) before its parts go to the connections' ``put_checked`` /
  ``get_checked``, which check nothing again.
* **Only big batches are split**, into contiguous runs of keys, one per
  connection: at least :data:`MIN_SPLIT_BATCH_BYTES` in all, of values of at
  least :data:`MIN_SPLIT_VALUE_BYTES_RDMA` over RDMA (every connection runs
  what the first one settled on). Over TCP a get's values from
  :data:`MIN_SPLIT_GET_VALUE_BYTES`, and a put's from
  :data:`MIN_SPLIT_VALUE_BYTES` (:data:`MIN_SPLIT_VALUE_BYTES_MANY_CPUS` on a
  host of :data:`MANY_CPUS` usable CPUs or more). Over TCP the threads that
  run each part's per-key Python also move its bytes: on 2 cores, below 64
  KiB values two of them putting (hashing and sending, while two node
  threads receive) measured slower than one, and two getting (receiving and
  verifying, while the node threads only send) faster from 16 KiB; on 16
  cores two were faster from 16 KiB both ways. Over RDMA the bytes move
  without them, each connection on its own queue pair.
  Everything else (and exists, delete, stats) uses the first connection.
* **A call returns only when every part has finished**: a part may still be
  moving bytes of the caller's slab. If parts failed, the first failure in key
  order is raised once all are done; the other parts' keys may be stored
  (put) or fetched (get) meanwhile, as when one KVClient fails mid-batch.
* Thread-safe as KVClient is: each connection serialises its own calls.

**How many by default** (``streams=None``): :data:`STREAMS_RDMA` when the
first connection runs RDMA. Two queue pairs per node is Mooncake Transfer
Engine's default too (``MC_NUM_QP_PER_EP``), tuned on production NICs. Over
TCP :data:`STREAMS_TCP` on a host of :data:`TWO_CPUS` usable CPUs or more
(:func:`usable_cpus`), else :data:`STREAMS_TCP_ONE_CPU`. Each stream's bytes
are moved by its own client thread (and node session thread), so a second one
pays where it has a core to run on, even on 2 cores: a client thread spends
most of a put in one native call with the GIL released, most of that in the
kernel's copy. A second stream costs a node session either way, and where
several client processes share 2 cores, one stream each moved more: pass
``streams=1`` there.

The measurements behind these defaults and the split floors below are in
bench/README.md, section "Measurements moved from code comments (issue 58)".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from itertools import pairwise
from typing import Any, TypeVar

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import KVClient, check_get, check_put
from rdmakv.defaults import DEFAULT_TIMEOUT, MAX_STREAMS
from rdmakv.errors import ConfigError, RdmakvError

STREAMS_TCP = 2
"""Connections per node by default over TCP on a host of :data:`TWO_CPUS`
usable CPUs or more: with a core each, two connections' threads moved more
bytes than one's from 64 KiB values, on 2 cores as on 16 (``rdmakv bench`` on
warm connections)."""
STREAMS_TCP_ONE_CPU = 1
"""Connections per node by default over TCP where the process may use one CPU
only (a cpuset, ``taskset``): a second stream's thread would only take turns
with the first."""
TWO_CPUS = 2
"""Usable CPUs from which TCP gets :data:`STREAMS_TCP` by default."""
MANY_CPUS = 4
"""Usable CPUs from which a TCP put is split from
:data:`MIN_SPLIT_VALUE_BYTES_MANY_CPUS` values, not :data:`MIN_SPLIT_VALUE_BYTES`:
two streams' client threads beside the caller's own."""
STREAMS_RDMA = 2
"""Connections (queue pairs) per node by default over RDMA: where one queue pair
stays at perftest's single-QP rate (soft-RoCE), two moved more bytes than one."""
MIN_SPLIT_VALUE_BYTES = 64 * 1024
"""A put's values this big at least are split over TCP with fewer than
:data:`MANY_CPUS` usable CPUs: below it, on 2 cores, two connections put less
than one, their threads hashing and sending beside the node's receiving ones."""
MIN_SPLIT_GET_VALUE_BYTES = 16 * 1024
"""The TCP floor for a get's values, on any host. A get's client thread
receives each value and verifies its checksum while the node's thread only
sends from its pool, so two connections put the second core to work: on 2
cores two got more than one at 16 KiB where two put less, so a put keeps
:data:`MIN_SPLIT_VALUE_BYTES` there. Smaller values were not measured."""

MIN_SPLIT_VALUE_BYTES_MANY_CPUS = 16 * 1024
"""A put's TCP floor with :data:`MANY_CPUS` usable CPUs or more, where each
connection's thread has a core: there two connections moved more than one, put
and get, from 16 KiB values. Smaller values were not measured."""
MIN_SPLIT_VALUE_BYTES_RDMA = 16 * 1024
"""The floor when every connection runs RDMA: two queue pairs moved more than one
at 16 KiB, put and get (soft-RoCE). Smaller values were not measured."""
MIN_SPLIT_BATCH_BYTES = 4 * 1024 * 1024
"""And the batch at least this big in all."""

_T = TypeVar("_T")
log = logging.getLogger("rdmakv.streams")


def check_streams(streams: object) -> None:
    """ConfigError unless ``streams`` is None (by transport) or an int in
    [1, MAX_STREAMS]."""
    if streams is None:
        return
    if isinstance(streams, bool) or not isinstance(streams, int) or not (
        1 <= streams <= MAX_STREAMS
    ):
        raise ConfigError(
            f"streams must be an integer in [1, {MAX_STREAMS}] or unset (by transport: "
            f"{STREAMS_RDMA} over RDMA; over TCP {STREAMS_TCP} with {TWO_CPUS} "
            f"usable CPUs or more, else {STREAMS_TCP_ONE_CPU}), got {streams!r}"
        )


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def default_streams(transport_name: str | None, cpus: int | None = None) -> int:
    """Connections per node when the caller did not say (module docstring);
    ``cpus``: the usable CPUs (None: :func:`usable_cpus`)."""
    if transport_name == "rdma":
        return STREAMS_RDMA
    if cpus is None:
        cpus = usable_cpus()
    return STREAMS_TCP if cpus >= TWO_CPUS else STREAMS_TCP_ONE_CPU


class MultiStreamClient:
    """Client of one KV node over ``streams`` connections (see the module docstring).

    ``streams=1`` is exactly one KVClient; ``None`` picks by the first
    connection's transport (:func:`default_streams`). The connections share
    the caller's one slab (an RDMA device registers it once).
    """

    def __init__(
        self,
        host: str,
        port: int,
        slab: Slab | None,
        *,
        streams: int | None = None,
        token: bytes | str | None = None,
        transport: str = "tcp",
        timeout: float = DEFAULT_TIMEOUT,
    ) -> None:
        check_streams(streams)
        self.slab = slab
        self.clients: list[KVClient] = []
        self._pool: ThreadPoolExecutor | None = None
        self._cpus = usable_cpus()  # the split floor over TCP (min_split_value)
        try:
            self.clients.append(
                KVClient(host, port, slab, token=token, transport=transport, timeout=timeout)
            )
            count = streams if streams is not None else default_streams(
                self.clients[0].transport_name, self._cpus
            )
            # "auto" resolves per connection: the others run what the first
            # settled on, never a mix of RDMA and a fallback
            settled = self.clients[0].transport_name or transport
            for _ in range(count - 1):
                try:
                    self.clients.append(KVClient(
                        host, port, slab, token=token, transport=settled, timeout=timeout
                    ))
                except RdmakvError as e:
                    if streams is not None:
                        raise  # asked for: as loud as one KVClient
                    # the default only adds bandwidth: one connection still serves
                    log.warning(
                        "rdmakv: connection %d of %d to %s:%d failed (%s); going on with %d",
                        len(self.clients) + 1, count, host, port, e, len(self.clients),
                    )
                    break
        except BaseException:
            self.close()
            raise
        if self.streams > 1:  # the connections opened, which the default may leave fewer
            self._pool = ThreadPoolExecutor(self.streams - 1, thread_name_prefix="rdmakv-stream")
        self.split_batches = 0
        """Batches moved over several connections at once (the rest used one)."""

    @property
    def transport_name(self) -> str | None:
        return self.clients[0].transport_name

    @property
    def streams(self) -> int:
        return len(self.clients)

    @property
    def min_split_value(self) -> int:
        """The value size from which a big put is split (see the module docstring)."""
        if all(c.transport_name == "rdma" for c in self.clients):
            return MIN_SPLIT_VALUE_BYTES_RDMA
        if self._cpus >= MANY_CPUS:
            return MIN_SPLIT_VALUE_BYTES_MANY_CPUS
        return MIN_SPLIT_VALUE_BYTES

    @property
    def min_split_get_value(self) -> int:
        """The value size from which a big get is split (see the module docstring)."""
        if all(c.transport_name == "rdma" for c in self.clients):
            return MIN_SPLIT_VALUE_BYTES_RDMA
        return MIN_SPLIT_GET_VALUE_BYTES

    # -- data ops: split when big enough ---------------------------------------------------
    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        nbytes: int | Sequence[int],
        digests: Sequence[bytes],
    ) -> list[bool]:
        slab = self._slab()
        floor = self.min_split_value
        if len(self._block_parts(len(keys), slab, floor)) == 1:  # not even with full blocks
            return self.clients[0].put(keys, handles, nbytes, digests)  # which checks them
        checked = check_put(slab, keys, handles, nbytes, digests)  # once, for every part
        sizes = checked.sizes
        parts = self._parts(len(keys), max(sizes, default=0), sum(sizes), floor)
        return self._run(parts, lambda c, s, e: c.put_checked(
            keys[s:e], handles[s:e], checked.part(s, e)
        ))

    def get(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[bool]:
        return [n is not None for n in self.get_sizes(keys, handles, digests)]

    def get_sizes(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[int | None]:
        slab = self._slab()
        parts = self._block_parts(len(keys), slab, self.min_split_get_value)
        if len(parts) == 1:
            return self.clients[0].get_sizes(keys, handles, digests)  # which checks them
        encoder = check_get(slab, keys, handles, digests)  # once, for every part
        return self._run(parts, lambda c, s, e: c.get_checked(
            keys[s:e], handles[s:e], digests[s:e], encoder.part(s, e)
        ))

    def _slab(self) -> Slab:
        if self.slab is None:
            raise ConfigError("this client has no slab: data ops need one")
        return self.slab

    def _block_parts(self, n: int, slab: Slab, floor: int) -> list[tuple[int, int]]:
        """:meth:`_parts` of ``n`` values of a block each: a get's (what it may
        move), and the most a put's could be. A batch that comes to one part
        goes to the first connection as it is: that KVClient checks it, and a
        check here as well would be the same work twice on every small batch."""
        return self._parts(n, slab.block_size, slab.block_size * n, floor)

    def _parts(
        self, n: int, value_bytes: int, batch_bytes: int, floor: int
    ) -> list[tuple[int, int]]:
        """(start, end) of each connection's contiguous run of keys; split only
        where the values are ``floor`` bytes or more and the batch is big."""
        k = min(len(self.clients), n)
        if k < 2 or value_bytes < floor or batch_bytes < MIN_SPLIT_BATCH_BYTES:
            return [(0, n)]
        bounds = [n * i // k for i in range(k + 1)]
        return list(pairwise(bounds))

    def _run(
        self, parts: list[tuple[int, int]], op: Callable[[KVClient, int, int], list[_T]]
    ) -> list[_T]:
        """``op`` on each part, the first on this thread, the rest on the pool;
        their results in key order once every part has finished."""
        if len(parts) == 1:
            return op(self.clients[0], *parts[0])
        assert self._pool is not None
        self.split_batches += 1
        rest: list[Future[list[_T]]] = [
            self._pool.submit(op, client, s, e)
            for client, (s, e) in zip(self.clients[1:], parts[1:], strict=False)
        ]
        results: list[list[_T] | BaseException] = []
        try:
            results.append(op(self.clients[0], *parts[0]))
        except BaseException as e:  # raised below, once no part touches the slab
            results.append(e)
        for fut in rest:
            try:
                results.append(fut.result())  # each part's waits are bounded by its timeout
            except BaseException as e:
                results.append(e)
        out: list[_T] = []
        for r in results:
            if isinstance(r, BaseException):
                raise r
            out.extend(r)
        return out

    # -- control ops: the first connection -------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        return self.clients[0].exists(keys)

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        return self.clients[0].delete(keys)

    def stats(self) -> dict[str, Any]:
        return self.clients[0].stats()

    def report(self, label: str, reason: str | None) -> bool:
        return self.clients[0].report(label, reason)

    def close(self) -> None:
        pool, self._pool = getattr(self, "_pool", None), None
        if pool is not None:
            pool.shutdown(wait=True)
        for c in self.clients:
            c.close()

    def __enter__(self) -> MultiStreamClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_node(
    host: str,
    port: int,
    slab: Slab | None,
    *,
    streams: int | None = None,
    token: bytes | str | None = None,
    transport: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
) -> KVClient | MultiStreamClient:
    """A client of one node over ``streams`` connections (None: by transport):
    the plain KVClient when that comes to one, else a MultiStreamClient."""
    c = MultiStreamClient(
        host, port, slab, streams=streams, token=token, transport=transport, timeout=timeout
    )
    return c.clients[0] if c.streams == 1 else c
