"""Build hook: the optional native RDMA core (``rdmakv._native_verbs``), the
native TCP loop (``rdmakv._native_tcp``), the node's native index
(``rdmakv._native_index``) and the client's native lookup call
(``rdmakv._native_call``, a CPython extension); the last three need plain libc
only and are built on every host.

All metadata lives in pyproject.toml. The RDMA cffi module is built only when
the libibverbs development headers are present (``apt-get install
libibverbs-dev``) and ``RDMAKV_NO_NATIVE`` is unset; otherwise rdmakv installs
TCP-only, and ``rdmakv doctor`` / the ``auto`` transport say why RDMA is
unavailable. The TCP loop, the index and the call need only a C compiler;
without it (or with ``RDMAKV_NO_NATIVE``) tcp moves bytes in Python, the node
keeps its keys in a Python index and a lookup is framed in Python. A failing native compile is
reported and skipped, never fatal.
"""

from __future__ import annotations

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

VERBS_HEADER_DIRS = ("/usr/include", "/usr/local/include")


def _have_verbs_headers() -> bool:
    extra = os.environ.get("CPATH", "").split(os.pathsep)
    return any(
        os.path.exists(os.path.join(d, "infiniband", "verbs.h"))
        for d in (*VERBS_HEADER_DIRS, *filter(None, extra))
    )


class OptionalBuildExt(build_ext):
    """build_ext that turns a failed native build into a TCP-only install."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:  # compiler missing, link error, ...
            print(f"rdmakv: native core not built ({exc})", file=sys.stderr)

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"rdmakv: native module {ext.name} not built ({exc})", file=sys.stderr)


kwargs: dict[str, object] = {"cmdclass": {"build_ext": OptionalBuildExt}}
# The native TCP loop and index need only libc: built on every host (else Python).
cffi_modules = ["native/build.py:tcp_ffibuilder", "native/build.py:index_ffibuilder"]
if os.environ.get("RDMAKV_NO_NATIVE"):
    print("rdmakv: RDMAKV_NO_NATIVE set: no native modules (TCP-only)", file=sys.stderr)
    cffi_modules = []
elif not _have_verbs_headers():
    print(
        "rdmakv: infiniband/verbs.h not found (apt-get install libibverbs-dev): "
        "installing TCP-only",
        file=sys.stderr,
    )
else:
    cffi_modules.append("native/build.py:verbs_ffibuilder")
if cffi_modules:
    kwargs["cffi_modules"] = cffi_modules
    kwargs["ext_modules"] = [
        # rk_tcp.c too: a get's answer is laid out, received and checked by the TCP loop's code
        Extension("rdmakv._native_call", ["native/rk_call.c", "native/rk_tcp.c"],
                  include_dirs=["native"],
                  extra_compile_args=["-O2", "-Wall", "-Wextra", "-Wno-unused-parameter"])
    ]

setup(**kwargs)  # type: ignore[arg-type]
