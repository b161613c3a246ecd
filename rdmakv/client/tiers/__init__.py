"""Remote tiers other than rdmakv's own node, behind the same
:class:`~rdmakv.client.node_client.NodeClient` API (:mod:`rdmakv.client.remote` picks one
by address).

* :mod:`~rdmakv.client.tiers.infinistore_tier` -- an InfiniStore server (``infinistore://host:port``).
"""
