"""cffi builders of the native core; ``setup.py`` names them in ``cffi_modules``.

* ``core_ffibuilder`` -> ``rdmakv._native``, required: the tcp transport's
  per-block loop (rk_tcp), the node's committed-key index (rk_index), the
  node's request loop that answers EXISTS and GET with it (rk_serve), and the
  client's calls (rk_call). Plain libc and pthreads only, built on every host.
  Each file is compiled once, so the module has one copy of every static (the
  receive-spin state and counts are the process's). rk_call.c is CPython-API
  code (it reads Python lists and builds Python objects, which cffi cannot):
  it is compiled into the same shared object, which then holds a second
  module, ``rdmakv._native_call``, that :mod:`rdmakv.native_core` makes from
  it (PEP 489, "multiple modules in one library"). So the module is built
  for this Python's ABI, not cffi's usual stable one (``stable_abi``).
* ``verbs_ffibuilder`` -> ``rdmakv._native_verbs`` (the RDMA hot loop): built
  only when the libibverbs headers are present; without them the package
  installs TCP-only and :mod:`rdmakv.transport.rdma.verbs` reports why RDMA is
  unavailable.

Each cdef is its headers' public declarations, so a C header stays the one
place its API is written.
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


def _builder(
    module: str, stems: Sequence[str], libraries: Sequence[str] = (),
    extra_sources: Sequence[str] = (), stable_abi: bool = True,
) -> FFI:
    """The builder of ``rdmakv.<module>`` from each ``<stem>.h`` / ``<stem>.c``
    (a header may use the ones before it), plus ``extra_sources`` (files of
    native/ with no cdef of their own). ``stable_abi`` False: built for this
    Python's ABI only (cffi's default is the stable one where it can)."""
    ffi = FFI()
    ffi.cdef("\n".join(_cdef(f"{stem}.h") for stem in stems))
    sources = [*(f"{stem}.c" for stem in stems), *extra_sources]
    ffi.set_source(
        f"rdmakv.{module}",
        "\n".join(f'#include "{stem}.h"' for stem in stems),
        sources=[os.path.relpath(os.path.join(HERE, name)) for name in sources],
        include_dirs=[os.path.relpath(HERE)],
        libraries=list(libraries),
        extra_compile_args=COMPILE_ARGS,
        **({} if stable_abi else {"py_limited_api": False}),
    )
    return ffi


core_ffibuilder = _builder("_native", ["rk_tcp", "rk_index", "rk_serve"],
                           extra_sources=["rk_call.c"], stable_abi=False)
verbs_ffibuilder = _builder("_native_verbs", ["rk_verbs"], libraries=["ibverbs"])

if __name__ == "__main__":
    core_ffibuilder.compile(verbose=True)
    verbs_ffibuilder.compile(verbose=True)
