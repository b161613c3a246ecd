"""Defaults that the configuration schema and the code it configures share.

Each one is defined here, once, and both :mod:`rdmakv.config` and the module
that uses it import it from here. This module imports nothing, so the
configuration can name a node's or a client's default without importing the
node or the client (and with them the wire protocol, numpy and the native
core): reading a YAML file stays cheap and its layer stays below theirs.
"""

# -- the node: where it listens (rdmakv.node.server.KVNode) -------------------------------------

DEFAULT_HOST = "127.0.0.1"
"""The address a node binds (and serves its metrics on) unless told otherwise: this
host only, so that a node is reachable from elsewhere only when asked to be."""
DEFAULT_PORT = 7480
"""The TCP port a node listens on, and the one its clients' addresses name."""

# -- the node: connection limits (rdmakv.node.admission.SessionLimits, docs/security.md) --------

HANDSHAKE_TIMEOUT_S = 5.0
"""A connection must finish HELLO this long after it was accepted."""
IDLE_TIMEOUT_S = 300.0
"""An authenticated connection with no request for this long is closed."""
MAX_SESSIONS = 1024
"""Connections a node keeps open at once, in all."""
MAX_SESSIONS_PER_SOURCE = 512
"""Connections a node keeps open at once from one IP address."""
MAX_UNAUTHENTICATED = 256
"""Connections still in their handshake, in all (the oldest are shed first)."""
MAX_UNAUTHENTICATED_PER_SOURCE = 32
"""Connections still in their handshake from one IP address."""

# -- the node: read leases (rdmakv.node.store) --------------------------------------------------

DEFAULT_LEASE_TIMEOUT = 30.0
"""Seconds a client's read lease lasts."""
DEFAULT_MAX_LEASES_PER_BLOCK = 4
"""Live leases one session may hold on one block: a reader needs one (a few while
requests overlap); hundreds are hoarding."""

# -- the client (rdmakv.client: one node, streams, cluster; the connectors) ---------------------

DEFAULT_TIMEOUT = 5.0
"""Seconds any one remote wait of a client may take."""
DEFAULT_REPLICATION = 1
"""Copies of each block in a cluster."""
DEFAULT_L1_BYTES = 1 << 30
"""An engine process's L1 (its pinned slab), split evenly across its KV cache groups."""
DEFAULT_OFFLOAD = "reuse"
"""Which computed blocks an engine's L1 sends to the node (docs/offload.md)."""

MAX_STREAMS = 16
"""More connections than this per engine process and node only hoard node
sessions (the node limits connections per address)."""

# -- the TCP loop of every process (rdmakv.transport.tcp.loop, native/rk_tcp.h) -----------------

DEFAULT_TCP_SEND_PLAN = "512k-ahead"
"""How a send that hashes as it goes moves its bytes: 512 KiB per ``sendmsg``, each
window hashed right before the call. Of the four plans
(:data:`rdmakv.transport.tcp.loop.SEND_PLANS`) it cost the sending thread least on the
bench hosts where the hash's read from memory is cheaper than the kernel's copy from
memory; ``rdmakv doctor --tune`` times the four on another host."""
