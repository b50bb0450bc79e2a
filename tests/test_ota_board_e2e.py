"""The real agent's updater with the real board: the device library's
receiver and loader (device/iggy_device/ota*.py) under the MicroPython Unix
port with the real umqtt.simple, a real Mosquitto, receipts on.

Skips until the device side of issue 21 is merged (its test parts,
tests/support/ota_sender.py, bring the board's OTA layout and power supply).
Checked on a throw-away merge with that branch: both tests pass.
"""

from __future__ import annotations

import asyncio
import importlib
import json
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.ota.artifact import Artifact

from tests.support.broker import Broker
from tests.support.micropython import Board, Flash, board_config, require_micropython, unique_device_id
from tests.support.ota_agent import ota_settings, request, rows, running, wait_state
from tests.support.wait import wait_until

pytestmark = pytest.mark.micropython


def _board_side() -> Any:
    try:
        return importlib.import_module("tests.support.ota_sender")
    except ImportError:
        pytest.skip("the device side of over-the-air updates (tests/support/ota_sender.py) is not merged")


@pytest.mark.parametrize(("broken", "outcome", "runs"), [(None, "done", "2"), ("import", "rolled_back", "1")])
async def test_the_real_board_takes_an_update_or_rolls_back_by_itself(
    tmp_path: Path, broker: Broker, broken: str | None, outcome: str, runs: str
) -> None:
    side = _board_side()
    require_micropython()
    settings = ota_settings(tmp_path, broker)
    dev = unique_device_id("ota")
    flash = Flash(tmp_path / dev)
    side.install_ota_board(
        flash, "1", board_config(broker.host, broker.port, dev, period_ms=200, receipts=True)
    )
    async with running(settings):
        board = Board(flash, heapsize="160k")
        power = side.Supervisor(board)
        try:
            await asyncio.to_thread(
                lambda: wait_until(lambda: "[iggy] connected to" in board.console(), 30, what="v1 up")
            )
            files = side.app_files("2", broken=broken, pad=6000)
            await request(settings, Artifact("2", tuple(files.items()), None, "e2e"), [[dev]])
            await wait_state(settings, dev, outcome, timeout=90)
        finally:
            power.stop()
    row = rows(settings)[dev]
    assert row["board_version"] == runs
    if broken is not None:
        assert "broken at import" in row["reason"]
    assert json.loads(flash.text("ota.json"))["v"] == runs
