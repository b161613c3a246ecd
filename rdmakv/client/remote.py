"""The remote tier behind a manager, named by one address string.

Engines and operators name where KV lives with one string, the same in
``KVCacheManager(node=...)``, the connectors' ``node`` option and
``rdmakv demo --nodes``:

========================== ==========================================================
``host:port``              one ``rdmakv serve`` (:class:`~rdmakv.client.node_client.KVClient`; two
                           connections over RDMA, :mod:`rdmakv.client.streams`)
``a:7480,b:7480``          a cluster of nodes, keys sharded by rendezvous hashing
``dns://name:7480``        a cluster whose members are the A records of ``name``
                           (a Kubernetes headless Service), re-resolved periodically
``infinistore://host:port`` an InfiniStore server (:mod:`rdmakv.client.tiers.infinistore_tier`)
========================== ==========================================================

Every one of them is a :class:`~rdmakv.client.node_client.NodeClient`: the manager does
not know which it holds.
"""

from __future__ import annotations

from rdmakv.blocks.slab import Slab
from rdmakv.client.cluster import StaticMembership, parse_members, split_node_id
from rdmakv.client.cluster.cluster_client import ClusterClient
from rdmakv.client.node_client import NodeClient
from rdmakv.client.streams import check_streams, open_node
from rdmakv.client.tiers import infinistore_tier as infinistore
from rdmakv.defaults import DEFAULT_REPLICATION, DEFAULT_TIMEOUT
from rdmakv.errors import ConfigError

REMOTE_FORMS = (
    "HOST:PORT, a comma-separated list of HOST:PORT, dns://NAME:PORT, or infinistore://HOST:PORT"
)


def check_address(spec: str, *, streams: int | None = None) -> None:
    """ConfigError naming what is wrong with ``spec`` (or with ``streams`` for
    it), before anything connects. ``streams`` None is the per-transport
    default, which a cluster or an InfiniStore server ignores."""
    check_streams(streams)
    if isinstance(spec, str) and spec.startswith(infinistore.SCHEME):
        infinistore.parse_address(spec)
        one_node = False
    else:
        membership = parse_members(spec)
        one_node = isinstance(membership, StaticMembership) and len(membership.resolve()) == 1
    if streams not in (None, 1) and not one_node:
        # a cluster already moves each node's share of a batch at once
        raise ConfigError(f"streams > 1 applies to one rdmakv node, not {spec!r}")


def open_remote(
    spec: str,
    slab: Slab | None,
    *,
    token: bytes | str | None = None,
    transport: str = "auto",
    timeout: float = DEFAULT_TIMEOUT,
    replication: int = DEFAULT_REPLICATION,
    streams: int | None = None,
) -> NodeClient:
    """Connect to the remote tier ``spec`` names (module docstring) over ``slab``.

    One node is a :class:`KVClient`, or a
    :class:`~rdmakv.client.streams.MultiStreamClient` over several connections (it
    raises ConnectionLost when the node is unreachable: a wrong address should
    be loud); several are a
    :class:`ClusterClient`, which starts as long as one member answers; an
    InfiniStore server is an :class:`~rdmakv.client.tiers.infinistore_tier.InfiniStoreTier`
    (its transport is always RDMA). ``replication`` > 1 needs a cluster;
    ``streams`` > 1 connections per node (:mod:`rdmakv.client.streams`) needs one node;
    None (the default) is, for one node, 2 over RDMA and over TCP 2 on a host
    of 2 usable CPUs or more, else 1 (:func:`~rdmakv.client.streams.default_streams`);
    1 per node in a cluster.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"remote address must be {REMOTE_FORMS}, got {spec!r}")
    check_address(spec, streams=streams)
    if spec.startswith(infinistore.SCHEME):
        if replication != DEFAULT_REPLICATION:
            raise ConfigError(f"replication applies to clusters of rdmakv nodes, not {spec!r}")
        host, port = infinistore.parse_address(spec)
        return infinistore.InfiniStoreTier(host, port, slab, timeout=timeout)
    membership = parse_members(spec)
    if isinstance(membership, StaticMembership) and len(membership.resolve()) == 1:
        if replication != DEFAULT_REPLICATION:
            raise ConfigError(
                f"replication {replication} needs a cluster of at least that many nodes, "
                f"got one node {spec!r}"
            )
        host, port = split_node_id(membership.resolve()[0])
        return open_node(
            host, port, slab, streams=streams, token=token, transport=transport, timeout=timeout
        )
    return ClusterClient(
        membership,
        slab,
        token=token,
        transport=transport,
        timeout=timeout,
        replication=replication,
    )


__all__ = ["REMOTE_FORMS", "check_address", "open_remote"]
