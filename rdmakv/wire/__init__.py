"""The wire: what a node and a client say to each other, and how it is framed.

* :mod:`rdmakv.wire.format` -- the one place the protocol is defined: frames,
  opcodes, statuses, the protocol version, limits, and the small fixed payloads
  (HELLO, node info, key and digest checks);
* :mod:`rdmakv.wire.batches` -- the batched payloads (ALLOC, GET, COMMIT, extent
  and lookup tables, REPORT), encoded and decoded a whole batch at a time;
* :mod:`rdmakv.wire.channel` -- a connection's framed socket I/O: request and
  answer, pipelining, and the native one-call lookup and get.

Everything above the wire (transports, node, client) imports from here; this
package imports nothing of them.
"""
