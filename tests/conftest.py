from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.broker import Broker, mosquitto_binary


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
