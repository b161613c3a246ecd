"""The ``rdmakv`` command line: ``serve`` (a KV node), ``stats NODES`` (a node or a cluster),
``demo``, ``doctor``, ``bench`` (rdmakv side by side with its peers).

Settings come from, highest first: a command-line flag, an ``RDMAKV_<SECTION>_<KEY>``
environment variable, the YAML file (``--config`` or ``RDMAKV_CONFIG``), the
defaults (:mod:`rdmakv.config`, docs/config.md). Flags of ``serve`` therefore
default to None and are filled from the loaded config.

Start-up failures are one line on stderr (``rdmakv CMD: error: CAUSE: FIX``)
and exit status 2, never a traceback: each one is caught where it arises, as
the specific exception it is, and turned into a :class:`StartupError`. An
exception nobody expected keeps its traceback (it is a bug to fix, not a
set-up problem to explain).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import gc
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel

from rdmakv.config import (
    CONFIG_ENV,
    ClientConfig,
    RdmakvConfig,
    default_text,
    env_var,
    format_size,
    load_config,
    parse_size,
)
from rdmakv.engine.l1.offload_policies import OFFLOAD_MODES
from rdmakv.errors import (
    ConfigError,
    MemoryLockWarning,
    RdmaError,
    RdmakvError,
    RdmaUnavailable,
    TransportError,
)
from rdmakv.logformat import LOG_FORMATS, JsonFormatter, configure_logging

if TYPE_CHECKING:
    from rdmakv.node import KVNode

log = logging.getLogger("rdmakv.cli")

EXIT_FAILURE = 2
"""Exit status of every start-up failure (and of argparse's usage errors)."""
_LOG_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class StartupError(RdmakvError):
    """A command could not start; the message names the cause and the fix."""


# -- argument types --------------------------------------------------------------------------


def _size_arg(text: str) -> int:
    try:
        return parse_size(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _port_arg(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"port must be an integer, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port


def _seconds_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors (no usage block): the same shape as every other failure."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_FAILURE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- settings --------------------------------------------------------------------------------


def _fill_from(args: argparse.Namespace, section: BaseModel, keys: Mapping[str, str]) -> None:
    """Each flag ``dest`` left unset (None) takes ``section.<key>`` (env > file > default)."""
    for dest, key in keys.items():
        if getattr(args, dest) is None:
            setattr(args, dest, getattr(section, key))


def _client_value(cli: Any, client: ClientConfig, key: str, default: Any) -> Any:
    """A flag given wins; then a ``client`` key the file or environment set; then
    the command's own default (``rdmakv demo``'s differ from the connectors')."""
    if cli is not None:
        return cli
    if key in client.model_fields_set:
        return getattr(client, key)
    return default


def _setting(flag: str, section: str, key: str) -> str:
    """How a user sets it, for fix-it hints: ``--port / node.port / RDMAKV_NODE_PORT``."""
    return f"{flag} / {section}.{key} / {env_var(section, key)}"


def _read_token(path: str | None, where: str) -> bytes | None:
    if path is None:
        return None
    fix = (
        f"create it holding the shared secret (e.g. `openssl rand -hex 32 > {path}`) or fix {where}"
    )
    try:
        token = Path(path).read_bytes().strip()
    except OSError as e:
        raise StartupError(f"cannot read token file {path!r}: {e.strerror or e}: {fix}") from None
    if not token:
        raise StartupError(f"token file {path!r} is empty: {fix}")
    return token


# -- serve -----------------------------------------------------------------------------------

_SERVE_KEYS = {
    "host": "host",
    "port": "port",
    "pool_size": "pool_size",
    "block_size": "block_size",
    "transport": "transport",
    "lease_timeout": "lease_timeout_s",
    "token_file": "token_file",
    "lock": "lock_pool",
    "metrics_host": "metrics_host",
    "metrics_port": "metrics_port",
}
"""``rdmakv serve`` flag dest -> ``node`` key. Every other ``node`` key is passed to
:class:`~rdmakv.node.KVNode` as the keyword of the same name, so a node setting
added to the schema (and to KVNode) needs no change here."""


def _memory_ceiling() -> tuple[int, str] | None:
    """The most memory this process can ever get, and what sets it (None: unknown).

    Only hard walls: the machine's RAM and a cgroup limit. (The pool is mapped
    with MAP_POPULATE, so a pool past them gets the process OOM-killed without
    a word, or mmap fails.)
    """
    walls: list[tuple[int, str]] = []
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                walls.append((int(line.split()[1]) * 1024, "this machine's RAM"))
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            text = Path(path).read_text().strip()
            if text != "max" and int(text) < 1 << 60:  # v1 says "no limit" with a huge number
                walls.append((int(text), f"the container's memory limit ({path})"))
    return min(walls) if walls else None


def _approx_size(nbytes: int) -> str:
    """``24683656 KiB`` -> ``"23.5GiB"`` (for messages; exact sizes use format_size)."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= factor:
            return f"{nbytes / factor:.1f}{unit}"
    return f"{nbytes}B"


def _pool_too_big(size: int, why: str) -> StartupError:
    return StartupError(
        f"cannot allocate a {format_size(size)} pool: {why}: use a smaller "
        f"{_setting('--pool-size', 'node', 'pool_size')}"
    )


def _bind_error(e: OSError, host: str, port: int, section_key: tuple[str, str]) -> StartupError:
    """The one-line cause and fix of a failed listen on ``host:port``; ``section_key``
    names the port setting (``node.port`` or ``node.metrics_port``) for the hint."""
    port_key = section_key[1]
    where = f"{host}:{port}" if port_key == "port" else f"metrics address {host}:{port}"
    host_key = port_key.replace("port", "host")
    port_setting = _setting("--" + port_key.replace("_", "-"), section_key[0], port_key)
    host_setting = _setting("--" + host_key.replace("_", "-"), section_key[0], host_key)
    if e.errno == errno.EADDRINUSE:
        return StartupError(
            f"{where} is already in use (another rdmakv serve or another program listens "
            f"there): pick another {port_setting} (0: any free port) or stop the process "
            f"holding it (`ss -ltnp 'sport = :{port}'` shows it)"
        )
    if e.errno == errno.EADDRNOTAVAIL:
        return StartupError(
            f"cannot listen on {where}: {host} is not an address of this machine: give one "
            f"of its addresses, 0.0.0.0 for every interface or 127.0.0.1 ({host_setting})"
        )
    if e.errno in (errno.EACCES, errno.EPERM):
        return StartupError(
            f"cannot listen on {where}: permission denied (ports below 1024 need root or "
            f"CAP_NET_BIND_SERVICE): use a port >= 1024 ({port_setting}) or grant the capability"
        )
    if isinstance(e, socket.gaierror):
        return StartupError(
            f"cannot listen on {where}: host name {host!r} does not resolve ({e.strerror}): "
            f"give an IP address or a name this machine resolves ({host_setting})"
        )
    return StartupError(f"cannot listen on {where}: {e.strerror or e}")


def _check_listenable(host: str, port: int, section_key: tuple[str, str]) -> None:
    """Fail fast when ``host:port`` cannot be listened on: before the pool is pinned and
    registered, which takes minutes for a large one. (The node binds again for real; a
    port taken in between still fails there, with the same message.)"""
    try:
        socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        # create_server as the node and the metrics server bind: SO_REUSEADDR, IPv4.
        with socket.create_server((host, port)):
            pass
    except OSError as e:
        raise _bind_error(e, host, port, section_key) from None


def _cmd_serve(args: argparse.Namespace) -> int:
    from rdmakv.node import KVNode
    from rdmakv.node.admission import SessionLimits

    cfg: RdmakvConfig = args.config_values
    _fill_from(args, cfg.node, _SERVE_KEYS)
    # The token first: a bad token file fails before the pool is pinned.
    token = _read_token(args.token_file, _setting("--token-file", "node", "token_file"))
    ceiling = _memory_ceiling()
    if ceiling is not None and args.pool_size > ceiling[0]:
        raise _pool_too_big(
            args.pool_size, f"it is more than {ceiling[1]} ({_approx_size(ceiling[0])})"
        )
    if args.block_size > args.pool_size:
        raise StartupError(
            f"block size {format_size(args.block_size)} is larger than the slab capacity "
            f"(pool size) {format_size(args.pool_size)}: use a smaller "
            f"{_setting('--block-size', 'node', 'block_size')} or a larger --pool-size"
        )
    _check_listenable(args.host, args.port, ("node", "port"))
    if args.metrics_port is not None:
        _check_listenable(args.metrics_host, args.metrics_port, ("node", "metrics_port"))
    # Every other node key is a KVNode keyword of the same name, except the
    # connection limits, which travel together as one SessionLimits.
    limit_keys = {f.name for f in dataclasses.fields(SessionLimits)}
    by_name: dict[str, Any] = {
        key: getattr(cfg.node, key)
        for key in type(cfg.node).model_fields
        if key not in _SERVE_KEYS.values() and key not in limit_keys
    }
    by_name["session_limits"] = SessionLimits(**{k: getattr(cfg.node, k) for k in limit_keys})
    transports = [args.transport]
    if args.transport == "auto":
        from rdmakv.transport import available_transports

        transports = available_transports()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MemoryLockWarning)
            node = KVNode(
                host=args.host,
                port=args.port,
                pool_size=args.pool_size,
                block_size=args.block_size,
                transports=transports,
                lease_timeout=args.lease_timeout,
                token=token,
                lock_pool=args.lock,
                optional_transports=args.transport == "auto",
                metrics_host=args.metrics_host,
                metrics_port=args.metrics_port,
                **by_name,
            )
    except OSError as e:
        if e.errno == errno.ENOMEM:  # mmap of the pool
            raise _pool_too_big(args.pool_size, "not enough memory") from None
        raise
    except RdmaUnavailable as e:
        raise StartupError(
            f"--transport rdma: {e}: run `rdmakv doctor`, or serve over TCP "
            f"(--transport tcp, or auto: RDMA only where a device is usable)"
        ) from None
    except RdmaError as e:
        raise StartupError(
            f"--transport rdma: {e}: run `rdmakv doctor`; the pinned pool must fit the "
            f"memlock limit (`ulimit -l`, LimitMEMLOCK in systemd); or use --transport tcp"
        ) from None
    for w in caught:
        if issubclass(w.category, MemoryLockWarning):
            log.warning("%s Or start with --no-lock (node.lock_pool: false).", w.message)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    try:
        host, port = node.start()
    except OSError as e:
        raise _bind_error(e, args.host, args.port, ("node", "port")) from None
    if node.token is None and not _is_loopback(host):
        log.warning(
            "serving on %s without a token: anyone who can reach this port can read and "
            "overwrite cached KV (use --token-file)",
            host,
        )

    def _on_signal(signum: int, _frame: object) -> None:
        logging.getLogger("rdmakv.node").info("signal %d: shutting down", signum)
        node.stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    if args.exit_on_stdin_close:
        _stop_when_stdin_closes(node)
    # The one line on stdout: tests and scripts wait for it.
    metrics = "" if node.metrics_server is None else f" metrics={node.metrics_server.url}"
    print(
        f"rdmakv node ready on {host}:{port} transports={','.join(node.transports)} "
        f"pool={node.pool.nbytes} block={node.pool.block_size}{metrics}",
        flush=True,
    )
    # What start-up built lives as long as the process, the index's key map
    # among it (it grows, but holds only bytes and ints): the cyclic collector
    # need never walk it again. At 190k keys under churn this cut the longest
    # full collection -- every session waits it out -- from 40 ms to 2.4 ms.
    gc.freeze()
    node.serve_forever()
    return 0


def _stop_when_stdin_closes(node: KVNode) -> None:
    """Stop ``node`` (as SIGTERM does) once stdin reaches end of file.

    Why: a node that a bench, a test or a supervisor script starts should not
    outlive it. When that process dies without stopping the node (SIGKILL, a
    crash), the kernel closes its end of the pipe on the node's stdin, and
    this thread's read returns. Unlike a parent-death signal (which fires when
    the forking *thread* exits) or polling the parent pid, nothing is missed
    and nothing is woken until then. With stdin not a pipe (``/dev/null``)
    the node would stop at once: :class:`~rdmakv.node.process.LocalNodeProcess`
    passes a pipe."""

    def watch() -> None:
        with contextlib.suppress(OSError, ValueError):
            while os.read(sys.stdin.fileno(), 4096):
                pass  # nothing is ever sent: only the end of file matters
        logging.getLogger("rdmakv.node").info(
            "stdin closed (--exit-on-stdin-close: whoever started this node is gone): "
            "shutting down"
        )
        node.stop()

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # not numeric: getsockname always is, so be careful and warn
        return False


# -- stats / demo ----------------------------------------------------------------------------


def _unreachable(e: TransportError, nodes: str, where: str) -> StartupError:
    return StartupError(
        f"{e}: is `rdmakv serve` running at {nodes}? check the address ({where}) and that "
        "its port is reachable from here"
    )


def _cmd_stats(args: argparse.Namespace) -> int:
    from rdmakv.client.remote import open_remote

    client: ClientConfig = args.config_values.client
    where = f"NODES / client.nodes / {env_var('client', 'nodes')}"
    nodes = _client_value(args.address, client, "nodes", None)
    if not nodes:
        raise StartupError(
            f"no nodes to ask: give NODES (HOST:PORT, a:7480,b:7480 or dns://NAME:PORT), "
            f"client.nodes in --config, or {env_var('client', 'nodes')}"
        )
    token_file = _client_value(args.token_file, client, "token_file", None)
    token = _read_token(token_file, _setting("--token-file", "client", "token_file"))
    # A control-only client (no slab): one node's stats, or per node and in
    # total over a cluster (a node that does not answer shows its error).
    try:
        remote = open_remote(
            nodes,
            None,
            token=token,
            transport="tcp",
            timeout=_client_value(args.timeout, client, "timeout_s", client.timeout_s),
        )
    except TransportError as e:
        raise _unreachable(e, nodes, where) from None
    with contextlib.closing(remote) as c:
        print(json.dumps(c.stats(), indent=2, sort_keys=True))
    return 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from rdmakv import demo

    client: ClientConfig = args.config_values.client
    l1_mib = args.l1_mib
    l1_bytes = l1_mib << 20 if l1_mib is not None else None
    if args.local_nodes is not None:  # an explicit --local-nodes beats configured nodes
        nodes = None
    else:
        nodes = _client_value(args.nodes, client, "nodes", None)
    token_file = _client_value(args.token_file, client, "token_file", None)
    cfg = demo.DemoConfig(
        requests=args.requests,
        l1_bytes=_client_value(l1_bytes, client, "l1_size", demo.DemoConfig.l1_bytes),
        policy=args.policy,
        offload=_client_value(args.offload, client, "offload", demo.DemoConfig.offload),
        offload_budget=_client_value(args.offload_budget, client, "offload_budget", None),
        transport=_client_value(args.transport, client, "transport", demo.DemoConfig.transport),
        local_nodes=args.local_nodes or 1,
        nodes=nodes,
        token=_read_token(token_file, _setting("--token-file", "client", "token_file")),
        replication=_client_value(args.replication, client, "replication", 1),
        streams=_client_value(args.streams, client, "streams", None),
        timeout=_client_value(args.timeout, client, "timeout_s", demo.DemoConfig.timeout),
    )
    try:
        return demo.main(cfg, as_json=args.json)
    except TransportError as e:
        if nodes is None:
            raise
        where = f"--nodes / client.nodes / {env_var('client', 'nodes')}"
        raise _unreachable(e, nodes, where) from None


# -- the parser ------------------------------------------------------------------------------


def _global_options(parser: argparse.ArgumentParser, *, default: Any) -> None:
    """``-v`` and ``--log-format``, before or after the command (``default``: SUPPRESS on
    the commands, so a command's parser never overwrites what the top level parsed)."""
    parser.add_argument(
        "-v", "--verbose", action="store_true", default=default, help="debug logging"
    )
    parser.add_argument(
        "--log-format",
        choices=LOG_FORMATS,
        default=default,
        help="text, or json: one JSON object per log record (log.format, RDMAKV_LOG_FORMAT)",
    )


def _config_option(parser: argparse.ArgumentParser, sections: str) -> None:
    parser.add_argument(
        "--config",
        metavar="PATH",
        help=f"YAML config file ({sections}; docs/config.md); default: ${CONFIG_ENV}",
    )


def _node_default(key: str) -> str:
    return default_text("node", key)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="rdmakv", description=__doc__.split("\n\n")[0])
    _global_options(parser, default=None)
    common = _Parser(add_help=False)
    _global_options(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="run a KV node", parents=[common])
    _config_option(p, "its node and log sections")
    p.add_argument("--host", help=f"bind address (default {_node_default('host')})")
    p.add_argument(
        "--port",
        type=_port_arg,
        help=f"TCP port (default {_node_default('port')}; 0 = pick a free one)",
    )
    p.add_argument(
        "--pool-size",
        type=_size_arg,
        help=f"bytes of KV to hold (default {_node_default('pool_size')})",
    )
    p.add_argument(
        "--block-size",
        type=_size_arg,
        help=f"largest value (default {_node_default('block_size')})",
    )
    p.add_argument(
        "--transport",
        choices=["tcp", "rdma", "auto"],
        help="auto (default): RDMA too when a usable device exists; tcp always serves",
    )
    p.add_argument(
        "--lease-timeout",
        type=_seconds_arg,
        help=f"seconds a read lease lasts (default {_node_default('lease_timeout_s')})",
    )
    p.add_argument("--token-file", help="file holding the shared-secret token clients must send")
    p.add_argument(
        "--lock",
        action=argparse.BooleanOptionalAction,
        help="mlock the pool (default; --no-lock: do not)",
    )
    p.add_argument(
        "--exit-on-stdin-close",
        action="store_true",
        help="stop (as on SIGTERM) when stdin reaches end of file: a script that starts the "
        "node with a pipe on its stdin takes it down by exiting, even when killed",
    )
    p.add_argument(
        "--metrics-host",
        help=f"address of /metrics, /healthz, /readyz (default {_node_default('metrics_host')})",
    )
    p.add_argument(
        "--metrics-port", type=_port_arg, help="serve /metrics, /healthz, /readyz (default off)"
    )
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser(
        "stats",
        help="print a node's or a cluster's statistics as JSON (per node and total)",
        parents=[common],
    )
    p.add_argument(
        "address",
        nargs="?",
        metavar="NODES",
        help="HOST:PORT, a list a:7480,b:7480, or dns://NAME:PORT (default: client.nodes)",
    )
    _config_option(p, "its client and log sections")
    p.add_argument("--token-file")
    p.add_argument("--timeout", type=_seconds_arg, help="seconds (default 5)")
    p.set_defaults(func=_cmd_stats)

    p = sub.add_parser(
        "demo",
        help="put/get a generated KV workload through L1 and a local node",
        parents=[common],
    )
    _config_option(p, "its client and log sections")
    p.add_argument("--requests", type=int, default=64, help="requests in the workload")
    p.add_argument("--l1-mib", type=int, help="L1 capacity in MiB (default 32)")
    p.add_argument("--policy", choices=["lru", "fifo", "s3fifo"], default="s3fifo")
    p.add_argument(
        "--offload",
        choices=OFFLOAD_MODES,
        help="which computed blocks go to the node (docs/offload.md); default reuse",
    )
    p.add_argument(
        "--offload-budget",
        type=float,
        help="with --offload reuse: share of the bytes 'all' would send, in (0, 1] "
        "(default 1: everything)",
    )
    p.add_argument("--transport", choices=["tcp", "rdma", "auto"], help="default auto")
    where = p.add_mutually_exclusive_group()
    where.add_argument(
        "--local-nodes",
        type=int,
        help="start this many local nodes and shard over them (default 1)",
    )
    where.add_argument(
        "--nodes",
        metavar="NODES",
        help="use running nodes instead: HOST:PORT, a list a:7480,b:7480, or dns://NAME:PORT",
    )
    p.add_argument("--token-file", help="with --nodes: the nodes' shared-secret token")
    p.add_argument("--replication", type=int, help="copies of each block in a cluster (default 1)")
    p.add_argument(
        "--streams", type=int,
        help="connections to one node, big batches split (default 2 over RDMA; over TCP 2 "
        "with 2 usable CPUs or more, else 1)",
    )
    p.add_argument("--timeout", type=_seconds_arg, help="seconds per remote wait (default 5)")
    p.add_argument("--json", action="store_true", help="also print the summary as JSON")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser(
        "doctor", help="check this machine's RDMA set-up and say how to fix it", parents=[common]
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--tune", action="store_true",
        help="instead, time the TCP send plans on this host once (about a second) and "
        "print the tcp.send_plan line to put in the rdmakv config",
    )
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser(
        "bench",
        help="move the same blocks through rdmakv, its peers and a plain socket loop; "
        "verify every byte; write JSON and plots (bench/README.md)",
        parents=[common],
    )
    p.add_argument("--transport", choices=["tcp", "rdma"], default="tcp")
    p.add_argument("--quick", action="store_true", help="tiny run (CI): 64 blocks, 2 sizes")
    p.add_argument("--json", action="store_true", help="print the JSON object on stdout")
    p.add_argument(
        "--systems",
        help="comma-separated systems (default tcp: rdmakv,rdmakv_streamsN,socket_loop,redis,"
        "mooncake_te; rdma: rdmakv,rdmakv_streams1,perftest,perftest_q2,infinistore,"
        "mooncake_te; rdmakv_streamsN: the stream count that is not rdmakv's default here, "
        "streams1 on a host of 2 usable CPUs or more, streams2 on one)",
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
    p.add_argument(
        "--no-warm-up", action="store_true",
        help="time each repeat's first transfer on its new connections (default: "
        "untimed puts and gets of the same batch first: over TCP up to 1 GiB each way in "
        "at most 16 rounds, over RDMA one round; as an engine's connections are warm)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_bench)
    return parser


def _cmd_bench(args: argparse.Namespace) -> int:
    from rdmakv.perf import command
    from rdmakv.perf.settings import BenchConfig

    def _list(text: str | None) -> list[str] | None:
        return [t.strip() for t in text.split(",") if t.strip()] if text else None

    sizes = _list(args.sizes)
    cfg = BenchConfig(
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
        warm_up=not args.no_warm_up,
    )
    return command.main(cfg, as_json=args.json)


def _cmd_doctor(args: argparse.Namespace) -> int:
    from rdmakv.doctor import main as doctor_main
    from rdmakv.doctor import tune_main

    return tune_main(as_json=args.json) if args.tune else doctor_main(as_json=args.json)


# -- main ------------------------------------------------------------------------------------


def _fail(command: str, error: BaseException, log_format: str) -> int:
    """Report a start-up failure as one line (a JSON record with ``--log-format json``)."""
    text = " ".join(part.strip() for part in str(error).splitlines() if part.strip())
    line = f"rdmakv {command}: error: {text}"
    if log_format == "json":
        record = logging.LogRecord("rdmakv.cli", logging.ERROR, __file__, 0, line, None, None)
        line = JsonFormatter().format(record)
    print(line, file=sys.stderr, flush=True)
    return EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Until the config is loaded, only the flag and the raw variable say "json".
    log_format: str = args.log_format or (
        "json" if os.environ.get(env_var("log", "format")) == "json" else "text"
    )
    try:
        config = load_config(getattr(args, "config", None))
    except ConfigError as e:
        return _fail(args.command, e, log_format)
    log_format = args.log_format or config.log.format
    level = logging.DEBUG if args.verbose else _LOG_LEVELS[config.log.level]
    configure_logging(level, log_format)
    args.config_values = config
    from rdmakv.transport.tcp import loop as tcp

    tcp.set_send_plan(config.tcp.send_plan)  # once, before any byte moves
    try:
        rc: int = args.func(args)
    except RdmakvError as e:
        return _fail(args.command, e, log_format)
    return rc


if __name__ == "__main__":
    sys.exit(main())
