"""The ``rdma`` transport: one-sided RDMA WRITE/READ over RC queue pairs.

Client side (:class:`~rdmakv.transport.rdma.client_side.RdmaTransport`): the client
slab is registered once per device (shared by every peer); each peer connection gets one RC QP whose
connection info is exchanged with the node over the control channel
(``Op.RDMA_CONNECT``, JSON :class:`~rdmakv.transport.verbs.ConnInfo` both
ways). A put is RDMA WRITEs from slab blocks into node extents, a get is RDMA
READs from leased node extents into slab blocks (the extent strategy of
:mod:`rdmakv.transport.extents`); the node CPU is not in the data path.
Batches go to the native hot loop (SGL gathering, chained WRs, selective
signalling, bounded outstanding WRs, batched CQ polling).

Node side (:class:`~rdmakv.transport.rdma.node_side.RdmaNodeDataPath`): the pool is
registered ONCE at start; each session that sends ``RDMA_CONNECT`` gets its own QP
(a repeated connect replaces it: that is how a client recovers from a QP error), destroyed when the
session ends or on ``RDMA_DISCONNECT``.

Failure rules:

* Batches run on a per-connection worker thread; the returned future's
  ``result`` never waits past the batch timeout (the native loop, or the
  future, forces the QP to ERROR and drains it), and once it returns or
  raises no WR still touches the slab or a leased extent: the caller may
  release leases and reuse blocks.
* Ops the device failed (bad address / rkey, peer unreachable) fail the batch
  with :class:`~rdmakv.transport.rdma.device.RdmaOpsFailed`, which names the failed op
  indexes; ops that were
  only flushed behind a failure are retried once on a fresh QP.
* After any failure the QP is reset and reconnected (on the caller's thread,
  over the control channel) before the next batch; if reconnecting fails the
  error says so and the next batch tries again.
* ``auto`` falls back to TCP, logging why, when RDMA is not usable here
  (:func:`rdmakv.transport.resolve_transport`) or cannot be set up with a
  peer (:class:`rdmakv.client.node_client.KVClient`, as it connects).

Modules: :mod:`~rdmakv.transport.rdma.verbs` (the native hot loop's binding),
:mod:`~rdmakv.transport.rdma.device` (what both sides share),
:mod:`~rdmakv.transport.rdma.client_side`, :mod:`~rdmakv.transport.rdma.node_side`.
Importing this package registers the transport as ``"rdma"``.
"""

from __future__ import annotations

import logging

from rdmakv.transport.rdma.client_side import RdmaTransport
from rdmakv.transport.rdma.device import rdma_usable
from rdmakv.transport.rdma.node_side import RdmaNodeDataPath

log = logging.getLogger("rdmakv.rdma")

_logged_reasons: set[str] = set()


def _usable_for_auto() -> bool:
    """The registry's probe; says once per distinct reason why RDMA is not used."""
    ok, why = rdma_usable()
    if not ok and why not in _logged_reasons:
        _logged_reasons.add(why)
        log.info("rdmakv: rdma not usable here (%s); auto uses tcp", why)
    return ok


def _register() -> None:
    from rdmakv.transport import TransportSpec, register_transport

    register_transport(
        TransportSpec("rdma", RdmaTransport, RdmaNodeDataPath, usable=_usable_for_auto)
    )


_register()
