"""Defaults that the configuration schema and the code it configures share.

Each one is defined here, once, and both :mod:`rdmakv.config` and the module
that uses it import it from here. This module imports nothing, so the
configuration can name a node's or a client's default without importing the
node or the client (and with them the wire protocol, numpy and the native
core): reading a YAML file stays cheap and its layer stays below theirs.
"""

# -- the node: connection limits (rdmakv.node.admission.SessionLimits, docs/security.md) ------

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

# -- the node: read leases (rdmakv.node.store) -------------------------------------------------

DEFAULT_LEASE_TIMEOUT = 30.0
"""Seconds a client's read lease lasts."""
DEFAULT_MAX_LEASES_PER_BLOCK = 4
"""Live leases one session may hold on one block: a reader needs one (a few while
requests overlap); hundreds are hoarding."""

# -- the client (rdmakv.streams) ---------------------------------------------------------------

MAX_STREAMS = 16
"""More connections than this per engine process and node only hoard node
sessions (the node limits connections per address)."""
