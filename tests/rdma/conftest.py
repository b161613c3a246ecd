"""Fixtures for tests that need a real RDMA device (soft-RoCE ``rxe0`` in CI).

Without a usable device the suite is skipped with the reason, unless
``RDMAKV_REQUIRE_RDMA=1`` (set by ``.ci/run`` inside the VM): then a missing
device is a failure, never a silent skip.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from rdmakv.blocks.slab import Slab
from rdmakv.transport.rdma import verbs

REQUIRE_ENV = "RDMAKV_REQUIRE_RDMA"
BLOCK = 16384
BLOCKS = 256


def _usable() -> tuple[bool, str]:
    if not verbs.native_available():
        return False, verbs.NATIVE_ERROR or "native RDMA core missing"
    try:
        return True, verbs.select(os.environ.get("RDMAKV_TEST_DEVICE")).describe()
    except Exception as e:  # RdmaUnavailable, ConfigError
        return False, str(e)


USABLE, WHY = _usable()


def pytest_report_header(config: pytest.Config) -> str:
    return f"rdmakv rdma device: {WHY if USABLE else 'NONE (' + WHY + ')'}"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        item.add_marker(pytest.mark.rdma)
        if item.get_closest_marker("anydevice"):
            continue  # works with or without a device
        if not USABLE and os.environ.get(REQUIRE_ENV) != "1":
            item.add_marker(pytest.mark.skip(reason=f"no RDMA device: {WHY}"))


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "anydevice: runs with or without an RDMA device")


@pytest.fixture(scope="session", autouse=True)
def _require_device() -> None:
    if not USABLE and os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(f"{REQUIRE_ENV}=1 but no usable RDMA device: {WHY}")


@pytest.fixture(scope="module")
def device() -> Iterator[verbs.Device]:
    dev = verbs.Device(verbs.select(os.environ.get("RDMAKV_TEST_DEVICE")))
    yield dev
    dev.close()


class Pair:
    """Two slabs registered on one device and two connected QPs: a -> b."""

    def __init__(self, dev: verbs.Device, blocks: int = BLOCKS, block: int = BLOCK) -> None:
        self.dev = dev
        self.a = Slab(blocks * block, block)
        self.b = Slab(blocks * block, block)
        self.ma = dev.register(self.a.base_addr, self.a.nbytes)
        self.mb = dev.register(self.b.base_addr, self.b.nbytes)
        self.qa = dev.create_qp()
        self.qb = dev.create_qp()
        self.connect()

    def connect(self) -> None:
        self.qa.connect(self.qb.local_info(self.mb))
        self.qb.connect(self.qa.local_info(self.ma))

    def reconnect(self) -> None:
        self.qa.reset()
        self.qb.reset()
        self.connect()

    def close(self) -> None:
        self.qa.close()
        self.qb.close()
        self.ma.close()
        self.mb.close()
        self.a.close()
        self.b.close()


@pytest.fixture()
def pair(device: verbs.Device) -> Iterator[Pair]:
    p = Pair(device)
    yield p
    p.close()
