"""ClusterClient: one KV client API over many KV nodes.

Keys are placed by rendezvous hashing (:mod:`rdmakv.client.cluster.rendezvous`) over
the current *members* (:mod:`rdmakv.client.cluster.membership`); each member has its
own :class:`~rdmakv.client.node_client.KVClient` (its own connection and transport: RDMA or
TCP per node, so mixed clusters work), all sharing the caller's one slab.

Invariants:

* **Same API as KVClient** (:class:`NodeClient`): put/get/get_sizes/exists/
  delete take and return lists in the caller's order; stats/close/
  transport_name exist. The manager can hold either.
* **One round per node per batch.** A batch is split per node and the
  sub-batches run concurrently (the first on the caller's thread, the rest on
  a thread pool); a node gets at most one call per round. Reads with
  replication R take at most R rounds (keys that missed on their first live
  replica are asked of the next one).
* **Placement follows membership, not health.** A node that is down keeps its
  keys: its share of gets/exists are misses, its share of puts/deletes is
  dropped (counted in :attr:`ClusterClient.counters`). So a flapping node never
  reshuffles keys; only a membership change moves keys (only those of the
  node that came or went).
* **Node loss never raises and never hangs.** A call whose node fails with a
  transport error (timeout, refused, connection lost, broken stream, auth)
  makes that node *down* with exponential backoff (:mod:`rdmakv.client.cluster.health`)
  and turns exactly its keys into misses / unstored. Down nodes get no data
  calls; when the backoff has passed a background probe reconnects and, on
  success, the node is used again. A data call waits for every sub-batch it
  started -- a transfer may still be writing the caller's slab blocks, so it
  is never abandoned -- and each KVClient bounds its own waits by ``timeout``
  (a stalled node costs one timeout, on that node's share only, once per
  backoff period at most, and the probe pays it, not a data call).
* **Only caller errors raise**: a bad argument raises ConfigError before
  anything is sent. Membership changes are applied between calls; a call uses
  one consistent snapshot of the members throughout.
* Never wrong KV: every get is digest-checked by the node's KVClient, as before.

Thread-safe. Each instance owns two small thread pools (data sub-batches;
background connects, probes and DNS refreshes); threads are created lazily.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt

from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster.health import DEFAULT_BACKOFF_BASE_S, DEFAULT_BACKOFF_CAP_S, NodeHealth
from rdmakv.client.cluster.membership import Membership, parse_members, split_node_id
from rdmakv.client.cluster.rendezvous import IndexArray, Rendezvous
from rdmakv.client.node_client import (
    KVClient,
    check_get,
    check_put,
)
from rdmakv.defaults import DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.errors import (
    AuthError,
    ConfigError,
    ConnectionLost,
    ProtocolError,
    RdmakvError,
    TransportError,
)
from rdmakv.transport import get_transport
from rdmakv.wire.format import check_keys

log = logging.getLogger("rdmakv.cluster")
_T = TypeVar("_T")

DEFAULT_CONNECT_RETRIES = 1
"""Attempts per (re)connect of one node's KVClient: the cluster's own backoff
retries a failed node, so a dead node costs one refused connect, not several."""
DEFAULT_MAX_THREADS = 64
"""Threads per pool at most (created on demand): one per node per round suffices."""
MIN_THREADS = 2
NON_ADDITIVE_STATS = frozenset(
    {"block_size", "lease_timeout_s", "protocol_version", "uptime_s"}
)
"""Node stats that are settings or ages, not amounts: left out of the totals."""
COUNTERS = (
    "node_down_events",  # a node went from up to down
    "node_up_events",  # a down node answered a probe and is used again
    "node_errors",  # node calls that failed (transport errors, refusals)
    "puts_dropped",  # key x replica writes not done: node down, or its call failed
    "deletes_dropped",  # likewise for deletes
    "gets_unavailable",  # gets that missed because no replica could be asked
    "exists_unavailable",  # likewise for exists
    "replica_retries",  # keys asked of a further replica after a miss or failure
    "membership_changes",  # a new member list was applied
    "membership_errors",  # a re-resolution failed (the old list stays)
)

_NODE_UNUSABLE = (TransportError, ProtocolError, AuthError, ConfigError, OSError)
"""Errors of a node call that say "this node is unusable now", as opposed to a
refused request (RemoteError). Arguments are validated before any node is
called, so a ConfigError from a node's KVClient is about that node (e.g. it came
back without the transport asked for), not about the caller."""


@dataclasses.dataclass(eq=False)
class _Node:
    """One member. ``client`` is None until the first successful connect;
    up (``health.up``) implies ``client`` is set. ``removed``: no longer a
    member (its client is being closed)."""

    id: str
    host: str
    port: int
    health: NodeHealth
    client: KVClient | None = None
    removed: bool = False


@dataclasses.dataclass(frozen=True)
class _View:
    """Placement snapshot: ``nodes[j]`` is the member named ``ring.nodes[j]``."""

    ring: Rendezvous
    nodes: tuple[_Node, ...]

    def up_mask(self) -> npt.NDArray[np.bool_]:
        # unlocked reads of bools: a stale answer only means one call more or less to a node
        return np.array([n.health.up for n in self.nodes], dtype=bool)


class _Failed:
    """A sub-batch whose node failed (already logged and recorded)."""

    __slots__ = ("error",)

    def __init__(self, error: str) -> None:
        self.error = error


class ClusterClient:
    """Client of a cluster of KV nodes, with KVClient's API (see the module doc).

    ``members``: a :class:`Membership`, a spec string for
    :func:`~rdmakv.client.cluster.membership.parse_members` (``"a:7480,b:7480"``,
    ``"dns://name:7480"``) or a list of ``host:port``. ``replication`` (R): each
    key lives on its top-R nodes. ``timeout`` and ``connect_retries`` are per
    node KVClient; ``backoff_base_s``/``backoff_cap_s`` shape the retry of a
    down node.

    Construction resolves the membership and connects to every member
    concurrently. Members that cannot be reached are logged and start down;
    if none can be reached it raises :class:`ConnectionLost` (or
    :class:`AuthError` when every node refused the token) naming them.

    A membership with ``refresh_s`` (DNS) is re-resolved in the background by
    the first call after ``refresh_s`` has passed; joining nodes are connected
    there too, and the new member list takes effect when that is done (calls
    in between use the old one). :meth:`refresh` does the same synchronously.
    """

    def __init__(
        self,
        members: Membership | str | Sequence[str],
        slab: Slab | None,
        *,
        token: bytes | str | None = None,
        transport: str = "auto",
        timeout: float = DEFAULT_TIMEOUT,
        replication: int = DEFAULT_REPLICATION,
        connect_retries: int = DEFAULT_CONNECT_RETRIES,
        backoff_base_s: float = DEFAULT_BACKOFF_BASE_S,
        backoff_cap_s: float = DEFAULT_BACKOFF_CAP_S,
        max_threads: int = DEFAULT_MAX_THREADS,
    ) -> None:
        if timeout <= 0:
            raise ConfigError(f"timeout must be > 0 seconds, got {timeout}")
        if replication < 1:
            raise ConfigError(f"replication must be >= 1, got {replication}")
        if connect_retries < 1:
            raise ConfigError(f"connect_retries must be >= 1, got {connect_retries}")
        if max_threads < MIN_THREADS:
            # a membership refresh runs on the background pool and waits there for the
            # connects it submits: one thread alone would wait for itself
            raise ConfigError(f"max_threads must be >= {MIN_THREADS}, got {max_threads}")
        NodeHealth(backoff_base_s, backoff_cap_s)  # validates the backoff
        if transport != "auto":
            get_transport(transport)  # fail fast on a bad name
        self.membership: Membership = (
            members if isinstance(members, Membership) else parse_members(members)
        )
        self.slab = slab
        self.token = token
        self.transport = transport
        self.timeout = timeout
        self.replication = replication
        self.connect_retries = connect_retries
        self.backoff_base_s = backoff_base_s
        self.backoff_cap_s = backoff_cap_s
        self._lock = threading.Lock()
        self._refresh_lock = threading.Lock()  # one membership refresh at a time
        self._counters = dict.fromkeys(COUNTERS, 0)
        self._closed = False
        self._refreshing = False
        self._data_pool = ThreadPoolExecutor(max_threads, thread_name_prefix="rdmakv-cluster")
        self._bg_pool = ThreadPoolExecutor(max_threads, thread_name_prefix="rdmakv-cluster-bg")
        nodes: list[_Node] = []
        try:
            ids = self.membership.resolve()
            nodes = [self._new_node(i) for i in ids]
            errors = self._connect(nodes)
            if len(errors) == len(nodes):
                what = "; ".join(f"{n.id}: {e}" for n, e in zip(nodes, errors.values(),
                                                                     strict=True))
                if all(isinstance(e, AuthError) for e in errors.values()):
                    raise AuthError(f"every rdmakv node refused the token: {what}")
                raise ConnectionLost(
                    f"cannot reach any rdmakv node of {self.membership.describe()}: {what}"
                ) from next(iter(errors.values()))
            for node, err in errors.items():
                log.warning("rdmakv node %s unreachable; starting without it (its keys miss "
                            "until it answers): %s", node.id, err)
        except BaseException:
            self._shutdown(nodes)
            raise
        ring = Rendezvous(ids)
        self._warn_if_short(ring)
        by_id = {n.id: n for n in nodes}
        self._view = _View(ring, tuple(by_id[i] for i in ring.nodes))
        self._next_refresh = self._refresh_deadline()

    # -- membership & health -----------------------------------------------------------
    def _new_node(self, node_id: str) -> _Node:
        host, port = split_node_id(node_id)
        return _Node(node_id, host, port, NodeHealth(self.backoff_base_s, self.backoff_cap_s))

    def _open(self, node: _Node) -> KVClient:
        return KVClient(
            node.host, node.port, self.slab, token=self.token, transport=self.transport,
            timeout=self.timeout, connect_retries=self.connect_retries,
        )

    def _connect(self, nodes: Sequence[_Node]) -> dict[_Node, BaseException]:
        """Connect ``nodes`` concurrently (each bounded by its KVClient's timeout).
        Connected nodes get their client; the others are marked down and
        returned with their error. A non-rdmakv error (a bug) is re-raised."""
        futures = [self._bg_pool.submit(self._open, n) for n in nodes]
        errors: dict[_Node, BaseException] = {}
        bug: BaseException | None = None
        for node, fut in zip(nodes, futures, strict=True):
            try:
                node.client = fut.result()
            except (RdmakvError, OSError) as e:
                errors[node] = e
                with self._lock:
                    node.health.failed(time.monotonic(), str(e))
            except BaseException as e:  # keep collecting: no connection may leak
                bug = bug or e
        if bug is not None:
            for n in nodes:
                if n.client is not None:
                    n.client.close()
            raise bug
        return errors

    def _refresh_deadline(self) -> float:
        every = self.membership.refresh_s
        return float("inf") if every is None else time.monotonic() + every

    def refresh(self) -> bool:
        """Re-resolve the membership now (blocking) and apply it; True if it changed.

        New members are connected first (concurrently); those that fail start
        down. Removed members' clients are closed. Raises ConnectionLost if
        the membership cannot be resolved (the current members stay).
        """
        self._check_open()
        with self._refresh_lock:
            return self._refresh_locked()

    def _refresh_locked(self) -> bool:
        ids = self.membership.resolve()
        with self._lock:
            current = {n.id: n for n in self._view.nodes}
        if set(ids) == set(current):
            return False
        added = [self._new_node(i) for i in ids if i not in current]
        errors = self._connect(added)
        for node, err in errors.items():
            log.warning("new rdmakv node %s unreachable; it starts down: %s", node.id, err)
        ring = Rendezvous(ids)
        self._warn_if_short(ring)
        by_id = {**current, **{n.id: n for n in added}}
        removed = [n for n in current.values() if n.id not in set(ids)]
        with self._lock:
            closed = self._closed
            if not closed:
                for n in removed:
                    n.removed = True
                self._view = _View(ring, tuple(by_id[i] for i in ring.nodes))
                self._counters["membership_changes"] += 1
        if closed:  # closed while we were connecting: the new clients are ours to close
            for n in added:
                if n.client is not None:
                    n.client.close()
            return False
        log.info("rdmakv cluster %s: members now %s (+%d, -%d)", self.membership.describe(),
                 ",".join(ring.nodes), len(added), len(removed))
        for n in removed:
            if n.client is not None:
                n.client.close()  # waits for a call still using it (bounded by its timeout)
        return True

    def _refresh_in_background(self) -> None:
        try:
            with self._refresh_lock:
                self._refresh_locked()
        except RdmakvError as e:
            with self._lock:
                self._counters["membership_errors"] += 1
            log.warning("rdmakv cluster %s: re-resolving failed, keeping %d members: %s",
                        self.membership.describe(), len(self._view.nodes), e)
        except Exception:
            log.exception("rdmakv cluster: membership refresh failed")
        finally:
            with self._lock:
                self._refreshing = False
                self._next_refresh = self._refresh_deadline()

    def _probe(self, node: _Node) -> None:
        """Try a down node once: (re)connect and one STATS round trip."""
        fresh: KVClient | None = None
        try:
            if node.client is None:
                fresh = self._open(node)
            else:
                node.client.stats()  # the KVClient reconnects by itself
        except Exception as e:
            if not isinstance(e, RdmakvError | OSError):
                log.exception("rdmakv cluster: probing %s failed unexpectedly", node.id)
            with self._lock:
                node.health.probing = False
                node.health.failed(time.monotonic(), str(e))
                retry_in = node.health.retry_at - time.monotonic()
            log.debug("rdmakv node %s still down (retry in %.1fs): %s", node.id, retry_in, e)
            return
        with self._lock:
            node.health.probing = False
            gone = self._closed or node.removed
            if not gone:
                if fresh is not None:
                    node.client = fresh
                if node.health.succeeded():
                    self._counters["node_up_events"] += 1
        if gone:
            if fresh is not None:
                fresh.close()
            return
        log.info("rdmakv node %s is back", node.id)

    def _maintain(self) -> _View:
        """Start due background work (probes, a membership refresh); return the
        snapshot this call uses. Never blocks on the network."""
        now = time.monotonic()
        with self._lock:
            if self._closed:
                raise ConfigError("ClusterClient is closed")
            view = self._view
            if not self._refreshing and now >= self._next_refresh:
                self._refreshing = True
                self._bg_pool.submit(self._refresh_in_background)
            for node in view.nodes:
                if node.health.probe_due(now):
                    node.health.probing = True
                    self._bg_pool.submit(self._probe, node)
        return view

    def _node_failed(self, node: _Node, exc: BaseException, what: str) -> None:
        """Record a failed node call; only a node still up goes down (so that
        concurrent failures of one outage count one backoff step, not several)."""
        down = isinstance(exc, _NODE_UNUSABLE)
        with self._lock:
            self._counters["node_errors"] += 1
            went_down = down and node.health.up and node.health.failed(time.monotonic(), str(exc))
            if went_down:
                self._counters["node_down_events"] += 1
            retry_in = node.health.backoff_s()
        if went_down:
            log.warning("rdmakv node %s down (retry in %.1fs); its keys miss meanwhile. "
                        "%s failed: %s", node.id, retry_in, what, exc)
        elif not down:
            log.warning("rdmakv node %s refused %s; those keys miss: %s", node.id, what, exc)

    # -- fan-out -------------------------------------------------------------------------
    def _scatter(
        self, jobs: Sequence[tuple[_Node, Callable[[KVClient], _T]]], what: str
    ) -> list[_T | _Failed]:
        """Run each job on its node's client concurrently (the first on this
        thread) and wait for all; a failed job gives :class:`_Failed` (the node
        failure is recorded). Only non-rdmakv exceptions (bugs) propagate."""

        def run(node: _Node, fn: Callable[[KVClient], _T]) -> _T:
            client = node.client
            if client is None or node.removed:
                raise _Gone
            return fn(client)

        if not jobs:
            return []
        futures: list[Future[_T] | None] = [None]
        futures += [self._data_pool.submit(run, n, fn) for n, fn in jobs[1:]]
        out: list[_T | _Failed] = []
        for (node, fn), fut in zip(jobs, futures, strict=True):
            try:
                out.append(run(node, fn) if fut is None else fut.result())
            except _Gone:
                out.append(_Failed("not a member any more"))
            except (RdmakvError, OSError) as e:
                if not node.removed:  # a removed node's client may be closed under us
                    self._node_failed(node, e, what)
                out.append(_Failed(str(e)))
        return out

    def _count(self, name: str, n: int) -> None:
        if n:
            with self._lock:
                self._counters[name] += n

    def _read_rounds(
        self,
        view: _View,
        keys: Sequence[bytes],
        ask: Callable[[KVClient, list[int]], Sequence[_T]],
        is_hit: Callable[[_T], bool],
        miss: _T,
        what: str,
        unavailable: str,
    ) -> list[_T]:
        """Ask each key's first up replica; ask the next replica for keys that
        missed there or whose node failed (one batched round per rank)."""
        out: list[_T] = [miss] * len(keys)
        ranks = view.ring.rank(keys, self.replication)
        r = ranks.shape[1]
        pos = np.zeros(len(keys), dtype=np.intp)
        answered = np.zeros(len(keys), dtype=bool)  # some replica answered (hit or miss)
        pending = np.arange(len(keys), dtype=np.intp)
        for rnd in range(r):
            pos_p = _first_up(ranks, pending, pos[pending], view.up_mask())
            pos[pending] = pos_p
            sendable = pos_p < r
            pending = pending[sendable]
            if not len(pending):
                break
            if rnd:
                self._count("replica_retries", len(pending))
            target = ranks[pending, pos[pending]]
            groups = [(j, pending[target == j]) for j in np.unique(target).tolist()]
            jobs = [
                (view.nodes[j], _bind(ask, sel.tolist())) for j, sel in groups
            ]
            results = self._scatter(jobs, what)
            retry: list[npt.NDArray[np.intp]] = []
            for (_, sel), res in zip(groups, results, strict=True):
                if isinstance(res, _Failed):
                    retry.append(sel)
                    continue
                answered[sel] = True
                missed: list[int] = []
                for i, v in zip(sel.tolist(), res, strict=True):
                    if is_hit(v):
                        out[i] = v
                    else:
                        missed.append(i)
                retry.append(np.array(missed, dtype=np.intp))
            pending = np.concatenate(retry) if retry else pending[:0]
            pos[pending] += 1
        self._count(unavailable, int(np.count_nonzero(~answered)))
        return out

    def _write_all(
        self,
        view: _View,
        keys: Sequence[bytes],
        send: Callable[[KVClient, list[int]], Sequence[bool]],
        what: str,
        dropped: str,
    ) -> list[bool]:
        """Send each key to all of its replicas that are up (one call per node);
        True per key where any replica said True."""
        out = [False] * len(keys)
        ranks = view.ring.rank(keys, self.replication)
        up = view.up_mask()
        jobs = []
        sels = []
        skipped = 0
        for j in range(len(view.nodes)):
            sel = np.flatnonzero((ranks == j).any(axis=1))
            if not len(sel):
                continue
            if not up[j]:
                skipped += len(sel)
                continue
            idx = sel.tolist()
            jobs.append((view.nodes[j], _bind(send, idx)))
            sels.append(idx)
        for idx, res in zip(sels, self._scatter(jobs, what), strict=True):
            if isinstance(res, _Failed):
                skipped += len(idx)
                continue
            for i, ok in zip(idx, res, strict=True):
                if ok:
                    out[i] = True
        self._count(dropped, skipped)
        return out

    # -- API -----------------------------------------------------------------------------
    def put(
        self,
        keys: Sequence[bytes],
        handles: Sequence[int],
        nbytes: int | Sequence[int],
        digests: Sequence[bytes],
    ) -> list[bool]:
        """Store slab blocks ``handles`` under ``keys`` on each key's top-R nodes.

        True where at least one replica now holds the key. Writes to down or
        failing replicas are dropped (``counters["puts_dropped"]``, per key and
        replica). Arguments as for :meth:`KVClient.put`.
        """
        view = self._maintain()
        slab = self._need_slab()
        sizes = check_put(slab, keys, handles, nbytes, digests).sizes
        if not keys:
            return []

        def send(c: KVClient, idx: list[int]) -> list[bool]:
            return c.put([keys[i] for i in idx], [handles[i] for i in idx],
                         [sizes[i] for i in idx], [digests[i] for i in idx])

        return self._write_all(view, keys, send, "put", "puts_dropped")

    def get(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[bool]:
        """Fetch ``keys`` into slab blocks ``handles``; True per hit (see :meth:`get_sizes`)."""
        return [n is not None for n in self.get_sizes(keys, handles, digests)]

    def get_sizes(
        self, keys: Sequence[bytes], handles: Sequence[int], digests: Sequence[bytes]
    ) -> list[int | None]:
        """Value length per hit, None per miss, in the caller's order.

        Each key is read from its first up replica in rank order; a miss or a
        failure there asks the next replica in a further batched round. A
        digest mismatch is a miss; keys of down nodes are misses.
        """
        view = self._maintain()
        slab = self._need_slab()
        check_get(slab, keys, handles, digests)
        if not keys:
            return []

        def ask(c: KVClient, idx: list[int]) -> list[int | None]:
            return c.get_sizes([keys[i] for i in idx], [handles[i] for i in idx],
                               [digests[i] for i in idx])

        return self._read_rounds(view, keys, ask, _is_not_none, None, "get", "gets_unavailable")

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: committed on some live replica (False for keys of down nodes)."""
        view = self._maintain()
        check_keys(keys)
        if not keys:
            return []

        def ask(c: KVClient, idx: list[int]) -> list[bool]:
            return c.exists([keys[i] for i in idx])

        return self._read_rounds(view, keys, ask, bool, False, "exists", "exists_unavailable")

    def delete(self, keys: Sequence[bytes]) -> list[bool]:
        """Remove keys from every up replica; True per key that some replica held.
        Deletes for down replicas are dropped (counted): a stale copy there is
        still the right value for its key (keys name content), only not freed."""
        view = self._maintain()
        check_keys(keys)
        if not keys:
            return []

        def send(c: KVClient, idx: list[int]) -> list[bool]:
            return c.delete([keys[i] for i in idx])

        return self._write_all(view, keys, send, "delete", "deletes_dropped")

    def stats(self) -> dict[str, Any]:
        """``{"nodes": {id: node stats | {"error": ...}}, "total": {...}, "cluster": {...}}``.

        ``total`` sums every numeric node stat (KVClient's keys) over the nodes
        that answered, except settings like ``block_size`` (NON_ADDITIVE_STATS);
        ``cluster`` holds member counts, replication and :attr:`counters`.
        Down nodes are reported, not contacted.
        """
        view = self._maintain()
        nodes: dict[str, dict[str, Any]] = {}
        asked: list[_Node] = []
        for node in view.nodes:
            if node.health.up:
                asked.append(node)
            else:
                nodes[node.id] = {"error": f"down: {node.health.last_error}",
                                  "retry_in_s": round(max(0.0, node.health.retry_at
                                                          - time.monotonic()), 3)}
        results = self._scatter([(n, _node_stats) for n in asked], "stats")
        total: dict[str, Any] = {}
        for node, res in zip(asked, results, strict=True):
            if isinstance(res, _Failed):
                nodes[node.id] = {"error": res.error}
                continue
            nodes[node.id] = res
            for k, v in res.items():
                if k in NON_ADDITIVE_STATS or isinstance(v, bool):
                    continue
                if isinstance(v, int | float):
                    total[k] = total.get(k, 0) + v
        up = sum(1 for n in view.nodes if n.health.up)
        cluster = {
            "membership": self.membership.describe(),
            "members": len(view.nodes),
            "up": up,
            "replication": self.replication,
            "transports": self.transports,
            **self.counters,
        }
        return {"nodes": dict(sorted(nodes.items())), "total": total, "cluster": cluster}

    def report(self, label: str, reason: str | None) -> bool:
        """:meth:`KVClient.report` to every up node; True if any recorded it."""
        view = self._maintain()
        asked = [n for n in view.nodes if n.health.up]
        results = self._scatter(
            [(n, partial(_node_report, label=label, reason=reason)) for n in asked], "report"
        )
        return any(r is True for r in results)

    # -- introspection ---------------------------------------------------------------------
    @property
    def members(self) -> tuple[str, ...]:
        """Current member node ids, sorted."""
        return self._view.ring.nodes

    @property
    def up_members(self) -> tuple[str, ...]:
        return tuple(n.id for n in self._view.nodes if n.health.up)

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of the counters named in :data:`COUNTERS`."""
        with self._lock:
            return dict(self._counters)

    @property
    def transports(self) -> dict[str, str | None]:
        """Transport per member (None until it has connected)."""
        return {n.id: n.client.transport_name if n.client else None for n in self._view.nodes}

    @property
    def transport_name(self) -> str | None:
        """The transports of the connected nodes, e.g. ``"tcp"`` or ``"rdma+tcp"``."""
        names = sorted({t for t in self.transports.values() if t is not None})
        return "+".join(names) or None

    def _warn_if_short(self, ring: Rendezvous) -> None:
        if len(ring) < self.replication:
            log.warning(
                "replication %d but only %d member(s): each key is stored %d time(s)",
                self.replication, len(ring), len(ring),
            )

    def owners(self, keys: Sequence[bytes]) -> list[tuple[str, ...]]:
        """The member ids each key is placed on, best first (R of them at most)."""
        return self._view.ring.owners(keys, self.replication)

    # -- lifecycle -------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise ConfigError("ClusterClient is closed")

    def _need_slab(self) -> Slab:
        if self.slab is None:
            raise ConfigError("this ClusterClient has no slab: pass one to put/get blocks")
        return self.slab

    def close(self) -> None:
        """Close every node client; idempotent. Background probes still running
        close whatever they open when they finish."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            nodes = list(self._view.nodes)
        self._shutdown(nodes)

    def _shutdown(self, nodes: list[_Node]) -> None:
        self._closed = True
        for n in nodes:
            if n.client is not None:
                n.client.close()
        self._data_pool.shutdown(wait=False, cancel_futures=True)
        self._bg_pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        view = self._view if hasattr(self, "_view") else None
        n = len(view.nodes) if view else 0
        up = sum(1 for x in view.nodes if x.health.up) if view else 0
        return (f"ClusterClient({self.membership.describe()}, {up}/{n} up, "
                f"R={self.replication}, transport={self.transport_name})")


class _Gone(Exception):
    """The node left the membership (or never connected) before its call ran."""


def _first_up(
    ranks: IndexArray,
    rows: npt.NDArray[np.intp],
    pos: npt.NDArray[np.intp],
    up: npt.NDArray[np.bool_],
) -> npt.NDArray[np.intp]:
    """For each row, the first rank position >= ``pos`` whose node is up
    (``ranks.shape[1]`` where none is)."""
    r = ranks.shape[1]
    pos = pos.copy()
    for _ in range(r):
        live = pos < r
        cand = ranks[rows, np.minimum(pos, r - 1)]
        skip = live & ~up[cand]
        if not skip.any():
            break
        pos += skip
    return pos


def _bind(
    fn: Callable[[KVClient, list[int]], Sequence[_T]], idx: list[int]
) -> Callable[[KVClient], Sequence[_T]]:
    return lambda c: fn(c, idx)


def _is_not_none(v: object) -> bool:
    return v is not None


def _node_stats(c: KVClient) -> dict[str, Any]:
    return c.stats()


def _node_report(c: KVClient, *, label: str, reason: str | None) -> bool:
    return c.report(label, reason)
