"""What a KV block is, for every side: the memory blocks live in and the names they go by.

* :mod:`rdmakv.blocks.slab` -- :class:`~rdmakv.blocks.slab.Slab`, the pinned
  arena of fixed-size blocks, registered once with the NIC (the engine's L1 and
  the node's pool are both slabs);
* :mod:`rdmakv.blocks.keys` -- block keys (chained prefix hashes) and value digests;
* :mod:`rdmakv.blocks.synthetic_kv` -- deterministic block bytes derived from a
  key, so a demo or a replay can check every block it reads.

The transports, the node, the client and the engine all use these, so they sit
below all of them and import only the wire.
"""
