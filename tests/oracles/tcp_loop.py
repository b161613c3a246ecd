"""The tcp transport's per-block loop in plain Python: the oracle of
native/rk_tcp.c's ``rk_tcp_sendv`` / ``rk_tcp_recvv`` and their hashing
twins (:func:`rdmakv.transport.tcp.loop.send_iov`, :func:`~rdmakv.transport.tcp.loop.recv_iov`).

Before the native core was required this was the transport's own loop where
the core was not built (``sendmsg`` / ``recvmsg_into`` of block views, and
:func:`~rdmakv.wire.format.value_checksum` per block after it moved):
tests/test_tcp_native.py checks the native loop against it, each direction
against the other's twin.
"""

from __future__ import annotations

import ctypes
import socket

import numpy as np

from rdmakv.wire.channel import recv_views, send_views
from rdmakv.wire.format import value_checksum


def views(iov: np.ndarray) -> list[memoryview]:
    """A writable view of the memory at each ``(addr, len)`` row (the caller
    keeps that memory alive while the views are used)."""
    out = []
    for addr, n in iov.tolist():
        out.append(memoryview((ctypes.c_char * n).from_address(addr)).cast("B") if n
                   else memoryview(b""))
    return out


def send_iov(sock: socket.socket, iov: np.ndarray) -> list[int]:
    """Send the bytes at each row, in order; each row's value checksum."""
    rows = views(iov)
    send_views(sock, rows)
    return [value_checksum(v) for v in rows]


def recv_iov(sock: socket.socket, iov: np.ndarray) -> list[int]:
    """Fill the memory at each row from ``sock``, in order; each row's value checksum."""
    rows = views(iov)
    recv_views(sock, [v for v in rows if len(v)])
    return [value_checksum(v) for v in rows]
