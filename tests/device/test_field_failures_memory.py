"""Field failures of issue 19 (1-5), each reproduced under the real
MicroPython Unix port with the real umqtt.simple against a real Mosquitto,
receipts on as shipped (answered by ``ReceiptResponder`` where a gateway
would answer).  Heap pressure is made the way a long-running board gets it:
the board's own program holds or fragments its heap before the event."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.broker import Broker
from tests.support.micropython import (
    DEEPSLEEP_EXIT,
    Board,
    Flash,
    MqttLog,
    ReceiptResponder,
    board_config,
    mqtt_publish,
    require_micropython,
    unique_device_id,
    wait_console,
)
from tests.support.wait import wait_until

pytestmark = pytest.mark.micropython


@pytest.fixture(autouse=True)
def _needs_micropython() -> None:
    require_micropython()


# The device: connect, wait for the gate (a receipt), say READY, then wait
# for the test's "go" file (the test has put the large messages on the
# broker meanwhile) and run the scenario in app["mode"].
DEVICE_MAIN = """\
import machine
import network
import gc
import json
import os
import time
from iggy_device import config
from iggy_device.node import Device

cfg = config.load()
app = cfg.app
dev = Device(cfg)


@dev.command("echo")
def echo(args):
    return {"n": len(args.get("blob", "")), "pad": "x" * app.get("reply", 0)}


def serve(ms):
    t0 = time.ticks_ms()
    while time.ticks_diff(time.ticks_ms(), t0) < ms:
        dev.poll()
        time.sleep_ms(10)


def exists(p):
    try:
        os.stat(p)
        return True
    except OSError:
        return False


assert dev.connect()
t0 = time.ticks_ms()
while dev.receipts.mode != "on" and time.ticks_diff(time.ticks_ms(), t0) < 10000:
    serve(20)
print("IGGY-READY", dev.receipts.mode)
while not exists("go"):
    time.sleep_ms(20)
time.sleep_ms(300)  # what the broker sent is in the socket now
mode = app["mode"]
if mode == "publish_oom":
    # the heap nearly full when a large message arrives during the PUBACK
    # wait of a publish: umqtt's read of it cannot be allocated
    gc.collect()
    hog = []
    try:
        while gc.mem_free() > app["free"]:
            hog.append(bytearray(128))
    except MemoryError:
        pass
    try:
        dev.publish("env", {"v": 1})
        print("IGGY-PUBLISH caught")
    except MemoryError as e:
        hog = None
        print("IGGY-PUBLISH escaped", repr(e))
    hog = None
    gc.collect()
elif mode == "fragmented":
    # one free block large enough for a raw command, the rest of the heap
    # in small pieces: handling needs a second large block, which is not there
    gc.collect()
    hole = bytearray(app["hole"])
    keep = []
    junk = []
    try:
        while True:
            keep.append(bytearray(48))
            junk.append(bytearray(48))
    except MemoryError:
        pass
    junk = None
    keep.pop()
    hole = None
    gc.collect()
    print("IGGY-FRAGMENTED free", gc.mem_free())
elif mode == "no_block":
    # the heap full of app["hole"]-byte pieces (and small ones in what is
    # left), then every other piece freed: holes of that size between kept
    # ones, room for everything else, no block for a large command, ever
    gc.collect()
    gaps = []
    small = []
    try:
        while True:
            gaps.append(bytearray(app["hole"]))
    except MemoryError:
        pass
    try:
        while True:
            small.append(bytearray(8))
    except MemoryError:
        pass
    for i in range(1, len(gaps), 2):
        gaps[i] = None
    gc.collect()
    print("IGGY-FRAGMENTED free", gc.mem_free())
try:
    serve(app.get("serve_ms", 3000))
    dev.flush()
    print("IGGY-DONE " + json.dumps(dev.diag()))
except (ValueError, MemoryError) as e:
    print("IGGY-RAISED", repr(e))
"""


def _board(tmp_path: Path, broker: Broker, dev: str, heap: str, **cfg: Any) -> tuple[Flash, Board]:
    flash = Flash(tmp_path / "flash")
    flash.root.mkdir(parents=True, exist_ok=True)
    flash.install_library(mpy=True)
    (flash.root / "main.py").write_text(DEVICE_MAIN)
    conf = board_config(broker.host, broker.port, dev, receipts=True, ntp=False, wdt_ms=0, **cfg)
    (flash.root / "config.json").write_text(json.dumps({"wifi_ssid": "lab", **conf}))
    return flash, Board(flash, heapsize=heap).start()


def _command(broker: Broker, dev: str, cid: str, blob: int = 0) -> None:
    doc = {"id": cid, "name": "echo", "args": {"blob": "b" * blob}}
    mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps(doc))


# -- 1. a MemoryError during a publish's PUBACK wait, receipts on -----------------
def test_a_memory_error_while_a_large_message_arrives_does_not_escape_publish(
    broker: Broker, tmp_path: Path
) -> None:
    dev = unique_device_id("oom-pub")
    responder = ReceiptResponder(broker)
    acks = MqttLog(broker, f"edge/{dev}/up/ack", tmp_path, f"acks-{dev}")
    try:
        flash, board = _board(
            tmp_path, broker, dev, "96k", app={"mode": "publish_oom", "free": 1536, "serve_ms": 4000}
        )
        wait_console(board, "IGGY-READY on", what="the board past the receipt gate")
        _command(broker, dev, "big-1", blob=3000)  # larger than what the board leaves free
        flash.path("go").write_text("")
        assert board.wait(60) == 0, board.console()[-3000:]
        console = board.console()
        assert "IGGY-PUBLISH caught" in console, console[-3000:]
        assert "IGGY-DONE" in console, console[-3000:]
        # not acknowledged while it could not be read: the broker sent it
        # again after the reconnect, and it ran
        acks.wait_for(lambda m: any(d["id"] == "big-1" for d in m.json("/up/ack")), 20, "the command's ack")
        assert board.done()["bad_messages"] >= 1  # the MemoryError, counted
    finally:
        acks.stop()
        responder.close()


# -- 2. large commands on a fragmented heap: refused, never acknowledged and lost -----
def test_large_commands_on_a_fragmented_heap_are_all_answered(broker: Broker, tmp_path: Path) -> None:
    dev = unique_device_id("frag")
    responder = ReceiptResponder(broker)
    acks = MqttLog(broker, f"edge/{dev}/up/ack", tmp_path, f"acks-{dev}")
    n = 6
    try:
        flash, board = _board(
            tmp_path,
            broker,
            dev,
            "160k",
            app={"mode": "fragmented", "hole": 4600, "serve_ms": 6000},
            inbox_bytes=4096,
        )
        wait_console(board, "IGGY-READY on", what="the board past the receipt gate")
        for i in range(n):
            _command(broker, dev, f"frag-{i}", blob=3900)
        flash.path("go").write_text("")
        assert board.wait(90) == 0, board.console()[-3000:]
        assert "IGGY-FRAGMENTED" in board.console()
        acks.wait_for(
            lambda m: len({d["id"] for d in m.json("/up/ack")}) >= n, 20, "an answer to every command"
        )
        answered = {d["id"]: d for d in acks.json("/up/ack")}
        # the heap stays fragmented: refused by name (the old code acknowledged and lost them)
        assert any(d["status"] == "error" for d in answered.values())
        assert set(answered) == {f"frag-{i}" for i in range(n)}
        # each ran, or was refused by name: none acknowledged to the broker and lost
        assert all(d["status"] == "ok" or d.get("error") == "out of memory" for d in answered.values()), (
            answered
        )
    finally:
        acks.stop()
        responder.close()


def test_a_command_the_heap_never_has_a_block_for_is_refused_not_taken_at_every_connect(
    broker: Broker, tmp_path: Path
) -> None:
    # no free block as large as the command, ever: the old code dropped the
    # connection at each delivery (not acknowledged, so the broker sent it
    # again at the next connect, and again): the board never got a session
    # up and the command was never answered
    dev = unique_device_id("nohole")
    responder = ReceiptResponder(broker)
    acks = MqttLog(broker, f"edge/{dev}/up/ack", tmp_path, f"acks-{dev}")
    n = 2
    try:
        flash, board = _board(
            tmp_path,
            broker,
            dev,
            "160k",
            app={"mode": "no_block", "hole": 1024, "serve_ms": 6000},
            inbox_bytes=4096,
        )
        wait_console(board, "IGGY-READY on", what="the board past the receipt gate")
        for i in range(n):
            _command(broker, dev, f"big-{i}", blob=3900)
        flash.path("go").write_text("")
        assert board.wait(90) == 0, board.console()[-3000:]
        assert "IGGY-FRAGMENTED" in board.console()
        acks.wait_for(
            lambda m: len({d["id"] for d in m.json("/up/ack")}) >= n, 20, "an answer to every command"
        )
        answered = {d["id"]: d for d in acks.json("/up/ack")}
        assert answered == {
            f"big-{i}": {"id": f"big-{i}", "status": "error", "error": "out of memory"} for i in range(n)
        }
        assert board.done()["bad_messages"] >= n
    finally:
        acks.stop()
        responder.close()


# -- 5. a command reply longer than a ring segment (battery boards: 1 KiB) ----------
def test_a_reply_longer_than_a_ring_segment_is_sent_as_its_status(broker: Broker, tmp_path: Path) -> None:
    dev = unique_device_id("longreply")
    responder = ReceiptResponder(broker)
    acks = MqttLog(broker, f"edge/{dev}/up/ack", tmp_path, f"acks-{dev}")
    try:
        flash, board = _board(
            tmp_path,
            broker,
            dev,
            "160k",
            segment_bytes=1024,
            ring_bytes=16384,
            app={"mode": "plain", "reply": 1500, "serve_ms": 2000},
        )
        wait_console(board, "IGGY-READY on", what="the board past the receipt gate")
        _command(broker, dev, "long-1")
        flash.path("go").write_text("")
        assert board.wait(60) == 0, board.console()[-3000:]
        assert "IGGY-RAISED" not in board.console(), board.console()[-3000:]
        acks.wait_for(lambda m: len(m.json("/up/ack")) >= 1, 20, "the ack")
        (ack,) = acks.json("/up/ack")
        assert ack == {"id": "long-1", "status": "ok", "result": "(result too long to keep)"}
    finally:
        acks.stop()
        responder.close()


# -- 3. battery boards and a gateway that sends no receipts -------------------------
def test_a_battery_board_uploads_to_a_gateway_without_receipts_and_waits_only_once(
    broker: Broker, tmp_path: Path
) -> None:
    dev = unique_device_id("norcpt")
    log = MqttLog(broker, f"edge/{dev}/up/battery", tmp_path, f"sub-{dev}")
    try:
        flash = Flash(tmp_path / "flash")
        # the shipped relation: a wake's flush budget (awake_ms x 4) is
        # shorter than receipt_timeout_ms (6 s and 15 s; here 1.2 s and 3 s)
        flash.install_example(
            "battery_sensor",
            **board_config(
                broker.host,
                broker.port,
                dev,
                receipts=True,
                period_ms=60000,
                upload_every=1,
                awake_ms=300,
                receipt_timeout_ms=3000,
                awake_budget_ms=20000,
            ),
        )
        board = Board(flash)
        took = []
        for _ in range(3):
            t0 = time.monotonic()
            board.start()
            assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
            took.append(time.monotonic() - t0)
        log.wait_for(lambda m: len(m.json("/up/battery")) >= 3, 10, "the three readings")
        assert sorted({d["wake"] for d in log.json("/up/battery")}) == [0, 1, 2]
        # the first wake waited for the fallback, the later ones did not
        assert took[0] > 3.0, took
        assert max(took[1:]) < 3.0, took
        assert board.console().count("receipts: none") == 1
    finally:
        log.stop()


# -- 4. the clock is re-synced on a schedule, across deep sleep ----------------------
def test_the_clock_is_resynced_every_ntp_every_s_across_deep_sleep(broker: Broker, tmp_path: Path) -> None:
    dev = unique_device_id("ntp")
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "battery_sensor",
        **board_config(
            broker.host,
            broker.port,
            dev,
            period_ms=60000,
            upload_every=1,
            awake_ms=100,
            ntp=True,
            ntp_every_s=2,
        ),
    )
    board = Board(flash)

    def wake() -> list[str]:
        board.start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
        return flash.text("_hw_ntp.log").split("\n")[:-1]

    # the Unix port's clock is set (the host's): the old code never synced it again
    assert wake() == ["127.0.0.1 ok"]  # the first connect: the broker serves time
    synced = time.time()
    assert len(wake()) == 1  # within ntp_every_s: no second sync
    # the board sleeps past ntp_every_s (its clock is the host's)
    wait_until(lambda: time.time() > synced + 2.5, 5, what="ntp_every_s to pass")
    assert len(wake()) == 2  # due again after a deep sleep longer than ntp_every_s
