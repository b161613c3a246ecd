"""cffi builder for ``rdmakv._native_tcp`` (the tcp transport's per-block loop).

Plain libc only, so ``setup.py`` builds it on every host (with or without
libibverbs); if it cannot be built, :mod:`rdmakv.transport.tcp` falls back to
its pure-Python socket loop.
"""

from __future__ import annotations

import os
import re

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))


def _cdef() -> str:
    """The public declarations of rk_tcp.h, minus preprocessor lines."""
    with open(os.path.join(HERE, "rk_tcp.h")) as f:
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
    "rdmakv._native_tcp",
    '#include "rk_tcp.h"',
    sources=[os.path.relpath(os.path.join(HERE, "rk_tcp.c"))],
    include_dirs=[os.path.relpath(HERE)],
    extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"],
)

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
