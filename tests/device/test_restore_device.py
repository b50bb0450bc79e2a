"""Issue 15 with a real device: the env_sensor firmware under the MicroPython
Unix port (real umqtt.simple) gets its desired config from the agent, the
broker is SIGKILLed before its first autosave (retained config gone), the
agent restores it, and the device, rebooting with a wiped data directory
(so its own persisted copy cannot help), applies it from the broker."""

from __future__ import annotations

import asyncio
import json
import shutil
import uuid
from pathlib import Path

import pytest
from iggy_edge.downlink.commands import make_config
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.micropython import Board, Flash, require_micropython
from tests.support.return_path import running, send
from tests.support.wait import async_wait_until
from tests.test_downlink_restore import config_states

pytestmark = pytest.mark.micropython

APPLIED = "config: period_ms -> 150"


async def test_a_rebooting_device_applies_the_restored_config(tmp_path: Path) -> None:
    require_micropython()
    broker = Broker(tmp_path / "broker", autosave_interval=3600).start()
    dev = f"rst-{uuid.uuid4().hex[:8]}"
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy(partitions=3)
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor",
        device_id=dev,
        broker=broker.host,
        port=broker.port,
        period_ms=50,
        cycles=15,
        backoff_base_ms=100,
        backoff_max_ms=800,
    )
    board = Board(flash)
    try:
        async with running(settings, iggy) as agent:
            cfg = make_config(dev, {"period_ms": 150}, config_id="v1")
            send(iggy, settings, cfg)
            await async_wait_until(
                lambda: config_states(settings).get(dev) == ("v1", "delivered"), 20, what="config retained"
            )
            board.start()
            assert await asyncio.to_thread(board.wait, 60) == 0, board.console()[-3000:]
            assert APPLIED in board.console()

            broker.kill()  # before any autosave: the retained config is gone
            broker.start()
            await async_wait_until(
                lambda: agent.metric("iggy_edge_config_republished_total") == 1, 30, what="restored"
            )
            shutil.rmtree(flash.path("data"))  # the device forgets its copy (a replaced board)
            board.start()
            assert await asyncio.to_thread(board.wait, 60) == 0, board.console()[-3000:]
            second_boot = board.console().rsplit("--- boot", 1)[-1]
            assert APPLIED in second_boot, second_boot[-3000:]
            assert json.loads(flash.text("data/desired.json")) == {"period_ms": 150}
    finally:
        board.stop()
        broker.stop()
