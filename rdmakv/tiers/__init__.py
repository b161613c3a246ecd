"""Remote tiers other than rdmakv's own node, behind the same
:class:`~rdmakv.client.NodeClient` API (:mod:`rdmakv.remote` picks one by address).

* :mod:`~rdmakv.tiers.infinistore` -- an InfiniStore server (``infinistore://host:port``).
"""
