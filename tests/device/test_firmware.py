"""The firmware examples under the real MicroPython Unix port, with the real
umqtt.simple, against a real Mosquitto.  Only hardware is stood in for
(tests/device/stubs); the flash is a temp directory that survives restarts
of the process, as flash survives a reset."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.support.broker import Broker
from tests.support.micropython import (
    DEEPSLEEP_EXIT,
    ESP32_HEAP,
    Board,
    Flash,
    MqttLog,
    board_config,
    mqtt_publish,
    require_micropython,
    unique_device_id,
    wait_console,
)

pytestmark = pytest.mark.micropython


@pytest.fixture(autouse=True)
def _needs_micropython() -> None:
    require_micropython()


def _seq_of(docs: list[dict[str, Any]]) -> list[int]:
    return [int(d["seq"]) for d in docs]


def _first_arrivals(seqs: list[int]) -> list[int]:
    """Each seq where it first arrived.  Across a broker restart the test's
    own subscriber (mosquitto_sub, QoS1, persistent session) is sent again
    what was in flight to it when the broker stopped, so its log can read
    [.., 20, 21, 22, 21, 22, 23, ..]: at least once, not out of order (seen
    under load; the agent stores such copies once, see test_end_to_end_agent)."""
    return list(dict.fromkeys(seqs))


# What the library prints once it is connected and subscribed (umqtt.simple's
# subscribe() returns after the SUBACK).
CONNECTED = "[iggy] connected to"


def _outage(broker: Broker, flash: Flash, log: MqttLog, dev: str, seconds: float) -> None:
    """Take the broker away for ``seconds`` while the device keeps reading.

    Before the broker comes back the device's WiFi is held down until the
    test's subscriber has re-subscribed, so what the device drains cannot
    slip past a subscriber that is still reconnecting (the broker does not
    necessarily persist the subscriber's session: see the report).
    """
    broker.stop()
    time.sleep(seconds)
    flash.path("_hw_wifi_down").write_text("")
    broker.start()
    deadline = time.monotonic() + 20
    while not log.messages("/probe"):
        assert time.monotonic() < deadline, "subscriber did not come back"
        mqtt_publish(broker, f"edge/{dev}/probe", "x")
        time.sleep(0.3)
    flash.path("_hw_wifi_down").unlink()


def _run_env(
    broker: Broker, subscribe: Callable[[str], MqttLog], root: Path, dev: str, cycles: int
) -> tuple[Board, MqttLog]:
    log = subscribe(dev)
    flash = Flash(root / dev)
    flash.install_example(
        "env_sensor", **board_config(broker.host, broker.port, dev, period_ms=0, cycles=cycles)
    )
    flash.install_library(mpy=True)
    flash.compile_app()
    board = Board(flash, heapsize=ESP32_HEAP).start()
    assert board.wait(120) == 0, board.console()[-3000:]
    log.wait_for(lambda m: len(m.json("/up/env")) >= cycles, 20, f"{cycles} readings")
    return board, log


def test_env_sensor_runs_thousands_of_cycles_in_an_esp32_sized_heap(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    short_board, _ = _run_env(broker, subscribe, tmp_path, unique_device_id("heap-short"), 300)
    dev = unique_device_id("heap")
    board, log = _run_env(broker, subscribe, tmp_path, dev, 3000)
    env = log.json("/up/env")
    seqs = _seq_of(env)
    assert len(seqs) == 3000
    assert seqs == sorted(set(seqs))  # each once, in order
    assert all(d["sim"] == 1 for d in env)  # no sensor answers on the stand-in bus
    done = board.done()
    assert done["cycles"] == 3000
    assert done["dropped"] == 0
    # steady state: ten times the cycles, (almost) no more heap
    growth = done["heap_alloc"] - short_board.done()["heap_alloc"]
    assert growth < 1024, f"heap grew by {growth} bytes between 300 and 3000 cycles"
    status = [p for t, p in log.messages("/status")]
    assert status[0] == "online"
    assert status[-1] == "offline"  # a clean shutdown says so before disconnecting


def test_broker_outage_readings_arrive_afterwards_oldest_first_none_lost(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("outage")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor", **board_config(broker.host, broker.port, dev, period_ms=20, wifi_timeout_ms=100)
    )
    board = Board(flash).start()
    try:
        log.wait_for(lambda m: len(m.json("/up/env")) >= 20, 20, "readings before the outage")
        _outage(broker, flash, log, dev, 2.0)  # about 100 readings go to the flash ring
        before = len(log.json("/up/env"))
        log.wait_for(lambda m: len(m.json("/up/env")) >= before + 150, 30, "readings after")
        # the new session's diag queues behind what was buffered (WiFi joins
        # without blocking, so readings go on while it is held down)
        log.wait_for(lambda m: any(d["connects"] >= 2 for d in m.json("/up/diag")), 30, "the second diag")
    finally:
        board.stop()
    seqs = _seq_of(log.json("/up/env"))
    diag_seqs = _seq_of(log.json("/up/diag"))
    # at-least-once: a publish cut by the outage, or a delivery in flight to
    # the subscriber, may come twice; what arrives first is in order
    first = _first_arrivals(seqs)
    assert first == sorted(first), seqs
    everything = set(seqs) | set(diag_seqs)
    assert everything == set(range(max(everything) + 1)), "a reading was lost"
    diags = log.json("/up/diag")
    assert diags[-1]["dropped"] == 0
    assert diags[-1]["connects"] >= 2
    assert "connection lost" in board.console()
    assert "mqtt connect failed: OSError(111" in board.console()  # refused: broker away


def test_ring_overflow_during_an_outage_drops_oldest_and_reports_the_count(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("overflow")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    # 4 segments of 512 bytes: about 16 readings fit
    flash.install_example(
        "env_sensor",
        **board_config(
            broker.host,
            broker.port,
            dev,
            period_ms=20,
            ring_bytes=2048,
            segment_bytes=512,
            wifi_timeout_ms=100,
        ),
    )
    board = Board(flash).start()
    try:
        log.wait_for(lambda m: len(m.json("/up/env")) >= 5, 20, "first readings")
        _outage(broker, flash, log, dev, 2.0)  # about 100 readings: far more than fit
        log.wait_for(lambda m: any(d["dropped"] > 0 for d in m.json("/up/diag")), 30, "a drop report")
        time.sleep(0.5)
    finally:
        board.stop()
    env = _seq_of(log.json("/up/env"))
    diags = log.json("/up/diag")
    seen = set(env) | set(_seq_of(diags))
    missing = set(range(max(seen) + 1)) - seen
    reported = max(d["dropped"] for d in diags)
    assert reported > 0
    assert len(missing) == reported, (sorted(missing), reported)
    # what was dropped is one run of the oldest buffered readings
    assert sorted(missing) == list(range(min(missing), max(missing) + 1))
    first = _first_arrivals(env)
    assert first == sorted(first), env


def test_actuator_executes_a_command_once_and_acks_redeliveries(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("relay")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example("actuator", **board_config(broker.host, broker.port, dev, period_ms=500))
    board = Board(flash).start()
    cmd_topic = f"edge/{dev}/down/cmd"

    def acks() -> list[dict[str, Any]]:
        return log.json("/up/ack")

    def send(doc: dict[str, Any], n_acks: int) -> dict[str, Any]:
        mqtt_publish(broker, cmd_topic, json.dumps(doc))
        log.wait_for(lambda m: len(acks()) >= n_acks, 20, f"ack #{n_acks}")
        return acks()[n_acks - 1]

    try:
        log.wait_for(lambda m: ("edge/" + dev + "/status", "online") in m.messages(), 20, "online")
        wait_console(board, CONNECTED, 1, "subscribed")
        on = {"id": "c-1", "name": "set_relay", "args": {"on": True}, "expires_at": None}
        first = send(on, 1)
        assert first["id"] == "c-1"
        assert first["status"] == "ok"
        assert first["result"]["relay"] == 1
        again = send(on, 2)  # the same id again: a redelivery
        assert again == first
        assert flash.pins().count(("26", 1)) == 1  # the relay switched once

        assert send({"id": "c-2", "name": "self_destruct", "args": {}}, 3) == {
            "id": "c-2",
            "status": "unknown_command",
            "error": "self_destruct",
        }
        expired = {"id": "c-3", "name": "set_relay", "args": {"on": False}, "expires_at": 1}
        assert send(expired, 4)["status"] == "expired"
        bad = send({"id": "c-4", "name": "set_relay", "args": {"on": "yes"}}, 5)
        assert bad["status"] == "error"
        assert "true or false" in bad["error"]
        assert ("26", 0) not in flash.pins()[1:]  # neither switched the relay off
        blink = send({"id": "c-5", "name": "blink", "args": {"times": 2, "ms": 20}}, 6)
        assert blink["status"] == "ok"
        assert flash.pins().count(("2", 1)) == 2

        # power cut, reboot: the id is remembered in flash
        board.stop()
        pins_before = len(flash.pins())
        board.start()
        log.wait_for(lambda m: [p for t, p in m.messages("/status")].count("online") >= 2, 20, "reboot")
        wait_console(board, CONNECTED, 2, "subscribed again")
        assert send(on, 7) == first
        after = flash.pins()[pins_before:]
        assert after == [("26", 1), ("2", 0)]  # only the restore at boot
    finally:
        board.stop()
    states = log.json("/up/state")
    assert [d["switches"] for d in states if d["switches"]][:1] == [1]


def test_battery_sensor_keeps_buffer_and_sequence_across_deep_sleeps(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("batt")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "battery_sensor",
        **board_config(broker.host, broker.port, dev, upload_every=3, awake_ms=300, period_ms=60000),
    )
    board = Board(flash)
    for wake in range(6):
        if wake == 3:
            # queued by the broker for the sleeping device (persistent session)
            mqtt_publish(
                broker,
                f"edge/{dev}/down/cmd",
                json.dumps({"id": "p-1", "name": "set_period", "args": {"period_ms": 5000}}),
            )
        board.start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-2000:]
        if wake == 1:
            assert log.json("/up/battery") == []  # still only in flash
        if wake == 2:
            log.wait_for(lambda m: len(m.json("/up/battery")) == 3, 10, "first upload")
    log.wait_for(lambda m: len(m.json("/up/battery")) == 6, 10, "second upload")
    readings = log.json("/up/battery")
    assert [d["wake"] for d in readings] == [0, 1, 2, 3, 4, 5]
    seqs = _seq_of(readings)
    assert seqs == sorted(seqs)
    # no gaps across six resets: the next number waits in RTC memory during
    # deep sleep (the diag message of each upload takes a number too)
    everything = sorted(seqs + _seq_of(log.json("/up/diag")))
    assert everything == list(range(len(everything)))
    assert flash.text("data/seq") == "64"  # one flash write for all of it
    assert readings[0]["mv"] > 0
    log.wait_for(lambda m: len(m.json("/up/ack")) == 1, 10, "ack of the queued command")
    assert log.json("/up/ack")[0] == {"id": "p-1", "status": "ok", "result": {"period_ms": 5000}}
    sleeps = flash.text("_hw_sleeps.log").split()
    assert sleeps == ["60000"] * 5 + ["5000"]


def test_retained_config_is_applied_persisted_and_reapplied_at_boot(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("cfg")
    mqtt_publish(broker, f"edge/{dev}/down/config", json.dumps({"period_ms": 150}), retain=True)
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor", **board_config(broker.host, broker.port, dev, period_ms=50, cycles=15)
    )
    board = Board(flash).start()
    assert board.wait(30) == 0, board.console()
    assert "config: period_ms -> 150" in board.console()
    assert json.loads(flash.text("data/desired.json")) == {"period_ms": 150}
    broker.stop()  # next boot has no broker: the persisted copy still applies
    board.start()
    wait_console(board, "config: period_ms -> 150", 2, "the persisted config applied at boot")
    board.stop()


def test_wifi_away_then_back_buffers_and_backs_off(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("wifi")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "env_sensor", **board_config(broker.host, broker.port, dev, period_ms=50, wifi_timeout_ms=100)
    )
    flash.path("_hw_wifi_down").write_text("")  # no access point
    board = Board(flash).start()
    try:
        wait_console(board, "wifi connect failed", 3, "three failed WiFi attempts")
        assert log.json("/up/env") == []
        flash.path("_hw_wifi_down").unlink()
        log.wait_for(lambda m: len(m.json("/up/env")) >= 40, 20, "readings after WiFi returns")
    finally:
        board.stop()
    seqs = _seq_of(log.json("/up/env"))
    assert seqs == sorted(set(seqs))
    assert seqs[0] == 0  # the readings taken without WiFi were kept
    retries = [
        int(line.rsplit("retry in", 1)[1].split()[0])
        for line in board.console().splitlines()
        if "wifi connect failed" in line
    ]
    assert len(retries) >= 3
    assert max(retries) <= 800
    assert retries[-1] >= retries[0]  # the delay grows toward the cap
