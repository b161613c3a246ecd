"""Cluster membership: which KV nodes exist, from what operators already run.

No consensus of our own: membership is either a static list of ``host:port``
or the A records of a DNS name (a Kubernetes headless Service in front of a
StatefulSet: every ready pod is one record), re-resolved periodically by the
:class:`~rdmakv.client.cluster.cluster_client.ClusterClient`.

Node ids are ``"host:port"`` strings (``"[v6addr]:port"`` for IPv6 literals);
they name a node in logs and stats and seed its rendezvous weight, so every
client must spell a node the same way (a DNS membership always yields the
resolved addresses, never the name).

A :class:`Membership` only answers :meth:`~Membership.resolve`; it keeps no
connection state. ``resolve`` may block (DNS), so the cluster client calls it
off the data path.

Spec strings (:func:`parse_members`, also what ``--nodes`` takes)::

    host:port                 one node
    a:7480,b:7480,[::1]:7480  a static list (spaces around commas are ignored)
    dns://name:port           every A record of ``name`` is a node on ``port``,
                              re-resolved every ``refresh_s`` seconds
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from rdmakv.errors import ConfigError, ConnectionLost

DNS_SCHEME = "dns://"
DEFAULT_DNS_REFRESH_S = 10.0
"""How often a DNS membership is re-resolved (seconds): Kubernetes updates a
headless Service's records within seconds of a pod becoming ready or going."""
MIN_DNS_REFRESH_S = 0.05
MAX_PORT = 65535
_SPEC_FORMS = "HOST:PORT, a comma-separated list of HOST:PORT, or dns://NAME:PORT"

Resolver = Callable[..., Sequence[tuple[Any, ...]]]
"""A :func:`socket.getaddrinfo`-like callable. It is called as
``resolve(name, port, family, socket.SOCK_STREAM)`` and returns
``(family, type, proto, canonname, sockaddr)`` tuples; ``sockaddr[0]`` is the
address. It may raise :class:`OSError` (e.g. ``socket.gaierror``)."""


@runtime_checkable
class Membership(Protocol):
    """Where the node list comes from."""

    @property
    def refresh_s(self) -> float | None:
        """Seconds between re-resolutions; None when the list never changes."""
        ...

    def resolve(self) -> tuple[str, ...]:
        """The current node ids, sorted and duplicate-free, never empty.

        May block (DNS). Raises :class:`~rdmakv.errors.ConnectionLost` when the
        list cannot be had (the name does not resolve, or has no records).
        """
        ...

    def describe(self) -> str:
        """Human-readable source, for logs and errors."""
        ...


def format_node_id(host: str, port: int) -> str:
    """``host:port``; an IPv6 literal is bracketed (``[::1]:7480``)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def split_node_id(node_id: str) -> tuple[str, int]:
    """``(host, port)`` of ``"host:port"`` / ``"[v6]:port"``; ConfigError naming what is wrong."""
    text = node_id.strip()
    if not text:
        raise ConfigError(f"empty node address; expected {_SPEC_FORMS}")
    if "://" in text:
        raise ConfigError(f"node address {node_id!r}: a URL scheme is only allowed alone "
                          f"(dns://NAME:PORT), not inside a list")
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise ConfigError(f"node address {node_id!r} has no port; expected HOST:PORT")
    if host.startswith("["):
        if not host.endswith("]") or len(host) < 3:
            raise ConfigError(f"node address {node_id!r}: unbalanced [ ] around an IPv6 address")
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(
            f"node address {node_id!r}: write an IPv6 address in brackets, e.g. [::1]:7480"
        )
    if not host:
        raise ConfigError(f"node address {node_id!r} has no host; expected HOST:PORT")
    if any(c.isspace() or c in "/@?#," for c in host):
        raise ConfigError(f"node address {node_id!r}: host {host!r} is not a host name")
    if not port_text.isdigit():
        raise ConfigError(f"node address {node_id!r}: port {port_text!r} is not a number")
    port = int(port_text)
    if not 1 <= port <= MAX_PORT:
        raise ConfigError(f"node address {node_id!r}: port {port} outside 1..{MAX_PORT}")
    return host, port


class StaticMembership:
    """A fixed list of nodes (``--nodes a:7480,b:7480``)."""

    refresh_s: float | None = None

    def __init__(self, nodes: Iterable[str]) -> None:
        ids: list[str] = []
        for spec in nodes:
            ids.append(format_node_id(*split_node_id(spec)))
        if not ids:
            raise ConfigError(f"no nodes given; expected {_SPEC_FORMS}")
        dup = sorted({n for n in ids if ids.count(n) > 1})
        if dup:
            raise ConfigError(f"node {dup[0]} is listed more than once")
        self.nodes: tuple[str, ...] = tuple(sorted(ids))

    def resolve(self) -> tuple[str, ...]:
        return self.nodes

    def describe(self) -> str:
        return ",".join(self.nodes)

    def __repr__(self) -> str:
        return f"StaticMembership({list(self.nodes)})"


class DnsMembership:
    """Every address record of ``name`` is a node listening on ``port``.

    ``family`` is ``socket.AF_INET`` (A records) by default; a dual-stack
    Service would otherwise list each pod twice. ``resolve`` is injectable
    for tests (a fake resolver; the nodes stay real).
    """

    def __init__(
        self,
        name: str,
        port: int,
        *,
        resolve: Resolver = socket.getaddrinfo,
        refresh_s: float = DEFAULT_DNS_REFRESH_S,
        family: int = socket.AF_INET,
    ) -> None:
        if not name or any(c.isspace() or c in "/@?#,:[]" for c in name):
            raise ConfigError(f"DNS membership: {name!r} is not a DNS name")
        if not 1 <= port <= MAX_PORT:
            raise ConfigError(f"DNS membership: port {port} outside 1..{MAX_PORT}")
        if not refresh_s >= MIN_DNS_REFRESH_S:
            raise ConfigError(
                f"DNS membership: refresh_s must be >= {MIN_DNS_REFRESH_S}, got {refresh_s}"
            )
        self.name = name
        self.port = port
        self.family = family
        self._resolve = resolve
        self._refresh_s = float(refresh_s)

    @property
    def refresh_s(self) -> float | None:
        return self._refresh_s

    def resolve(self) -> tuple[str, ...]:
        try:
            answers = self._resolve(self.name, self.port, self.family, socket.SOCK_STREAM)
        except OSError as e:
            raise ConnectionLost(f"cannot resolve cluster name {self.name!r}: {e}") from e
        hosts = {str(ans[4][0]) for ans in answers}
        if not hosts:
            raise ConnectionLost(f"cluster name {self.name!r} resolved to no addresses")
        return tuple(sorted(format_node_id(h, self.port) for h in hosts))

    def describe(self) -> str:
        return f"{DNS_SCHEME}{self.name}:{self.port}"

    def __repr__(self) -> str:
        return f"DnsMembership({self.describe()!r}, refresh_s={self._refresh_s})"


def parse_members(
    spec: str | Sequence[str],
    *,
    resolve: Resolver = socket.getaddrinfo,
    refresh_s: float = DEFAULT_DNS_REFRESH_S,
) -> Membership:
    """A :class:`Membership` from a spec string or a list of ``host:port``.

    ``"host:port"`` and ``"a:1,b:2"`` give a :class:`StaticMembership`;
    ``"dns://name:port"`` gives a :class:`DnsMembership` (``resolve`` and
    ``refresh_s`` apply to it only). Raises ConfigError saying what is wrong.
    """
    if not isinstance(spec, str):
        return StaticMembership(spec)
    text = spec.strip()
    if not text:
        raise ConfigError(f"empty cluster spec; expected {_SPEC_FORMS}")
    scheme, sep, rest = text.partition("://")
    if sep and "," in scheme:
        raise ConfigError(f"cluster spec {spec!r}: a URL scheme is only allowed alone "
                          f"(dns://NAME:PORT), not inside a list")
    if sep:
        if scheme.lower() + "://" != DNS_SCHEME:
            raise ConfigError(
                f"cluster spec {spec!r}: unknown scheme {scheme + '://'!r}; expected {_SPEC_FORMS}"
            )
        if "," in rest:
            raise ConfigError(f"cluster spec {spec!r}: dns:// names one DNS name, not a list")
        if ":" not in rest:
            raise ConfigError(f"cluster spec {spec!r}: dns:// needs a port (dns://NAME:PORT)")
        name, port = split_node_id(rest)
        return DnsMembership(name, port, resolve=resolve, refresh_s=refresh_s)
    parts = [p.strip() for p in text.split(",")]
    if "" in parts:
        raise ConfigError(f"cluster spec {spec!r} has an empty entry (stray comma?)")
    return StaticMembership(parts)
