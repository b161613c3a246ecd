"""cffi builders for the native core; ``setup.py`` names them in ``cffi_modules``.

* ``tcp_ffibuilder`` -> ``rdmakv._native_tcp`` (the tcp transport's per-block
  loop): plain libc only, built on every host (with or without libibverbs); if
  it cannot be built, :mod:`rdmakv.transport.tcp` falls back to its
  pure-Python socket loop.
* ``index_ffibuilder`` -> ``rdmakv._native_index`` (the node's committed-key
  index, and the request loop that answers EXISTS and GET with it, rk_serve,
  which sends a GET's values with the tcp loop's rk_tcp_sendv): plain libc
  and pthreads only, built on every host; without it the node keeps its
  keys in :class:`rdmakv.node.index.Index` (Python) and serves every request
  in Python.
* ``verbs_ffibuilder`` -> ``rdmakv._native_verbs`` (the RDMA hot loop): built
  only when the libibverbs headers are present; without them the package
  installs TCP-only and :mod:`rdmakv.transport.verbs` reports why RDMA is
  unavailable.

Each module's cdef is its header's public declarations, so the C header stays
the one place its API is written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
COMPILE_ARGS = ["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"]


def _cdef(header: str) -> str:
    """The public declarations of ``header``, minus preprocessor lines (but its
    ``#define RK_*`` constants)."""
    with open(os.path.join(HERE, header)) as f:
        text = f.read()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    lines = []
    for line in text.splitlines():
        if line.startswith("#define RK_") and len(line.split()) >= 3:
            name, value = line.split()[1:3]
            lines.append(f"#define {name} {value}")
        elif not line.startswith("#"):
            lines.append(line)
    return "\n".join(lines)


def _builder(module: str, stems: Sequence[str], libraries: Sequence[str] = ()) -> FFI:
    """The builder of ``rdmakv.<module>`` from each ``<stem>.h`` / ``<stem>.c``
    (a header may use the ones before it)."""
    ffi = FFI()
    ffi.cdef("\n".join(_cdef(f"{stem}.h") for stem in stems))
    ffi.set_source(
        f"rdmakv.{module}",
        "\n".join(f'#include "{stem}.h"' for stem in stems),
        sources=[os.path.relpath(os.path.join(HERE, f"{stem}.c")) for stem in stems],
        include_dirs=[os.path.relpath(HERE)],
        libraries=list(libraries),
        extra_compile_args=COMPILE_ARGS,
    )
    return ffi


tcp_ffibuilder = _builder("_native_tcp", ["rk_tcp"])
index_ffibuilder = _builder("_native_index", ["rk_tcp", "rk_index", "rk_serve"])
verbs_ffibuilder = _builder("_native_verbs", ["rk_verbs"], libraries=["ibverbs"])

if __name__ == "__main__":
    tcp_ffibuilder.compile(verbose=True)
    index_ffibuilder.compile(verbose=True)
    verbs_ffibuilder.compile(verbose=True)
