from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from tests.support.broker import Broker, mosquitto_binary

if TYPE_CHECKING:  # the module loads the native Iggy SDK: only for the tests that use it
    from tests.support.iggy_server import IggyCluster, IggyServer

# The guard that keeps `pytest -m unit` honest (see the module), and pytester
# for its own test (tests/test_tiers.py).
pytest_plugins = ["pytester", "tests.support.tiers"]


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A real Mosquitto broker on a free port, persistence in tmp_path."""
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: run .ci/setup (tests need a real broker)")
    b = Broker(tmp_path / "broker").start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def iggy_server(tmp_path: Path) -> Iterator[IggyServer]:
    """A fresh iggy-server for one test; skips when the binary is missing."""
    from tests.support import iggy_server  # noqa: PLC0415 -- the native SDK, only when asked for

    yield from iggy_server.running_server(tmp_path)


@pytest.fixture
def iggy_cluster(tmp_path: Path) -> Iterator[IggyCluster]:
    """A fresh 3-node iggy-server cluster for one test; skips when the binary is missing."""
    from tests.support import iggy_server  # noqa: PLC0415 -- the native SDK, only when asked for

    yield from iggy_server.running_cluster(tmp_path)


@pytest.fixture(autouse=True)
def _no_ambient_iggy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see only the environment they set: an IGGY_* variable in the
    developer's shell must not switch a test's uplink or broker."""
    for var in [v for v in os.environ if v.startswith("IGGY_")]:
        monkeypatch.delenv(var)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Move what importing and collecting made (modules, hypothesis'
    strategies, the test items) out of the collector's reach: no test made
    it, and the full collection after every test below then walks only what
    tests create -- 70 ms a test before, most of the fast tier's time."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _leaks_show_in_the_test_that_made_them() -> Iterator[None]:
    """Collect garbage after every test: a socket or transport left open is
    reported (as an error, filterwarnings = error) in the teardown of the test
    that leaked it, not in whichever later test the collector happens to run.
    A CI run once failed a downlink test for a socket some earlier test left."""
    yield
    gc.collect()
