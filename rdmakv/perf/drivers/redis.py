"""Redis (Debian ``redis-server`` + PyPI ``redis``): what LMCache users put KV chunks in.

* **Server.** :meth:`RedisDriver.open` starts a real ``redis-server`` on
  127.0.0.1 at a free port, in the foreground as a child process
  (``--daemonize no``) that :meth:`RedisDriver.close` kills, with persistence
  off (``--save "" --appendonly no``), its working directory in a temporary
  directory, and ``--maxmemory`` sized to hold the workload several times over
  (:data:`MEMORY_FACTOR` clients' worth, for concurrency runs, plus
  :data:`MEMORY_SLACK` for Redis's per-key overhead) with
  ``--maxmemory-policy noeviction``: a store that runs out says so (``OOM
  command not allowed``) instead of silently evicting blocks the bench is
  about to read back. A driver given ``server="host:port"`` connects to a
  server another driver started and leaves it running; the owner publishes its
  address as :attr:`RedisDriver.server`.
* **Client.** One redis-py connection (``decode_responses=False``). LMCache
  depends on plain ``redis`` (no ``hiredis``), so that is what is measured;
  with ``hiredis`` 3.5.0 installed redis-py parses replies in C but also packs
  commands with it, which copies every value (no clear gain here).
* **put.** One pipeline (``transaction=False``) of ``SET key value`` per
  ``work.batch`` blocks: one round trip per batch. Values are memoryviews of
  the source arena (redis-py sends them without an extra copy). LMCache's
  own ``RedisConnector`` issues one ``SET`` per key (value and metadata under
  two keys) from ``asyncio.gather`` over a connection pool; a pipeline of the
  same ``SET`` commands is the batched form of that, and the strongest
  single-connection way to write through redis-py (``MSET`` moves the same
  bytes in one command, and measured no faster here).
* **get.** One ``MGET`` per ``work.batch`` keys, then each returned ``bytes``
  is copied into its destination block. Redis has no zero-copy read into
  caller memory, so that copy is part of its cost, as it is in LMCache
  (``view[:n] = kv_bytes``).
* **exists.** One pipeline of ``EXISTS key`` for all keys (one round trip;
  multi-key ``EXISTS`` returns only a count, not per-key answers).
* **discard.** One pipeline of ``DEL`` per batch (untimed; keeps repeats within
  ``maxmemory``).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rdmakv.errors import TransportError
from rdmakv.perf.driver import Arena, PeerUnavailable, Workload

MIB = 1 << 20
MEMORY_FACTOR = 8
"""``maxmemory`` holds this many copies of the workload (concurrency runs share one server)."""
MEMORY_SLACK = 256 * MIB
"""Extra ``maxmemory`` for Redis's own per-key and allocator overhead."""
START_TIMEOUT_S = 20.0
"""How long ``redis-server`` may take to answer ``PING`` after it is started."""
SOCKET_TIMEOUT_S = 300.0
"""One request (a whole batch) at most; a wedged server fails instead of hanging."""
START_TRIES = 3
"""Free ports tried when one is taken between probing it and the server binding it."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _import_redis() -> Any:
    try:
        import redis
    except ImportError as e:
        raise PeerUnavailable(f"redis-py is not installed (pip install redis): {e}") from e
    return redis


class RedisDriver:
    """Blocks as Redis string values, one key per block (see the module docstring)."""

    name = "redis"
    has_exists = True

    def __init__(
        self,
        transport: str = "tcp",
        server: str | None = None,
        *,
        server_path: str | None = None,
        maxmemory: int | None = None,
    ) -> None:
        self.transport = transport
        self.server: str | None = server
        """``host:port`` of the Redis server in use (set by :meth:`open` when it starts one)."""
        self._join = server is not None
        self._server_path = server_path
        self._maxmemory = maxmemory
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._client: Any = None
        self._work: Workload | None = None
        self._src: memoryview | None = None
        self._dst: memoryview | None = None

    # -- lifetime ---------------------------------------------------------

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        if self.transport != "tcp":
            raise PeerUnavailable(f"redis: no {self.transport} transport (Redis speaks TCP only)")
        redis = _import_redis()
        need = work.blocks * work.block_bytes
        if src.nbytes < need or dst.nbytes < need:
            raise ValueError(f"arenas hold {src.nbytes}/{dst.nbytes} bytes, workload needs {need}")
        self._work = work
        self._src = src.data.cast("B")
        self._dst = dst.data.cast("B")
        if not self._join:
            self.server = self._start_server(need)
        assert self.server is not None
        host, _, port = self.server.rpartition(":")
        self._client = redis.Redis(
            host=host,
            port=int(port),
            decode_responses=False,
            socket_connect_timeout=5.0,
            socket_timeout=SOCKET_TIMEOUT_S,
        )
        try:
            self._client.ping()
        except redis.RedisError as e:
            raise PeerUnavailable(f"redis: cannot reach {self.server}: {e}") from e

    def reconnect(self) -> None:
        """Fresh connections to the same server: the pool drops its sockets and
        the ping (untimed) opens the next one."""
        client, _ = self._ready()
        client.connection_pool.disconnect()
        client.ping()

    def _start_server(self, data_bytes: int) -> str:
        path = self._server_path or shutil.which("redis-server")
        if path is None:
            for cand in ("/usr/bin/redis-server", "/usr/sbin/redis-server"):
                if Path(cand).exists():
                    path = cand
                    break
        if path is None or not Path(path).is_file():
            raise PeerUnavailable(
                f"redis-server not found ({path or 'not on PATH'}): apt-get install -y redis-server"
            )
        redis = _import_redis()
        maxmemory = self._maxmemory or data_bytes * MEMORY_FACTOR + MEMORY_SLACK
        self._tmp = tempfile.TemporaryDirectory(prefix="rdmakv-bench-redis-")
        log = Path(self._tmp.name) / "redis.log"
        last = ""
        for _ in range(START_TRIES):
            port = _free_port()
            argv = [
                path,
                "--port", str(port),
                "--bind", "127.0.0.1",
                "--daemonize", "no",
                "--save", "",
                "--appendonly", "no",
                "--dir", self._tmp.name,
                "--maxmemory", str(maxmemory),
                "--maxmemory-policy", "noeviction",
                "--protected-mode", "yes",
            ]  # fmt: skip
            with log.open("wb") as out:
                self._proc = subprocess.Popen(
                    argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
                )
            probe = redis.Redis(host="127.0.0.1", port=port, socket_connect_timeout=1.0)
            deadline = time.monotonic() + START_TIMEOUT_S
            try:
                while time.monotonic() < deadline and self._proc.poll() is None:
                    try:
                        if probe.ping():
                            return f"127.0.0.1:{port}"
                    except redis.RedisError:
                        time.sleep(0.05)
            finally:
                probe.close()
            last = log.read_text(errors="replace")[-2000:]
            self._kill_server()
        raise PeerUnavailable(f"redis-server did not start ({path}); its log:\n{last}")

    def _kill_server(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                client.close()
        if not self._join:
            self._kill_server()
            self.server = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._src = self._dst = None

    # -- data path --------------------------------------------------------

    def _ready(self) -> tuple[Any, Workload]:
        if self._client is None or self._work is None:
            raise TransportError("redis: driver is not open")
        return self._client, self._work

    def put(self, keys: Sequence[bytes]) -> None:
        client, work = self._ready()
        src = self._src
        assert src is not None
        bs = work.block_bytes
        try:
            for start in range(0, len(keys), work.batch):
                pipe = client.pipeline(transaction=False)
                for i in range(start, min(start + work.batch, len(keys))):
                    pipe.set(keys[i], src[i * bs : (i + 1) * bs])
                pipe.execute()
        except Exception as e:
            raise TransportError(f"redis: put failed: {type(e).__name__}: {e}") from e

    def get(self, keys: Sequence[bytes]) -> None:
        client, work = self._ready()
        dst = self._dst
        assert dst is not None
        bs = work.block_bytes
        for start in range(0, len(keys), work.batch):
            batch = list(keys[start : start + work.batch])
            try:
                values = client.mget(batch)
            except Exception as e:
                raise TransportError(f"redis: get failed: {type(e).__name__}: {e}") from e
            for j, value in enumerate(values):
                i = start + j
                if value is None or len(value) != bs:
                    got = "missing" if value is None else f"{len(value)} bytes"
                    raise TransportError(f"redis: key {keys[i]!r}: {got}, expected {bs} bytes")
                dst[i * bs : (i + 1) * bs] = value

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        client, _ = self._ready()
        try:
            pipe = client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(k)
            return [bool(n) for n in pipe.execute()]
        except Exception as e:
            raise TransportError(f"redis: exists failed: {type(e).__name__}: {e}") from e

    def discard(self, keys: Sequence[bytes]) -> None:
        client, work = self._ready()
        for start in range(0, len(keys), work.batch):
            client.delete(*keys[start : start + work.batch])
