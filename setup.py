"""Build hook: the optional native RDMA core (``rdmakv._native_verbs``).

All metadata lives in pyproject.toml. The cffi module is built only when the
libibverbs development headers are present (``apt-get install libibverbs-dev``)
and ``RDMAKV_NO_NATIVE`` is unset; otherwise rdmakv installs TCP-only, and
``rdmakv doctor`` / the ``auto`` transport say why RDMA is unavailable. A
failing native compile is reported and skipped, never fatal.
"""

from __future__ import annotations

import os
import sys

from setuptools import setup
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
            print(f"rdmakv: native RDMA core not built ({exc}); TCP-only", file=sys.stderr)

    def build_extension(self, ext):  # type: ignore[no-untyped-def]
        try:
            super().build_extension(ext)
        except Exception as exc:
            print(f"rdmakv: native RDMA core not built ({exc}); TCP-only", file=sys.stderr)


kwargs: dict[str, object] = {"cmdclass": {"build_ext": OptionalBuildExt}}
if os.environ.get("RDMAKV_NO_NATIVE"):
    print("rdmakv: RDMAKV_NO_NATIVE set: installing TCP-only", file=sys.stderr)
elif not _have_verbs_headers():
    print(
        "rdmakv: infiniband/verbs.h not found (apt-get install libibverbs-dev): "
        "installing TCP-only",
        file=sys.stderr,
    )
else:
    kwargs["cffi_modules"] = ["native/build_verbs.py:ffibuilder"]

setup(**kwargs)  # type: ignore[arg-type]
