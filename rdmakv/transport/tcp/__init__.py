"""The ``tcp`` transport: puts and gets by key over the control connection.

A get needs no addresses: the client sends one GET per sub-batch (keys and
the digests they must be stored with) and the node answers with each hit's
length and checksum followed by the values, which land straight in their
slab blocks -- lookup and read in one round trip, no lease to release (the
node pins the blocks only while it sends them). A put needs none either: the
client sends one PUT per sub-batch (the ALLOC items, the values right behind
them as bulk) and its COMMIT right behind that; the node receives each value
it could allocate straight into its extent and drops the bytes of the others.
Bytes move with scatter-gather socket calls straight between the socket and
slab/pool blocks: no intermediate ``bytes``.

The requests share the control socket, so control and data stay ordered.
Because the node sees every written byte, it marks an extent *written* only
once the whole value arrived; the client queues ``COMMIT`` (with
``COMMIT_FLAG_REQUIRE_WRITTEN``) right behind its PUT, and a value whose
bytes did not all arrive is never published.

* :mod:`~rdmakv.transport.tcp.loop` -- the native per-block loop both sides
  move bytes with, and its process-wide settings (send plan, receive spin);
* :mod:`~rdmakv.transport.tcp.client_side` -- :class:`TcpTransport`;
* :mod:`~rdmakv.transport.tcp.node_side` -- :class:`TcpNodeDataPath`.

:mod:`rdmakv.transport` registers the transport as ``"tcp"``.
"""
