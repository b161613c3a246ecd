"""rdmakv through a real ``rdmakv serve`` (TCP or RDMA), batched as KVClient batches.

``open()`` starts a node (``--no-lock``, a pool that holds the workload twice
plus slack; it evicts older keys as any cache does) unless ``server="HOST:PORT"``
names a running one. Two :class:`~rdmakv.client.node_client.KVClient` connections carry
the data: one over a slab laid on the bench's source arena (puts read it in
place), one over a slab laid on its destination arena (gets land in it in
place), exactly as an engine lays a slab over its host KV pool. Each
``put``/``get`` is ONE client call with every key; the client splits it into
pipelined sub-batches itself. Each of the two is opened as
``KVCacheManager(streams=...)`` opens its client: with ``streams`` None (the
default: 2 over RDMA; over TCP 2 on a host of 2 usable CPUs or more, else 1)
or > 1 a
:class:`~rdmakv.client.streams.MultiStreamClient` where that comes to several
connections (a big batch is split across them).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rdmakv.blocks.slab import Slab
from rdmakv.client.node_client import NodeClient
from rdmakv.client.remote import open_remote
from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.node.process import LocalNodeProcess, NodeStartError
from rdmakv.perf.driver import Arena, PeerUnavailable, Workload
from rdmakv.wire.format import DIGEST_LEN

logger = logging.getLogger(__name__)

CLIENT_TIMEOUT_S = 120.0
POOL_WORKLOADS = 2
"""The node's pool holds the workload this many times over (plus slack). A
repeat's put follows the previous repeat's get and delete at once, on another
connection, and the get's session unpins the blocks it sent only once its
send call has returned, which may be after the client has every byte: with
room for one workload only, that put would find the pool full for a moment
and store a part (the node answers NO_SPACE rather than wait)."""
POOL_SLACK_BLOCKS = 16
NODE_LOG_LINES = 5
"""The node's last warnings a failed put or get names in its error."""


class RdmakvDriver:
    name = "rdmakv"

    def __init__(
        self, transport: str = "tcp", server: str | None = None, streams: int | None = None
    ) -> None:
        if transport not in ("tcp", "rdma"):
            raise PeerUnavailable(f"rdmakv: unknown transport {transport!r}")
        self.transport = transport
        self.streams = streams
        self.server: str | None = server
        self._owns_node = server is None
        self._node: LocalNodeProcess | None = None
        self._put_c: NodeClient | None = None
        self._get_c: NodeClient | None = None
        self._slabs: list[Slab] = []
        self._block = 0
        self._handles: list[int] = []
        """Block handles 0..n-1 of the slabs, a list as an engine's block ids
        are (made once, not in each timed call)."""
        self._log: Path | None = None
        """The node's stderr (kept out of the progress bar; removed on close)."""

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        self._block = work.block_bytes
        self._handles = list(range(work.blocks))
        if self._owns_node:
            fd, log = tempfile.mkstemp(prefix="rdmakv-bench-node-", suffix=".log")
            os.close(fd)
            self._log = Path(log)
            pool = work.block_bytes * (POOL_WORKLOADS * work.blocks + POOL_SLACK_BLOCKS)
            options = {
                "pool-size": str(pool),
                "block-size": str(work.block_bytes),
                "transport": self.transport,
            }
            try:
                self._node = LocalNodeProcess(
                    options, extra_args=["--no-lock"], stderr_path=self._log
                )
            except NodeStartError as e:
                # A cold first start in the emulated soft-RoCE VM (imports over
                # 9p) can exceed the ready timeout; the second finds them cached.
                # A node that failed for a reason (no device) says so on stderr.
                if self._log.read_text(errors="replace").strip():
                    raise
                logger.info("rdmakv node was slow to start (%s); trying once more", e)
                self._node = LocalNodeProcess(
                    options, extra_args=["--no-lock"], stderr_path=self._log
                )
            self.server = self._node.endpoint
        assert self.server is not None
        src_slab = Slab.over_buffer(src, work.block_bytes)
        dst_slab = Slab.over_buffer(dst, work.block_bytes)
        self._slabs = [src_slab, dst_slab]
        self._open_clients("connect")

    def reconnect(self) -> None:
        """Fresh client connections to the same node, over the same slabs (over
        RDMA new QPs; the slabs' memory registrations are reused)."""
        self._close_clients()
        self._open_clients("reconnect")

    def _open_clients(self, what: str) -> None:
        """The put client over the source slab, the get client over the destination's."""
        src_slab, dst_slab = self._slabs
        try:
            # the engine's own path: a KVClient, or a MultiStreamClient for several;
            # each assigned as soon as it exists, so close() closes it if the next fails
            self._put_c = self._open_client(src_slab)
            self._get_c = self._open_client(dst_slab)
        except RdmakvError as e:
            raise PeerUnavailable(f"rdmakv: cannot {what} over {self.transport}: {e}") from e

    def _close_clients(self) -> None:
        for c in (self._put_c, self._get_c):
            if c is not None:
                with contextlib.suppress(Exception):
                    c.close()
        self._put_c = self._get_c = None

    def _open_client(self, slab: Slab) -> NodeClient:
        assert self.server is not None
        return open_remote(self.server, slab, transport=self.transport,
                           timeout=CLIENT_TIMEOUT_S, streams=self.streams)

    @staticmethod
    def _padded(keys: Sequence[bytes]) -> list[bytes]:
        """Each key padded or cut to DIGEST_LEN bytes: the digests of keys of
        other lengths (the bench's own keys are DIGEST_LEN bytes)."""
        return [bytes(k).ljust(DIGEST_LEN, b"\0")[:DIGEST_LEN] for k in keys]

    def _with_digests(
        self, op: Callable[..., list[Any]], keys: Sequence[bytes], *args: int
    ) -> list[Any]:
        """``op(keys, blocks, *args, digests)`` with each key as its own
        content digest, as an engine passes the block hashes it already holds.
        The client checks every digest before it sends anything and refuses a
        list with one of another length (ConfigError): only then is a padded
        copy built, so a timed call neither builds one nor checks the list
        twice (what each cost: bench/README.md, "Measurements moved from code
        comments (issue 58)"). The blocks are a list, as an engine's block ids
        are: a ``range`` took the client's slower per-handle checks."""
        n = len(keys)
        blocks = self._handles if n == len(self._handles) else list(range(n))
        try:
            return op(keys, blocks, *args, keys)
        except ConfigError:
            return op(keys, blocks, *args, self._padded(keys))

    def put(self, keys: Sequence[bytes]) -> None:
        assert self._put_c is not None
        ok = self._with_digests(self._put_c.put, keys, self._block)
        if not all(ok):
            raise RuntimeError(
                f"rdmakv put stored {sum(ok)} of {len(keys)} blocks{self._node_says()}"
            )

    def get(self, keys: Sequence[bytes]) -> None:
        assert self._get_c is not None
        hits = self._with_digests(self._get_c.get, keys)
        if not all(hits):
            raise RuntimeError(
                f"rdmakv get hit {sum(hits)} of {len(keys)} blocks{self._node_says()}"
            )

    def _node_says(self) -> str:
        """The last warnings of the node this driver started, for an error
        message: its log is deleted when the driver closes, and the client's
        side of a failure (logged on the bench's stderr) tells only half."""
        if self._log is None:
            return ""
        lines = [
            line.strip()
            for line in self._log.read_text(errors="replace").splitlines()
            if " WARNING " in line or " ERROR " in line
        ]
        if not lines:
            return "; the node logged no warning"
        return "; the node's last warnings: " + " | ".join(lines[-NODE_LOG_LINES:])

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        assert self._put_c is not None
        return self._put_c.exists(keys)

    def discard(self, keys: Sequence[bytes]) -> None:
        if self._put_c is not None:
            self._put_c.delete(keys)

    def close(self) -> None:
        self._close_clients()
        for s in self._slabs:
            with contextlib.suppress(Exception):
                s.close()
        self._slabs = []
        if self._node is not None:
            self._node.close()
            self._node = None
        if self._log is not None:
            self._log.unlink(missing_ok=True)
            self._log = None
