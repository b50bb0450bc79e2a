from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.broker import Broker
from tests.support.micropython import DEVICE_DIR, EXAMPLES_DIR, MqttLog

# The pure device modules run under CPython too: make them importable the
# way MicroPython sees them on a board (/lib/iggy_device, /bme280.py).
for p in (str(DEVICE_DIR), str(EXAMPLES_DIR / "env_sensor")):
    if p not in sys.path:
        sys.path.insert(0, p)


@pytest.fixture
def subscribe(broker: Broker, tmp_path: Path) -> Iterator[Callable[[str], MqttLog]]:
    """subscribe(device_id) -> every message under edge/{device_id}/#."""
    logs: list[MqttLog] = []

    def start(dev: str) -> MqttLog:
        log = MqttLog(broker, f"edge/{dev}/#", tmp_path, f"sub-{dev}")
        logs.append(log)
        return log

    yield start
    for log in logs:
        log.stop()
