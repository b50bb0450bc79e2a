from __future__ import annotations

import gc
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.broker import Broker, mosquitto_binary
from tests.support.iggy_server import iggy_cluster, iggy_server  # noqa: F401 -- fixtures, see the module


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


@pytest.fixture(autouse=True)
def _no_ambient_iggy_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests see only the environment they set: an IGGY_* variable in the
    developer's shell must not switch a test's uplink or broker."""
    for var in [v for v in os.environ if v.startswith("IGGY_")]:
        monkeypatch.delenv(var)


@pytest.fixture(autouse=True)
def _leaks_show_in_the_test_that_made_them() -> Iterator[None]:
    """Collect garbage after every test: a socket or transport left open is
    reported (as an error, filterwarnings = error) in the teardown of the test
    that leaked it, not in whichever later test the collector happens to run.
    A CI run once failed a downlink test for a socket some earlier test left."""
    yield
    gc.collect()
