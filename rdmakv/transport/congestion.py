"""TCP congestion control of rdmakv's connections (both ends set it).

rdmakv's TCP connections carry bulk values in bursts, and the receiver stops
reading between requests while its Python runs. Under BBR (the kernel default
on some images, this project's build machines among them) transfers over
loopback ran at about half the rate they ran at under CUBIC, and varied from
run to run (the figures: bench/README.md, section "Measurements moved from
code comments (issue 58)"). So each connection asks for :data:`DEFAULT_CONGESTION` unless
``RDMAKV_TCP_CONGESTION`` names another algorithm (``system``: leave the
kernel's default alone).

The kernel lets an unprivileged process pick only the algorithms listed in
``net.ipv4.tcp_allowed_congestion_control`` (a privileged one: any loaded
module). When it refuses, the connection keeps the system default and the
refusal is logged once per algorithm and reason, with the fix; ``rdmakv
doctor`` reports the same. Nothing else changes: the choice is a matter of
speed, never of correctness.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading

log = logging.getLogger("rdmakv.transport")

DEFAULT_CONGESTION = "cubic"
ENV_VAR = "RDMAKV_TCP_CONGESTION"
SYSTEM = "system"
"""The ``RDMAKV_TCP_CONGESTION`` value that leaves the kernel's default alone."""
ALLOWED_PATH = "/proc/sys/net/ipv4/tcp_allowed_congestion_control"
_NAME_MAX = 16  # TCP_CA_NAME_MAX: the kernel's longest algorithm name, NUL included
_OPT: int | None = getattr(socket, "TCP_CONGESTION", None)  # None: not Linux

_refusals_logged: set[tuple[str, str]] = set()  # (algorithm, reason) already logged
_log_lock = threading.Lock()


def wanted_congestion() -> str | None:
    """The algorithm rdmakv's connections ask for (None: the system default)."""
    name = os.environ.get(ENV_VAR, DEFAULT_CONGESTION).strip()
    return None if name in ("", SYSTEM) else name


def congestion_of(sock: socket.socket) -> str | None:
    """The algorithm ``sock`` runs (None where the platform cannot say)."""
    if _OPT is None:
        return None
    raw = sock.getsockopt(socket.IPPROTO_TCP, _OPT, _NAME_MAX)
    return raw.split(b"\0", 1)[0].decode("ascii", "replace")


def apply_congestion(sock: socket.socket, name: str | None = None) -> None:
    """Ask the kernel to run ``name`` (default: :func:`wanted_congestion`) on
    ``sock`` (:func:`congestion_of` says what it runs). A refusal leaves the
    system's default and is logged (once per algorithm and reason)."""
    name = wanted_congestion() if name is None else name
    refused = _ask(sock, name)
    if refused is not None and name is not None:
        with _log_lock:
            first = (name, refused) not in _refusals_logged
            _refusals_logged.add((name, refused))
        if first:
            log.info("TCP congestion control %s; connections keep the system default",
                     refusal_text(name, refused))


def probe_congestion() -> tuple[str | None, str | None]:
    """(the algorithm a new rdmakv connection would run, why the wanted one was
    refused or None), tried on a socket of its own (``rdmakv doctor``)."""
    name = wanted_congestion()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        refused = _ask(sock, name)
        return congestion_of(sock), None if refused is None or name is None \
            else refusal_text(name, refused)


def _ask(sock: socket.socket, name: str | None) -> str | None:
    """Set ``name`` on ``sock``; the kernel's reason when it refuses, else None."""
    if name is None or _OPT is None:
        return None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, _OPT, name.encode("ascii"))
    except (OSError, UnicodeEncodeError) as e:
        code = getattr(e, "errno", None)
        return os.strerror(code) if code else str(e)
    return None


def refusal_text(name: str, reason: str) -> str:
    """What was refused, why, and the fix."""
    if reason == os.strerror(errno.ENOENT):  # no such algorithm in this kernel
        fix = f"load its module (modprobe tcp_{name})"
    else:
        fix = (f"allow it with `sysctl -w net.ipv4.tcp_allowed_congestion_control="
               f"\"{_allowed_with(name)}\"` (now: {allowed_congestion() or '?'})")
    return f"{name!r} refused ({reason}): {fix}, or set {ENV_VAR}=system to stop asking"


def allowed_congestion() -> str | None:
    """``net.ipv4.tcp_allowed_congestion_control`` (None where it cannot be read)."""
    try:
        with open(ALLOWED_PATH) as f:
            return f.read().strip()
    except OSError:
        return None


def _allowed_with(name: str) -> str:
    listed = (allowed_congestion() or "").split()
    return " ".join([*listed, name] if name not in listed else listed)
