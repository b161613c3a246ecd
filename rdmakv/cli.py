"""The ``rdmakv`` command line: ``serve`` (a KV node), ``stats NODES`` (a node or a cluster),
``demo``, ``doctor``, ``bench`` (rdmakv side by side with its peers)."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import logging
import re
import signal
import socket
import sys
from pathlib import Path

from rdmakv.errors import ConfigError, RdmakvError
from rdmakv.l1.offload_policies import OFFLOAD_MODES

_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "kib": 1024,
    "m": 1000**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1000**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1000**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str) -> int:
    """``"1GiB"`` -> 1073741824, ``"256KiB"``, ``"16k"`` (decimal), ``"4096"``."""
    m = _SIZE_RE.match(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in _SIZE_UNITS:
        raise ConfigError(
            f"bad size {text!r}: use a number with an optional unit "
            "(B, KiB, MiB, GiB, TiB, or decimal k/M/G/T)"
        )
    value = int(float(m.group(1)) * _SIZE_UNITS[unit])
    if value <= 0:
        raise ConfigError(f"size {text!r} must be positive")
    return value


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _read_token(path: str | None) -> bytes | None:
    if path is None:
        return None
    try:
        token = Path(path).read_bytes().strip()
    except OSError as e:
        raise ConfigError(f"cannot read token file {path!r}: {e.strerror}") from None
    if not token:
        raise ConfigError(f"token file {path!r} is empty")
    return token


def _cmd_serve(args: argparse.Namespace) -> int:
    from rdmakv.node import KVNode

    transports = [args.transport]
    if args.transport == "auto":
        from rdmakv.transport import available_transports

        transports = available_transports()
    node = KVNode(
        host=args.host,
        port=args.port,
        pool_size=args.pool_size,
        block_size=args.block_size,
        transports=transports,
        lease_timeout=args.lease_timeout,
        token=_read_token(args.token_file),
        lock_pool=not args.no_lock,
        optional_transports=args.transport == "auto",
    )
    host, port = node.start()
    if node.token is None and not ipaddress.ip_address(socket.gethostbyname(host)).is_loopback:
        logging.getLogger("rdmakv.node").warning(
            "serving on %s without a token: anyone who can reach this port can read and "
            "overwrite cached KV (use --token-file)",
            host,
        )

    def _on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("rdmakv.node").info("signal %d: shutting down", signum)
        node.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # The one line on stdout: tests and scripts wait for it.
    print(
        f"rdmakv node ready on {host}:{port} transports={','.join(node.transports)} "
        f"pool={node.pool.nbytes} block={node.pool.block_size}",
        flush=True,
    )
    node.serve_forever()
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    from rdmakv.remote import open_remote

    # A control-only client (no slab): one node's stats, or per node and in
    # total over a cluster (a node that does not answer shows its error).
    with contextlib.closing(
        open_remote(
            args.address,
            None,
            token=_read_token(args.token_file),
            transport="tcp",
            timeout=args.timeout,
        )
    ) as c:
        print(json.dumps(c.stats(), indent=2, sort_keys=True))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rdmakv import demo

    args.token = _read_token(args.token_file)
    return demo.main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rdmakv", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run a KV node")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=7480, help="TCP port (0 = pick a free one)")
    p.add_argument("--pool-size", type=_size_arg, default=parse_size("1GiB"))
    p.add_argument("--block-size", type=_size_arg, default=parse_size("256KiB"))
    p.add_argument(
        "--transport",
        choices=["tcp", "rdma", "auto"],
        default="auto",
        help="auto (default): RDMA too when a usable device exists; tcp always serves",
    )
    p.add_argument("--lease-timeout", type=float, default=30.0, help="seconds a read lease lasts")
    p.add_argument("--token-file", help="file holding the shared-secret token clients must send")
    p.add_argument("--no-lock", action="store_true", help="do not mlock the pool")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "stats", help="print a node's or a cluster's statistics as JSON (per node and total)"
    )
    p.add_argument(
        "address", metavar="NODES", help="HOST:PORT, a list a:7480,b:7480, or dns://NAME:PORT"
    )
    p.add_argument("--token-file")
    p.add_argument("--timeout", type=float, default=5.0)
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser(
        "demo", help="put/get a generated KV workload through L1 and a local node"
    )
    p.add_argument("--requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--l1-mib", type=int, default=32, help="L1 capacity in MiB")
    p.add_argument("--policy", choices=["lru", "fifo", "s3fifo"], default="s3fifo")
    p.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        default="reuse",
        help="which computed blocks go to the node (docs/offload.md); default reuse",
    )
    p.add_argument(
        "--offload-budget",
        type=float,
        help="with --offload reuse: share of the bytes 'all' would send, in (0, 1] "
        "(default 1: everything)",
    )
    p.add_argument("--transport", choices=["tcp", "rdma", "auto"], default="auto")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--local-nodes",
        type=int,
        default=1,
        help="start this many local nodes and shard over them (default 1)",
    )
    where.add_argument(
        "--nodes",
        metavar="NODES",
        help="use running nodes instead: HOST:PORT, a list a:7480,b:7480, or dns://NAME:PORT",
    )
    p.add_argument("--token-file", help="with --nodes: the nodes' shared-secret token")
    p.add_argument(
        "--replication", type=int, default=1, help="copies of each block in a cluster (default 1)"
    )
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("doctor", help="check this machine's RDMA set-up and say how to fix it")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser(
        "bench",
        help="move the same blocks through rdmakv, its peers and a plain socket loop; "
        "verify every byte; write JSON and plots (bench/README.md)",
    )
    p.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--quick", action="store_true", help="tiny run (CI): 64 blocks, 2 sizes")
    p.add_argument("--json", action="store_true", help="print the JSON object on stdout")
    p.add_argument(
        "--systems",
        help="comma-separated systems (default tcp: rdmakv,socket_loop,redis,mooncake_te; "
        "rdma: rdmakv,perftest,infinistore,mooncake_te)",
    )
    p.add_argument("--sizes", help="comma-separated block sizes (default 16KiB,64KiB,256KiB,1MiB)")
    p.add_argument("--repeats", type=int, help="best of this many runs (default 3; quick 1)")
    p.add_argument("--blocks", type=int, help="blocks per size (default min(1000, 256MiB/size))")
    p.add_argument("--name", help="output name (default peers_TRANSPORT)")
    p.add_argument(
        "--out", type=Path, help="output directory (default bench/results; --quick: none)"
    )
    p.add_argument("--no-latency", action="store_true", help="skip the latency section")
    p.add_argument("--no-concurrency", action="store_true", help="skip the concurrency section")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from rdmakv.bench import runner

    def _list(text: str | None) -> list[str] | None:
        return [t.strip() for t in text.split(",") if t.strip()] if text else None

    sizes = _list(args.sizes)
    cfg = runner.BenchConfig(
        transport=args.transport,
        quick=args.quick,
        systems=_list(args.systems),
        sizes=[parse_size(s) for s in sizes] if sizes else None,
        repeats=args.repeats,
        blocks=args.blocks,
        name=args.name,
        out=args.out,
        progress=not args.no_progress,
        latency=not args.no_latency,
        concurrency=not args.no_concurrency,
    )
    return runner.main(cfg, as_json=args.json)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rdmakv.doctor import main as doctor_main

    return doctor_main(as_json=args.json)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        stream=sys.stderr,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        rc: int = args.func(args)
    except RdmakvError as e:
        print(f"rdmakv {args.command}: error: {e}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
