"""The one exception hierarchy of rdmakv.

Everything rdmakv raises on purpose derives from :class:`RdmakvError`, so an
engine connector can catch one class and turn any failure into a cache miss.
Subclasses say *what* went wrong; messages say which value was wrong and why.
"""

from __future__ import annotations


class RdmakvError(Exception):
    """Root of every error rdmakv raises deliberately."""


class ConfigError(RdmakvError, ValueError):
    """A caller passed an invalid argument or configuration value."""


class UnsupportedTransport(ConfigError):
    """The transport asked for is unknown, cannot load on this host, or the
    peer does not offer it (a node answers it with ``Status.UNSUPPORTED``)."""


class SlabError(RdmakvError):
    """Misuse of the L1 slab (bad handle, double free, ...)."""


class SlabExhausted(SlabError):
    """The slab has no free block left."""


class InvalidHandle(SlabError):
    """A block handle that is out of range or no longer allocated."""


class MissingExtra(RdmakvError, ImportError):
    """A feature needs a package that one of rdmakv's extras installs, and it is
    not installed (``pip install 'rdmakv[EXTRA]'``)."""


class MemoryLockWarning(RuntimeWarning):
    """The slab could not be locked in RAM (memlock limit too small)."""


class ProtocolError(RdmakvError):
    """A peer sent a malformed, oversized or unexpected frame."""


class VersionMismatch(ProtocolError):
    """The peer speaks another protocol version: one end must be upgraded
    (trying again cannot help; the message names both versions)."""


class AuthError(RdmakvError):
    """The shared-secret token was missing or wrong."""


class TransportError(RdmakvError):
    """A data-path or control-path operation failed."""


class TransportTimeout(TransportError, TimeoutError):
    """A remote wait ran past its deadline."""


class ConnectionLost(TransportError, ConnectionError):
    """The connection to the peer broke (peer died, reset, closed)."""


class OpsFailed(TransportError):
    """Only some ops of one data batch failed; ``failed`` are their indexes in
    the batch. Every other op's bytes moved and the connection stays usable, so
    a caller turns exactly those ops into misses / unstored keys."""

    def __init__(self, msg: str, failed: list[int]) -> None:
        super().__init__(msg)
        self.failed = failed


class RemoteError(RdmakvError):
    """The node refused a request; the message is the node's reason."""


class UnknownOpcode(RemoteError):
    """The node does not know the request's opcode (it predates it): an optional
    request (e.g. REPORT) was not recorded; the connection keeps serving."""


class RdmaError(TransportError):
    """Verbs set-up or a work completion failed."""


class RdmaUnavailable(RdmaError):
    """No usable RDMA device/port/GID: callers fall back to TCP."""
