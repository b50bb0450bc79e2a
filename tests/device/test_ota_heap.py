"""The heap with an over-the-air update in progress (issues 19 and 21):
env_sensor, library and umqtt as .mpy, receipts on and answered, keeps
publishing -- no reading lost, none out of order -- while a 30 kB update is
downloaded, switched and confirmed, in the smallest heap
bench/ota_device_bench.py found for it (``--min-heap``: the ``ota_min_heap``
line; device/README.md's OTA section has the figures beside those of
bench/device_min_heap.py).  Real MicroPython Unix port, real umqtt.simple, real
Mosquitto; the gateway is the contract's stand-in updater."""

from __future__ import annotations

import itertools
import subprocess
from pathlib import Path

import pytest

from tests.support.broker import Broker
from tests.support.micropython import (
    Board,
    Flash,
    MqttLog,
    ReceiptResponder,
    board_config,
    require_micropython,
    unique_device_id,
    wait_console,
)
from tests.support.ota_sender import OtaSender, Supervisor, app_files, booted_versions, install_provisioned

pytestmark = pytest.mark.micropython

# bench/ota_device_bench.py --min-heap, smallest heap with a 30 kB update in
# progress, per word size of the port (4: the 32-bit float32 build, as an
# ESP32: 68k, 64k fails; on wt-otaheap 64k passes the bench 6 of 10 times
# and this test (its board has the watchdog on) 1 of 3 (0 of 3 before
# 55bcec3), 68k 3 of 3; 8: the 64-bit Unix port: the bench's 92k passed
# this test 1 of 3 times, 96k 3 of 3)
OTA_MIN_HEAP = {4: "68k", 8: "96k"}


def _word_bytes() -> int:
    out = subprocess.run(
        [require_micropython(), "-c", "import sys; print(sys.maxsize)"],
        capture_output=True,
        text=True,
        check=True,
    )
    return 4 if int(out.stdout) < 2**32 else 8


def test_env_sensor_keeps_publishing_while_an_update_is_applied_in_the_measured_heap(
    broker: Broker, tmp_path: Path
) -> None:
    heap = OTA_MIN_HEAP[_word_bytes()]
    dev = unique_device_id("otaheap")
    responder = ReceiptResponder(broker)
    log = MqttLog(broker, f"edge/{dev}/up/#", tmp_path, f"sub-{dev}")
    flash = Flash(tmp_path / dev)
    cfg = board_config(broker.host, broker.port, dev, period_ms=100, receipts=True)
    install_provisioned(flash, cfg)  # the bench's layout: provisioning's, env_sensor unstamped
    board = Board(flash, heapsize=heap)
    sup = Supervisor(board)
    sender = None
    try:
        wait_console(board, "[iggy] connected to", what="v1 connected")
        log.wait_for(lambda m: len(m.json("/up/env")) >= 5, 20, "readings before the update")
        files = app_files("2", pad=30 * 1024 - sum(len(d) for d in app_files("2").values()))
        before = len(log.json("/up/env"))
        sender = OtaSender(broker, dev, "uheap", "2", files)
        result = sender.wait_result(120)
        assert result == {"id": "uheap", "st": "done", "v": "2"}, result
        during = len(log.json("/up/env")) - before
        assert during > 0  # it went on publishing meanwhile
        log.wait_for(lambda m: len(m.json("/up/env")) >= before + during + 5, 20, "readings from v2")
    finally:
        if sender is not None:
            sender.close()
        sup.stop()
        responder.close()
        log.stop()
    console = flash.text("_console.log")
    assert "fatal" not in console, console[-3000:]
    assert booted_versions(console) == [("2", "2")]  # v1 is the example as provisioned (no stamp)
    seqs = [int(d["seq"]) for d in log.json("/up/env")] + [int(d["seq"]) for d in log.json("/up/diag")]
    first = sorted(set(seqs))  # at least once: a reading re-sent after a reconnect comes twice
    # none lost: the only gap is the one the reset skips (the rest of a seq_block, 64)
    gaps = [b - a - 1 for a, b in itertools.pairwise(first) if b - a > 1]
    assert first[0] == 0
    assert len(gaps) <= 1, gaps
    assert all(g < 64 for g in gaps), gaps
