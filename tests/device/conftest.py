from __future__ import annotations

import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.support.broker import Broker
from tests.support.micropython import DEVICE_DIR, EXAMPLES_DIR, MqttLog

# The pure device modules run under CPython too: make them importable the
# way MicroPython sees them on a board (/lib/iggy_device, /bme280.py), with
# a stand-in for the built-in ``micropython`` module (const()).
for p in (str(DEVICE_DIR), str(EXAMPLES_DIR / "env_sensor"), str(Path(__file__).parent / "cpython")):
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


@pytest.fixture
def pty(tmp_path: Path) -> Iterator[Path]:
    """A pseudo-terminal pair from socat; the test uses one end as the port."""
    if shutil.which("socat") is None:
        pytest.fail("socat is not installed (run .ci/setup)")
    a, b = tmp_path / "ttyA", tmp_path / "ttyB"
    proc = subprocess.Popen(
        ["socat", f"pty,raw,echo=0,link={a}", f"pty,raw,echo=0,link={b}"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 5
    while not a.exists():
        assert time.monotonic() < deadline, "socat made no PTY"
        time.sleep(0.05)
    yield a
    proc.terminate()
    proc.wait(timeout=5)
