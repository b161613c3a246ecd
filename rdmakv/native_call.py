"""The native client calls (native/rk_call.c, the CPython extension
``rdmakv._native_call``), loaded once for every module that uses them.

:class:`~rdmakv.protocol.Channel` runs a lookup and a whole TCP get in one
call each (:mod:`rdmakv.protocol` configures the module with the wire's
numbers at import). :class:`~rdmakv.protocol.BatchEncoder` and
:meth:`~rdmakv.slab.Slab.check_handles` check a batch's keys, digests and
block handles in one C pass each (``join_uniform``, ``live_handles``). Every
user falls back to Python where the module is not built or is switched off
(``RDMAKV_CALL_NATIVE=0``), correct but slower.
"""

from __future__ import annotations

from types import ModuleType

from rdmakv import native_core

ENV = "RDMAKV_CALL_NATIVE"
"""Set to 0 to run every client call and batch check in Python even where the
native call is built."""


def _load() -> tuple[ModuleType | None, str | None]:
    module, error = native_core.load_extension("_native_call", "native client call")
    if module is None or native_core.switched_off(ENV):
        return None, error
    return module, None


MODULE, ERROR = _load()
"""The module, or None where it is not built (ERROR says why) or switched off."""
