"""Build hook: the native core (``rdmakv._native``, required) and the
optional native RDMA core (``rdmakv._native_verbs``).

All metadata lives in pyproject.toml. The core (the TCP loop, the node's
index and request loop, the client's calls: native/build.py) needs a C
compiler and the Python headers, and nothing else: where either is missing
the install fails with one line that names it. The RDMA module is built only
when the libibverbs development headers are present (``apt-get install
libibverbs-dev``); otherwise rdmakv installs TCP-only, and ``rdmakv doctor``
/ the ``auto`` transport say why RDMA is unavailable. A failing RDMA compile
is reported and skipped, never fatal.
"""

from __future__ import annotations

import os
import shutil
import sys
import sysconfig

from setuptools import setup
from setuptools.command.build_ext import build_ext

VERBS_HEADER_DIRS = ("/usr/include", "/usr/local/include")
VERBS_MODULE = "rdmakv._native_verbs"
CANNOT_BUILD = "rdmakv: cannot build its native core (rdmakv._native): "


def _have_verbs_headers() -> bool:
    extra = os.environ.get("CPATH", "").split(os.pathsep)
    return any(
        os.path.exists(os.path.join(d, "infiniband", "verbs.h"))
        for d in (*VERBS_HEADER_DIRS, *filter(None, extra))
    )


def _missing_build_tool(compiler: object) -> str | None:
    """What the core's build lacks on this host, as the one line an install
    fails with; None when nothing is missing."""
    command = getattr(compiler, "compiler_so", None)  # unix compilers: the command it runs
    if command and shutil.which(command[0]) is None:
        return (f"no C compiler ({command[0]!r} not found; install gcc, "
                "or set CC to a compiler)")
    include = sysconfig.get_path("include")
    if not os.path.exists(os.path.join(include, "Python.h")):
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (f"Python.h is missing from {include} (install the Python headers: "
                f"python3-dev, or python{version}-dev)")
    return None


class CoreBuildExt(build_ext):
    """build_ext that fails on a host that cannot build the core with one
    line naming what is missing, and turns a failed RDMA module build into
    a TCP-only install."""

    def build_extensions(self) -> None:
        missing = _missing_build_tool(self.compiler)
        if missing:
            raise SystemExit(CANNOT_BUILD + missing)
        super().build_extensions()

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        if ext.name != VERBS_MODULE:
            super().build_extension(ext)
            return
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"rdmakv: native module {ext.name} not built ({exc}): installing TCP-only",
                  file=sys.stderr)


cffi_modules = ["native/build.py:core_ffibuilder"]
if _have_verbs_headers():
    cffi_modules.append("native/build.py:verbs_ffibuilder")
else:
    print(
        "rdmakv: infiniband/verbs.h not found (apt-get install libibverbs-dev): "
        "installing TCP-only",
        file=sys.stderr,
    )

setup(cmdclass={"build_ext": CoreBuildExt}, cffi_modules=cffi_modules)
