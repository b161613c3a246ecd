"""The client side: reaching the remote tier from one process.

* :mod:`rdmakv.client.node_client` -- :class:`~rdmakv.client.node_client.KVClient`,
  one node over one connection (connection handling, argument checks; the put/get
  strategy is its transport's);
* :mod:`rdmakv.client.streams` -- several connections to one node, a big batch
  split across them;
* :mod:`rdmakv.client.cluster` -- many nodes behind one client (rendezvous
  sharding, membership, node loss as misses);
* :mod:`rdmakv.client.tiers` -- stores other than an rdmakv node (InfiniStore)
  behind the same API;
* :mod:`rdmakv.client.remote` -- one address string to the right one of these.
"""
