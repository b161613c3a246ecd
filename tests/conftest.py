"""Shared fixtures: real ``rdmakv serve`` processes on 127.0.0.1.

``node_factory(**options)`` starts a node (``--port 0`` unless given: the node
picks a free port and reports it on its ready line, so parallel tests never
race for ports) and returns a :class:`NodeProcess`; every node a test started
is killed at teardown. ``node`` is one default node. Options map to CLI flags:
``pool_size="64MiB"`` -> ``--pool-size 64MiB``; ``token=b"..."`` writes a token
file and passes ``--token-file``.

``fake_node(hello, script)`` is a fake node instead: a socket server speaking
the protocol as a test's script says (a lying node, a stalling one).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from rdmakv.blocks.slab import Slab
from rdmakv.errors import RdmakvError
from rdmakv.node.process import LocalNodeProcess
from rdmakv.wire.channel import Channel
from rdmakv.wire.format import (
    HEADER,
    RESPONSE_BIT,
    Header,
    NodeInfo,
    Op,
    Status,
    decode_node_info,
    encode_hello,
    encode_node_info,
)

try:  # the engine venv has no hypothesis (its tests use none)
    from hypothesis import settings
except ImportError:
    pass
else:
    # Hypothesis's default 200 ms deadline per example is a timing assertion: on a
    # loaded CI host a correct example can take longer. Tests assert results only.
    settings.register_profile("rdmakv", deadline=None)
    settings.load_profile("rdmakv")

DEFAULT_POOL = "32MiB"
DEFAULT_BLOCK = "64KiB"
IO_TIMEOUT_S = 10.0


class NodeProcess(LocalNodeProcess):
    """A test node: small defaults, stderr kept in the test's tmp dir, no mlock.

    ``token=b"..."`` becomes a token file passed as ``--token-file``; other
    options map to CLI flags (``pool_size="64MiB"`` -> ``--pool-size 64MiB``).
    """

    def __init__(self, tmp: Path, options: dict[str, Any]) -> None:
        opts = {"pool_size": DEFAULT_POOL, "block_size": DEFAULT_BLOCK, **options}
        port = int(opts.pop("port", 0))
        token = opts.pop("token", None)
        if token is not None:
            path = tmp / f"token-{id(self)}"
            path.write_bytes(token)
            opts["token_file"] = str(path)
        super().__init__(
            {k: str(v) for k, v in opts.items()},
            port=port,
            stderr_path=tmp / f"node-{id(self)}.stderr",
            extra_args=["--no-lock"],
        )

    def stderr(self) -> str:
        assert self.stderr_path is not None
        return self.stderr_path.read_text(errors="replace")


@pytest.fixture
def node_factory(tmp_path: Path) -> Iterator[Callable[..., NodeProcess]]:
    nodes: list[NodeProcess] = []

    def make(**options: Any) -> NodeProcess:
        n = NodeProcess(tmp_path, options)
        nodes.append(n)
        return n

    yield make
    for n in nodes:
        n.kill()
        n.close()


@pytest.fixture
def node(node_factory: Callable[..., NodeProcess]) -> NodeProcess:
    return node_factory()


@pytest.fixture
def client_slab() -> Iterator[Slab]:
    """A 16 MiB client slab of 64 KiB blocks (the default node block size)."""
    slab = Slab(16 * 1024 * 1024, 64 * 1024, lock=False)
    yield slab
    slab.close()


def declined_call(*args: object) -> None:
    """A stand-in for a native client call (``protocol._native_get_call``)
    that takes nothing: it answers None, as the real one does for arguments
    it does not take, so the client serves the call in Python."""
    return None


Script = Callable[[Channel, Header, bytearray], bool]
"""How a fake node answers one request after the handshake (False: close the connection).
A HELLO answered by the script itself is the HELLO's (channel, header, payload)."""


def _closes(ch: Channel, hdr: Header, payload: bytearray) -> bool:
    return False


@pytest.fixture
def fake_node() -> Iterator[Callable[[NodeInfo | Script, Script], tuple[str, int]]]:
    """``fake_node(hello, script)`` starts a real socket server on 127.0.0.1
    that answers HELLO with ``hello`` (a NodeInfo; or a Script, which answers
    it itself) and every request after it by ``script`` (default: none, the
    connection is closed), one connection at a time, and returns its
    address; its listening sockets are closed at teardown."""
    servers: list[socket.socket] = []

    def start(hello: NodeInfo | Script, script: Script = _closes) -> tuple[str, int]:
        ls = socket.create_server(("127.0.0.1", 0))
        servers.append(ls)

        def serve() -> None:
            while True:
                try:
                    conn, _ = ls.accept()
                except OSError:
                    return
                ch = Channel(conn)
                try:
                    hdr = ch.recv_header()
                    payload = ch.recv_payload(hdr)
                    if isinstance(hello, NodeInfo):
                        ch.send(Op.HELLO | RESPONSE_BIT, encode_node_info(hello), req_id=hdr.req_id)
                    elif not hello(ch, hdr, payload):
                        continue  # the finally closes it
                    while True:
                        hdr = ch.recv_header()
                        if not script(ch, hdr, ch.recv_payload(hdr)):
                            break
                except (OSError, RdmakvError):
                    pass
                finally:
                    conn.close()

        threading.Thread(target=serve, daemon=True).start()
        host, port = ls.getsockname()[:2]
        return host, port

    yield start
    for ls in servers:
        ls.close()


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


def run_published(
    script: str, *args: str, out: Path, name: str
) -> tuple[dict[str, Any], str]:
    """Run ``bench/<script> ARGS --out OUT`` and check the output every such
    script gives (``rdmakv.perf.provenance.publish``): exit 0, one JSON object
    on stdout, the same object in ``OUT/<name>.json``, a plot in
    ``OUT/<name>.png``. Returns the object and the script's stderr."""
    r = subprocess.run(
        [sys.executable, str(BENCH_DIR / script), *args, "--out", str(out)],
        capture_output=True, text=True, timeout=170, check=False,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    result: dict[str, Any] = json.loads(r.stdout)
    assert result == json.loads((out / f"{name}.json").read_text())
    assert (out / f"{name}.png").stat().st_size > 0
    return result, r.stderr


class Raw:
    """A hand-driven connection: send any bytes, read one response."""

    def __init__(self, node: NodeProcess, rcvbuf: int | None = None) -> None:
        """``rcvbuf``: a fixed receive buffer (SO_RCVBUF, set before connecting),
        so that a large answer the test does not read yet holds its sender up."""
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.settimeout(IO_TIMEOUT_S)
        if rcvbuf is not None:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.sock.connect(node.address)
        self.ch = Channel(self.sock)
        self.rid = 0

    def frame(
        self,
        opcode: int,
        payload: bytes = b"",
        *,
        bulk: bytes = b"",
        flags: int = 0,
        bulk_len: int | None = None,
        payload_len: int | None = None,
    ) -> None:
        self.rid += 1
        hdr = HEADER.pack(
            opcode,
            flags,
            0,
            len(payload) if payload_len is None else payload_len,
            len(bulk) if bulk_len is None else bulk_len,
            self.rid,
        )
        self.sock.sendall(hdr + payload + bulk)

    def response(self) -> tuple[Header, bytes, bytes]:
        hdr = self.ch.recv_header()
        payload = bytes(self.ch.recv_payload(hdr))
        bulk = bytearray(hdr.bulk_len)
        if hdr.bulk_len:
            self.ch.recv_bulk([memoryview(bulk)])
        assert hdr.opcode & RESPONSE_BIT
        return hdr, payload, bytes(bulk)

    def call(self, opcode: int, payload: bytes = b"", **kw: object) -> tuple[int, bytes, bytes]:
        self.frame(opcode, payload, **kw)  # type: ignore[arg-type]
        hdr, p, b = self.response()
        return hdr.status, p, b

    def hello(self, token: bytes | None = None) -> None:
        status, payload, _ = self.call(Op.HELLO, encode_hello(token))
        assert status == Status.OK, payload
        self.info = decode_node_info(payload)

    def closed_by_peer(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()
