"""InfiniStore (PyPI ``infinistore``, 0.2.35) over RDMA, as its own client uses it.

The bench talks to InfiniStore directly through its Python client, not through
rdmakv's InfiniStore tier, so the figure is InfiniStore's own:

* **Server.** :meth:`InfiniStoreDriver.open` starts a real ``infinistore``
  server (the console script next to this Python) on the RDMA device, with a
  pool sized to the workload (``--prealloc-size`` is in GiB, at least 1), and
  waits until its manage port answers ``/kvmap_len`` (the data port accepts
  connections earlier than the server serves; how long in the soft-RoCE VM:
  bench/README.md).
  The server refuses to start without an RDMA device (even for TCP clients),
  so on a host without one this is :class:`PeerUnavailable` with its log.
  :func:`start_server` starts one for several drivers (the tests share one);
  a driver given ``server="host:port"`` connects to it and leaves it running.
* **Client.** One ``InfinityConnection`` of ``TYPE_RDMA`` (it pins about
  512 MiB on each side: the soft-RoCE VM needs ``--mem 6144``). The bench's
  ``src`` and ``dst`` arenas are registered once each, by base pointer
  (InfiniStore looks regions up by exact base pointer).
* **put / get.** One ``rdma_write_cache_async`` / ``rdma_read_cache_async``
  request per ``work.batch`` keys (at most 1024), ``[(key, offset)]`` into the arena, one
  block size for the batch; up to ``inflight`` requests in flight at once
  (``asyncio.gather`` on the driver's own event loop), which is how the
  library is meant to be used (its own semaphore allows 128).
* **exists.** ``check_exist`` once per key: InfiniStore has **no batched
  lookup** (``get_match_last_index`` is a binary search that assumes the
  present keys form a prefix, so it cannot answer per key). One TCP round trip
  per key.

Keys are the workload's bytes in hex (InfiniStore keys are ``str``). A read of a
missing key rejects its whole batch (``InfiniStoreKeyNotFound``); the server
evicts least recently used values silently when its pool is 95 % full, which
is why the pool is sized with headroom for the workload.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from rdmakv.perf.driver import Arena, PeerUnavailable, Workload

GIB = 1 << 30
KIB = 1 << 10
DEFAULT_DEVICE = "rxe0"
START_TIMEOUT_S = 300.0
"""Server start at most: imports plus pinning the pool, under the VM's emulated CPU."""
CALL_TIMEOUT_S = 600.0
"""One put or get (all of its batches) at most."""
DEFAULT_INFLIGHT = 4
"""Batched requests in flight at once per put or get."""
MAX_BATCH = 1024
"""Keys per request at most (the largest batch checked to work in the soft-RoCE VM)."""
POOL_FILL = 0.75
"""Fraction of the pool the workload may take (the server starts evicting at 0.95)."""
MIN_ALLOC_KIB = 16
MAX_ALLOC_KIB = 64
"""``--minimal-allocate-size`` bounds (KiB): every value takes a multiple of it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _device_env() -> str:
    return os.environ.get("RDMAKV_TEST_DEVICE", DEFAULT_DEVICE)


def alloc_kib(block_bytes: int) -> int:
    """The server's allocation unit for this block size: the block itself,
    within InfiniStore's bounds (16 KiB..64 KiB; 64 KiB is its default)."""
    return max(MIN_ALLOC_KIB, min(MAX_ALLOC_KIB, math.ceil(block_bytes / KIB)))


def prealloc_gib(work: Workload, copies: int = 1) -> int:
    """Pool size (GiB, at least 1) holding ``copies`` of the workload with headroom."""
    unit = alloc_kib(work.block_bytes) * KIB
    per_block = math.ceil(work.block_bytes / unit) * unit
    return max(1, math.ceil(copies * work.blocks * per_block / POOL_FILL / GIB))


@dataclass
class InfiniStoreServer:
    """A running ``infinistore`` server process; :meth:`close` kills it."""

    host: str
    port: int
    manage_port: int
    proc: subprocess.Popen[bytes]
    log: Path
    _dir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def log_tail(self, n: int = 2000) -> str:
        try:
            return self.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        if self._dir is not None:
            self._dir.cleanup()
            self._dir = None


def start_server(
    prealloc: int = 1,
    *,
    device: str | None = None,
    min_alloc_kib: int = MAX_ALLOC_KIB,
    timeout: float = START_TIMEOUT_S,
) -> InfiniStoreServer:
    """Start an InfiniStore server on ``device`` with a ``prealloc`` GiB pool and wait
    until it serves. PeerUnavailable (with the server's log) if it cannot."""
    device = device or _device_env()
    exe = Path(sys.executable).with_name("infinistore")
    if not exe.exists():
        found = shutil.which("infinistore")
        if found is None:
            raise PeerUnavailable("infinistore server not installed (pip install infinistore "
                                  "uvloop==0.21.0)")
        exe = Path(found)
    if not Path("/sys/class/infiniband", device).exists():
        raise PeerUnavailable(f"InfiniStore's server needs an RDMA device; no {device} here "
                              "(run it in the soft-RoCE VM)")
    port, manage = _free_port(), _free_port()
    tmp = tempfile.TemporaryDirectory(prefix="rdmakv-infinistore-")
    log = Path(tmp.name) / "server.log"
    cmd = [str(exe), "--service-port", str(port), "--manage-port", str(manage),
           "--dev-name", device, "--link-type", "Ethernet", "--prealloc-size", str(prealloc),
           "--minimal-allocate-size", str(min_alloc_kib), "--log-level", "warning"]
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    server = InfiniStoreServer("127.0.0.1", port, manage, proc, log, tmp)
    try:
        deadline = time.monotonic() + timeout
        while True:  # the data port opens before the server serves; the manage port after
            if proc.poll() is not None:
                raise PeerUnavailable(f"infinistore server exited {proc.returncode}: "
                                      f"{server.log_tail()}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{manage}/kvmap_len", timeout=2).read()
                return server
            except OSError:
                if time.monotonic() > deadline:
                    raise PeerUnavailable(f"infinistore server not up in {timeout:.0f} s: "
                                          f"{server.log_tail()}") from None
                time.sleep(1)
    except BaseException:
        server.close()
        raise


class InfiniStoreDriver:
    """InfiniStore over RDMA. ``server="host:port"`` uses a running server (left
    running on close); without it, :meth:`open` starts one sized to the workload
    and sets ``server`` to its address (the registry's convention for sharing)."""

    name = "infinistore"

    def __init__(
        self,
        transport: str = "rdma",
        server: str | None = None,
        *,
        device: str | None = None,
        inflight: int = DEFAULT_INFLIGHT,
        timeout: float = CALL_TIMEOUT_S,
    ) -> None:
        self.transport = transport
        self.server = server
        self.device = device or _device_env()
        self.inflight = max(1, inflight)
        self.timeout = timeout
        self.owned: InfiniStoreServer | None = None
        """The server :meth:`open` started (killed by :meth:`close`); None when given one."""
        self._conn: Any = None
        self._mod: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._work: Workload | None = None
        self._src = 0
        self._dst = 0

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        if self.transport != "rdma":
            raise PeerUnavailable(
                f"InfiniStore is measured over RDMA only (asked for {self.transport}): its "
                "server needs an RDMA device even for TCP clients, its TCP mode is one key "
                "per call, and its TCP read of a missing key never returns")
        try:
            import infinistore
        except Exception as e:  # ImportError, or the wheel's native part failing to load
            raise PeerUnavailable(f"cannot import infinistore: {e!r}") from e
        self._mod = infinistore
        self._work = work
        if self.server is None:
            self.owned = start_server(prealloc_gib(work), device=self.device,
                                      min_alloc_kib=alloc_kib(work.block_bytes))
            self.server = self.owned.address
        h, p = self.server.rsplit(":", 1)
        host, port = h, int(p)
        cfg = infinistore.ClientConfig(
            host_addr=host, service_port=port, dev_name=self.device, ib_port=1,
            link_type=infinistore.LINK_ETHERNET, connection_type=infinistore.TYPE_RDMA,
            log_level="warning",
        )
        conn = infinistore.InfinityConnection(cfg)
        try:
            # connect() prints "connecting to ..." on stdout, which is `rdmakv bench --json`'s.
            with contextlib.redirect_stdout(sys.stderr):
                conn.connect()  # TCP connect + QP exchange; pins ~512 MiB on each side
        except Exception as e:
            tail = self.owned.log_tail() if self.owned else ""
            raise PeerUnavailable(f"infinistore connect failed: {e!r} {tail}".strip()) from e
        self._conn = conn
        self._src = int(src.ctypes.data)
        self._dst = int(dst.ctypes.data)
        conn.register_mr(self._src, int(src.nbytes))
        conn.register_mr(self._dst, int(dst.nbytes))
        self._loop = asyncio.new_event_loop()

    @staticmethod
    def _key(key: bytes) -> str:
        return key.hex()

    def _batches(self, keys: Sequence[bytes]) -> list[list[tuple[str, int]]]:
        assert self._work is not None
        bs, step = self._work.block_bytes, max(1, min(self._work.batch, MAX_BATCH))
        blocks = [(self._key(k), i * bs) for i, k in enumerate(keys)]
        return [blocks[i:i + step] for i in range(0, len(blocks), step)]

    def _run(self, calls: list[Any]) -> None:
        """Await every request, ``inflight`` at a time, on the driver's loop."""
        assert self._loop is not None
        limit = asyncio.Semaphore(self.inflight)

        async def one(call: Any) -> None:
            async with limit:
                await call()

        async def every() -> None:
            await asyncio.gather(*(one(c) for c in calls))

        async def bounded() -> None:
            await asyncio.wait_for(every(), self.timeout)

        self._loop.run_until_complete(bounded())

    def _calls(self, keys: Sequence[bytes], ptr: int, read: bool) -> list[Any]:
        assert self._work is not None and self._conn is not None
        fn = self._conn.rdma_read_cache_async if read else self._conn.rdma_write_cache_async
        return [partial(fn, b, self._work.block_bytes, ptr) for b in self._batches(keys)]

    def put(self, keys: Sequence[bytes]) -> None:
        self._run(self._calls(keys, self._src, read=False))

    def get(self, keys: Sequence[bytes]) -> None:
        self._run(self._calls(keys, self._dst, read=True))

    def discard(self, keys: Sequence[bytes]) -> None:
        """Drop stored keys (the runner calls this between repeats, untimed)."""
        assert self._conn is not None
        self._conn.delete_keys([self._key(k) for k in keys])

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """One ``check_exist`` per key: InfiniStore has no batched lookup."""
        assert self._conn is not None
        return [bool(self._conn.check_exist(self._key(k))) for k in keys]

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            with contextlib.suppress(Exception):  # best effort; the server goes next anyway
                conn.close()
            del conn  # the client's pinned buffers go with the object
        if self._loop is not None:
            self._loop.close()
            self._loop = None
        if self.owned is not None:
            self.owned.close()
            self.owned = None
            self.server = None
