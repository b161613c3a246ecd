"""Many KV nodes behind one client: rendezvous sharding, membership, node loss as misses.

* :mod:`~rdmakv.cluster.rendezvous` -- where a key lives (highest-random-weight hashing).
* :mod:`~rdmakv.cluster.membership` -- which nodes exist (static list or DNS).
* :mod:`~rdmakv.cluster.health` -- when a failed node is tried again (backoff).
* :mod:`~rdmakv.cluster.client` -- :class:`ClusterClient`, KVClient's API over them all.
"""

from rdmakv.client import NodeClient
from rdmakv.cluster.client import COUNTERS, ClusterClient
from rdmakv.cluster.health import NodeHealth
from rdmakv.cluster.membership import (
    DnsMembership,
    Membership,
    StaticMembership,
    format_node_id,
    parse_members,
    split_node_id,
)
from rdmakv.cluster.rendezvous import Rendezvous, weight

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
