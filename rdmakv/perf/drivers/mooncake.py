"""Mooncake Transfer Engine (PyPI ``mooncake-transfer-engine-non-cuda``), one-sided.

The Transfer Engine is a *transfer engine*, not a store: it moves bytes between
buffers that engines have registered, addressed by ``(session, address)``, and
has no key space. So the bench measures it the way KV-cache systems built on it
(vLLM's and SGLang's Mooncake connectors) use it, as a one-sided write/read
between this process's registered memory and a peer's registered memory:

* **Keys map to fixed block slots.** Block ``i`` of the source arena goes to
  slot ``i`` of a remote buffer of ``blocks * block_bytes`` bytes, and
  ``get`` reads slot ``i`` back into block ``i`` of the destination arena. The
  keys themselves are not sent anywhere; :meth:`MooncakeTEDriver.exists` raises
  :class:`PeerUnavailable` (nothing to look up).
* **Target process.** :meth:`MooncakeTEDriver.open` starts a target: a second
  ``TransferEngine`` in a child process (``python -m
  rdmakv.perf.drivers.mooncake --target``), initialised in P2P handshake mode
  (``initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "")``: no metadata
  server; the session id is ``"127.0.0.1:<get_rpc_port()>"``). It prints
  ``MOONCAKE_TARGET <session> <control address>`` on stdout and then serves a
  tiny line protocol on a TCP control socket: ``ALLOC <bytes>`` maps a fresh
  buffer (anonymous mmap, every page touched so transfers do not pay first-touch
  faults), registers it with ``register_memory`` and answers ``OK <session>
  <address>``; the buffer is unregistered and freed when that control
  connection closes. The target exits when its stdin closes (the owning driver
  closed, or died). Its glog output goes to a log file whose tail is quoted
  when it fails to start.
* **Concurrency.** The owner publishes the control address as
  :attr:`MooncakeTEDriver.server`; a driver given ``server=`` (another
  process) allocates its own region on that same target, so several
  initiators write into one target engine without sharing slots.
* **put / get.** This process's engine registers ``src`` and ``dst`` once each
  (``register_memory(addr, nbytes)``) and writes one block in ``open()`` (the
  first transfer to a peer sets up the endpoint: QPs, the TCP connection),
  then ``batch_transfer_sync_write(session, [src addrs], [remote addrs],
  [lengths])`` / ``batch_transfer_sync_read`` with ``work.batch`` blocks per
  call (a non-zero return is an error).
* **Protocol.** ``"tcp"``: the target runs with ``MC_FORCE_TCP=1`` and both
  engines are initialised with protocol ``"tcp"``. ``"rdma"``: both use
  ``"rdma"`` with automatic device discovery; when the engine finds no RDMA
  device (``get_local_topology()`` lists no HCA) it would silently fall back to
  TCP, so this is :class:`PeerUnavailable` instead of a mislabelled figure
  (likewise when ``MC_FORCE_TCP`` is set in this process: Mooncake reads its
  environment once). ``MC_TCP_ENABLE_CONNECTION_POOL=1`` is set (unless the
  environment already says otherwise) in this process and the target, as
  deployments do: without it every transfer opens a new TCP connection.

The wheel's CUDA build (``mooncake-transfer-engine``) needs ``libcudart`` and
cannot import on a machine without CUDA; the ``-non-cuda`` wheel is the one to
install here.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import mmap
import os
import select
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from rdmakv.errors import TransportError
from rdmakv.perf.driver import Arena, PeerUnavailable, Workload

HOST = "127.0.0.1"
METADATA = "P2PHANDSHAKE"
READY = "MOONCAKE_TARGET"
START_TIMEOUT_S = 60.0
"""How long the target may take to print its ready line."""
CONTROL_TIMEOUT_S = 120.0
"""One control request at most (``ALLOC`` touches every page of the region)."""
PROTOCOLS = ("tcp", "rdma")
TUNING_ENV = {"MC_TCP_ENABLE_CONNECTION_POOL": "1"}
"""Set (unless already set) in this process and the target before the first engine.
Without the pool Mooncake's TCP transport opens and closes one connection per
transfer; deployments turn it on (SGLang/vLLM recipes), and it is what a fair
comparison measures."""
PAGE = mmap.PAGESIZE
NO_EXISTS = "Mooncake Transfer Engine is a transfer engine, not a store: no exists"


def _import_engine() -> Any:
    # glog prints INFO lines per engine to stderr; warnings and errors still show.
    os.environ.setdefault("GLOG_minloglevel", "1")
    try:
        # importlib: the wheel ships no type information (no mypy override needed).
        engine_mod = importlib.import_module("mooncake.engine")
    except ImportError as e:
        raise PeerUnavailable(
            "mooncake_te: cannot import mooncake.engine (pip install "
            f"mooncake-transfer-engine-non-cuda; the CUDA wheel needs libcudart): {e}"
        ) from e
    return engine_mod.TransferEngine


def _hcas(engine: Any) -> list[str]:
    """RDMA devices the engine discovered (``get_local_topology()``: per NUMA node,
    ``[preferred HCAs, available HCAs]``)."""
    try:
        topo = json.loads(engine.get_local_topology())
    except Exception:
        return []
    found: set[str] = set()
    for lists in topo.values():
        for names in lists:
            found.update(str(n) for n in names)
    return sorted(found)


class MooncakeTEDriver:
    """One-sided writes/reads into a target engine's buffer (see the module docstring)."""

    name = "mooncake_te"
    has_exists = False

    def __init__(
        self, protocol: str = "tcp", server: str | None = None, *, device: str = ""
    ) -> None:
        self.protocol = protocol
        self.device = device
        """Mooncake's ``device_name`` (``""``: discover; e.g. ``"rxe0"``)."""
        self.server: str | None = server
        """``host:port`` of the target's control socket (set by :meth:`open` when it starts one)."""
        self._join = server is not None
        self._engine: Any = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._ctl: socket.socket | None = None
        self._ctl_file: Any = None
        self._session = ""
        self._remote = 0
        self._registered: list[int] = []
        self._work: Workload | None = None
        self._src = 0
        self._dst = 0

    # -- lifetime ---------------------------------------------------------

    def open(self, work: Workload, src: Arena, dst: Arena) -> None:
        if self.protocol not in PROTOCOLS:
            raise PeerUnavailable(f"mooncake_te: unknown protocol {self.protocol!r}")
        need = work.blocks * work.block_bytes
        if src.nbytes < need or dst.nbytes < need:
            raise ValueError(f"arenas hold {src.nbytes}/{dst.nbytes} bytes, workload needs {need}")
        if self.protocol == "rdma" and os.environ.get("MC_FORCE_TCP") is not None:
            raise PeerUnavailable(
                "mooncake_te: MC_FORCE_TCP is set in this process, so Mooncake would use TCP"
            )
        engine_cls = _import_engine()
        for var, value in TUNING_ENV.items():
            os.environ.setdefault(var, value)  # before the first engine: read once per process
        self._work = work
        engine = engine_cls()
        rc = engine.initialize(HOST, METADATA, self.protocol, self.device)
        if rc != 0:
            raise PeerUnavailable(
                f"mooncake_te: TransferEngine.initialize({HOST!r}, {METADATA!r}, "
                f"{self.protocol!r}, {self.device!r}) returned {rc}"
            )
        self._engine = engine
        if self.protocol == "rdma" and not _hcas(engine):
            raise PeerUnavailable(
                "mooncake_te: no RDMA device found (get_local_topology() lists no HCA); "
                "Mooncake would fall back to TCP"
            )
        self._src = int(src.ctypes.data)
        self._dst = int(dst.ctypes.data)
        for addr, size in ((self._src, src.nbytes), (self._dst, dst.nbytes)):
            rc = engine.register_memory(addr, size)
            if rc != 0:
                raise PeerUnavailable(f"mooncake_te: register_memory({size} bytes) returned {rc}")
            self._registered.append(addr)
        if not self._join:
            self.server = self._start_target()
        assert self.server is not None
        self._session, self._remote = self._alloc(self.server, need)
        # Warm-up (untimed): the first transfer to a peer sets up its endpoint
        # (RDMA QPs, the TCP connection), which a timed put should not pay.
        rc = engine.batch_transfer_sync_write(
            self._session, [self._src], [self._remote], [work.block_bytes]
        )
        if rc != 0:
            raise PeerUnavailable(f"mooncake_te: warm-up write to {self._session} returned {rc}")

    def _start_target(self) -> str:
        self._tmp = tempfile.TemporaryDirectory(prefix="rdmakv-bench-mooncake-")
        log = Path(self._tmp.name) / "target.log"
        env = dict(os.environ)
        if self.protocol == "tcp":
            env["MC_FORCE_TCP"] = "1"
        else:
            env.pop("MC_FORCE_TCP", None)
        argv = [sys.executable, "-m", __name__, "--target", "--protocol", self.protocol]
        if self.device:
            argv += ["--device", self.device]
        with log.open("wb") as err:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, env=env
            )
        assert self._proc.stdout is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        line = b""
        while time.monotonic() < deadline and self._proc.poll() is None:
            ready, _, _ = select.select([self._proc.stdout], [], [], 0.1)
            if ready:
                line = self._proc.stdout.readline()
                if line.startswith(READY.encode()) or not line:
                    break
        fields = line.decode(errors="replace").split()
        if len(fields) == 3 and fields[0] == READY:
            return fields[2]
        tail = log.read_text(errors="replace")[-2000:]
        self._stop_target()
        raise PeerUnavailable(
            f"mooncake_te: target engine did not start (got {line!r}); its log:\n{tail}"
        )

    def _alloc(self, server: str, nbytes: int) -> tuple[str, int]:
        host, _, port = server.rpartition(":")
        try:
            self._ctl = socket.create_connection((host, int(port)), timeout=CONTROL_TIMEOUT_S)
            self._ctl_file = self._ctl.makefile("rwb")
            self._ctl_file.write(f"ALLOC {nbytes}\n".encode())
            self._ctl_file.flush()
            reply = self._ctl_file.readline().decode(errors="replace").split()
        except OSError as e:
            raise PeerUnavailable(f"mooncake_te: target at {server} unreachable: {e}") from e
        if len(reply) != 3 or reply[0] != "OK":
            raise PeerUnavailable(f"mooncake_te: target could not allocate {nbytes} bytes: {reply}")
        return reply[1], int(reply[2])

    def _stop_target(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        with contextlib.suppress(OSError):
            if proc.stdin is not None:
                proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()

    def close(self) -> None:
        for f in (self._ctl_file, self._ctl):
            if f is not None:
                with contextlib.suppress(OSError):
                    f.close()
        self._ctl_file = self._ctl = None
        engine, self._engine = self._engine, None
        if engine is not None:
            for addr in self._registered:
                with contextlib.suppress(Exception):
                    engine.unregister_memory(addr)
        self._registered = []
        del engine
        if not self._join:
            self._stop_target()
            self.server = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    # -- data path --------------------------------------------------------

    def _transfer(self, keys: Sequence[bytes], local: int, write: bool) -> None:
        engine, work = self._engine, self._work
        if engine is None or work is None or not self._session:
            raise TransportError("mooncake_te: driver is not open")
        if len(keys) > work.blocks:
            raise ValueError(f"{len(keys)} keys, but the target holds {work.blocks} slots")
        op = engine.batch_transfer_sync_write if write else engine.batch_transfer_sync_read
        bs = work.block_bytes
        for start in range(0, len(keys), work.batch):
            idx = range(start, min(start + work.batch, len(keys)))
            rc = op(
                self._session,
                [local + i * bs for i in idx],
                [self._remote + i * bs for i in idx],
                [bs] * len(idx),
            )
            if rc != 0:
                what = "write" if write else "read"
                raise TransportError(
                    f"mooncake_te: batch_transfer_sync_{what} of blocks {start}..{idx[-1]} "
                    f"returned {rc}"
                )

    def put(self, keys: Sequence[bytes]) -> None:
        self._transfer(keys, self._src, write=True)

    def get(self, keys: Sequence[bytes]) -> None:
        self._transfer(keys, self._dst, write=False)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        raise PeerUnavailable(NO_EXISTS)


# -- the target process -----------------------------------------------------


def _serve_client(engine: Any, lock: threading.Lock, conn: socket.socket, session: str) -> None:
    """One control connection: ``ALLOC <bytes>`` -> ``OK <session> <address>``."""
    regions: list[tuple[int, mmap.mmap, Any]] = []
    try:
        with conn, conn.makefile("rwb") as f:
            for raw in f:
                parts = raw.split()
                if len(parts) != 2 or parts[0] != b"ALLOC":
                    f.write(b"ERR expected ALLOC <bytes>\n")
                    f.flush()
                    continue
                try:
                    size = int(parts[1])
                    region = mmap.mmap(-1, max(size, PAGE))
                    view = np.frombuffer(region, dtype=np.uint8)
                    view[::PAGE] = 0  # touch every page now, not during the first transfer
                    addr = int(view.ctypes.data)
                    with lock:
                        rc = engine.register_memory(addr, size)
                    if rc != 0:
                        raise RuntimeError(f"register_memory returned {rc}")
                    regions.append((addr, region, view))
                    f.write(f"OK {session} {addr}\n".encode())
                except Exception as e:
                    f.write(f"ERR {type(e).__name__}: {e}\n".encode())
                f.flush()
    except OSError:
        pass
    finally:
        for addr, _, _ in regions:
            with lock, contextlib.suppress(Exception):
                engine.unregister_memory(addr)
        regions.clear()


def _target_main(protocol: str, device: str) -> int:
    engine_cls = _import_engine()
    engine = engine_cls()
    rc = engine.initialize(HOST, METADATA, protocol, device)
    if rc != 0:
        print(f"TransferEngine.initialize returned {rc}", file=sys.stderr, flush=True)
        return 1
    session = f"{HOST}:{engine.get_rpc_port()}"
    ctl = socket.create_server((HOST, 0))
    lock = threading.Lock()

    def exit_on_eof() -> None:
        sys.stdin.buffer.read()
        os._exit(0)

    threading.Thread(target=exit_on_eof, daemon=True).start()
    print(f"{READY} {session} {HOST}:{ctl.getsockname()[1]}", flush=True)
    while True:
        conn, _ = ctl.accept()
        threading.Thread(
            target=_serve_client, args=(engine, lock, conn, session), daemon=True
        ).start()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Mooncake TE target for rdmakv bench")
    p.add_argument("--target", action="store_true", required=True)
    p.add_argument("--protocol", choices=PROTOCOLS, default="tcp")
    p.add_argument("--device", default="")
    args = p.parse_args(argv)
    return _target_main(args.protocol, args.device)


if __name__ == "__main__":
    sys.exit(main())
