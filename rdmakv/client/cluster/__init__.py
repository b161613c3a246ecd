"""Many KV nodes behind one client: rendezvous sharding, membership, node loss as misses.

* :mod:`~rdmakv.client.cluster.rendezvous` -- where a key lives (highest-random-weight hashing).
* :mod:`~rdmakv.client.cluster.membership` -- which nodes exist (static list or DNS).
* :mod:`~rdmakv.client.cluster.health` -- when a failed node is tried again (backoff).
* :mod:`~rdmakv.client.cluster.cluster_client` -- :class:`ClusterClient`, KVClient's API
  over them all.
"""

from rdmakv.client.cluster.cluster_client import COUNTERS, ClusterClient
from rdmakv.client.cluster.health import NodeHealth
from rdmakv.client.cluster.membership import (
    DnsMembership,
    Membership,
    StaticMembership,
    format_node_id,
    parse_members,
    split_node_id,
)
from rdmakv.client.cluster.rendezvous import Rendezvous, weight
from rdmakv.client.node_client import NodeClient

__all__ = [
    "COUNTERS",
    "ClusterClient",
    "DnsMembership",
    "Membership",
    "NodeClient",
    "NodeHealth",
    "Rendezvous",
    "StaticMembership",
    "format_node_id",
    "parse_members",
    "split_node_id",
    "weight",
]
