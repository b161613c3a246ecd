"""cffi builder for ``rdmakv._native_verbs`` (the RDMA hot loop).

Used by ``setup.py`` (``cffi_modules``) when libibverbs headers are present;
without them the package installs TCP-only and :mod:`rdmakv.transport.verbs`
reports why RDMA is unavailable.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef() -> str:
    """The public declarations of rk_verbs.h, minus preprocessor lines."""
    with open(os.path.join(HERE, "rk_verbs.h")) as f:
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


ffibuilder = FFI()
ffibuilder.cdef(_cdef())
ffibuilder.set_source(
    "rdmakv._native_verbs",
    '#include "rk_verbs.h"',
    sources=[os.path.relpath(os.path.join(HERE, "rk_verbs.c"))],
    include_dirs=[os.path.relpath(HERE)],
    libraries=["ibverbs"],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
