"""The device library against networks and brokers that misbehave, under
the real MicroPython Unix port with the real umqtt.simple (1.3.4, the
oldest release firmware freezes): a peer that accepts TCP and never
answers, a broker that goes silent behind an open connection, WiFi that
goes away while connected, inbound messages too big for the heap, and more
commands queued for a sleeping board than its inbox holds."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.device.peers import freezable_proxy, silent_peer
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
    run_script,
    unique_device_id,
    wait_console,
)

pytestmark = pytest.mark.micropython

CONNACK = b"\x20\x02\x00\x00"  # session not present, accepted


@pytest.fixture(autouse=True)
def _needs_micropython() -> None:
    require_micropython()


def _config(port: int, device_id: str, **extra: Any) -> dict[str, Any]:
    # every step gives up after wdt_ms/3 = 1 s
    return board_config("127.0.0.1", port, device_id, **{"wdt_ms": 3000, **extra})


# -- 1. every blocking step of the connect is bounded -------------------------------


@pytest.mark.parametrize("answer", [b"", CONNACK], ids=["no-connack", "connack-then-silence"])
def test_battery_sensor_reaches_deep_sleep_when_the_broker_never_answers(
    tmp_path: Path, answer: bytes
) -> None:
    with silent_peer(answer) as peer:
        flash = Flash(tmp_path / "flash")
        flash.install_example(
            "battery_sensor", **_config(peer.port, unique_device_id("mute"), upload_every=1, awake_ms=300)
        )
        board = Board(flash).start()
        assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
        assert peer.accepted >= 1
    console = board.console()
    assert "mqtt connect failed: OSError(110" in console  # timed out, not refused
    assert flash.text("_hw_sleeps.log").split() == ["300000"]
    assert "watchdog starved" not in console


def test_env_sensor_keeps_reading_while_the_broker_never_answers(tmp_path: Path) -> None:
    with silent_peer() as peer:
        flash = Flash(tmp_path / "flash")
        flash.install_example(
            "env_sensor", **_config(peer.port, unique_device_id("mute-env"), period_ms=100, cycles=30)
        )
        board = Board(flash).start()
        assert board.wait(60) == 0, board.console()[-3000:]
        accepted = peer.accepted
    done = board.done()
    assert done["cycles"] == 30
    assert done["buffered"] == 30  # every reading kept in the flash ring
    assert done["conn_failures"] >= 2
    assert accepted >= 2  # it tried again after each timeout
    assert board.console().count("mqtt connect failed: OSError(110") >= 2


# -- 2. oversized inbound messages ------------------------------------------------------


def test_a_60kb_retained_config_is_refused_unread_in_a_small_heap(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("bigcfg")
    log = subscribe(dev)
    huge = json.dumps({"period_ms": 150, "pad": "x" * 60000})
    mqtt_publish(broker, f"edge/{dev}/down/config", huge, retain=True)
    flash = Flash(tmp_path / "flash")
    flash.install_example("env_sensor", **_config(broker.port, dev, period_ms=20, cycles=20))
    flash.install_library(mpy=True)
    flash.compile_app()
    board = Board(flash, heapsize=ESP32_HEAP)
    for boot in range(2):  # retained: it comes again at every boot
        board.start()
        assert board.wait(60) == 0, board.console()[-3000:]
        done = board.done()
        assert done["bad_messages"] == 1, done  # the refused one, counted
        assert done["cycles"] == 20
        assert "out of memory" not in board.console()
        assert board.console().count("mqtt: refused a 60") == boot + 1
    assert "period_ms -> 150" not in board.console()
    assert not flash.path("data/desired.json").exists()
    log.wait_for(lambda m: len(m.json("/up/env")) >= 40, 20, "the readings of both boots")
    env = [int(d["seq"]) for d in log.json("/up/env")]
    assert len(env) == len(set(env)) == 40
    # a config that fits still applies afterwards
    mqtt_publish(broker, f"edge/{dev}/down/config", json.dumps({"period_ms": 150}), retain=True)
    board.start()
    assert board.wait(60) == 0, board.console()[-3000:]
    assert "config: period_ms -> 150" in board.console()
    assert board.done()["bad_messages"] == 0


_STEPS = """
from iggy_device import wire
from umqtt import simple

wire.max_payload = 1 << 20  # allowed: the heap, not the bound, refuses it
wire.feed = lambda: None
simple.socket = wire  # as node.py does
c = simple.MQTTClient("PEER", "127.0.0.1", PORT)
c.set_callback(lambda t, m: print("MSG", t, len(m)))
c.connect()
c.subscribe(b"oos/#", 0)
for _ in range(3):
    try:
        c.wait_msg()
        print("STEP read")
    except MemoryError:
        print("STEP MemoryError")  # what a handler that keeps the session sees
    except OSError as e:
        print("STEP OSError", e)
        break
"""


def test_a_message_the_heap_cannot_take_ends_the_stream_its_payload_is_never_framed_as_a_packet(
    broker: Broker, tmp_path: Path
) -> None:
    # A PUBLISH the heap has no block for fails before a byte of its payload
    # is read.  The payload is still on the socket: read on, it would be
    # framed as the next packet -- here a forged PUBLISH at its start, on a
    # real board a command.  After the MemoryError the next read must fail
    # (the caller reconnects; the broker sends the message again as DUP,
    # which wire.py cuts), whichever handler caught the error.
    forged = b"\x30\x10\x00\x08oos/evilFORGED"  # PUBLISH, QoS 0, topic oos/evil
    payload = tmp_path / "payload"
    payload.write_bytes(forged + b"\xd0\x00" * 100_000)  # then PINGRESPs: 200 kB, over the heap
    pub = ["mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-t", "oos/big", "-r", "-q", "1"]
    subprocess.run(
        [*pub, "-f", str(payload)],
        check=True,
        timeout=10,
    )
    flash = Flash(tmp_path / "flash")
    peer = unique_device_id("oos")
    out = run_script(_STEPS.replace("PEER", peer).replace("PORT", str(broker.port)), flash, heapsize="96k")
    steps = [line for line in out.stdout.splitlines() if line.startswith(("STEP", "MSG"))]
    assert steps[0] == "STEP MemoryError", out.stdout + out.stderr
    assert steps[1].startswith("STEP OSError"), out.stdout + out.stderr
    assert "evil" not in out.stdout


def test_an_oversized_command_is_refused_and_acknowledged_the_next_one_runs(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("bigcmd")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example("actuator", **_config(broker.port, dev, period_ms=60000))
    board = Board(flash).start()
    try:
        wait_console(board, "[iggy] connected to")
        # an empty payload, alone: reading it must not wait for the next packet
        mqtt_publish(broker, f"edge/{dev}/down/cmd", "")
        wait_console(board, "bad command: payload is not JSON")
        big = {"id": "big", "name": "set_relay", "args": {"on": True, "pad": "x" * 5000}}  # over 4096
        mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps(big))
        ok = {"id": "small", "name": "get_state", "args": {}}
        mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps(ok))
        log.wait_for(lambda m: [a["id"] for a in m.json("/up/ack")] == ["small"], 20, "the small one's ack")
        wait_console(board, "mqtt: refused a 50")
        # a power cut and a reboot: the refused one was acknowledged to the
        # broker (it can never fit), so it is not sent again
        board.stop()
        board.start()
        wait_console(board, "[iggy] connected to", 2)
        mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps({"id": "after", "name": "get_state"}))
        log.wait_for(lambda m: len(m.json("/up/ack")) >= 2, 20, "the ack after the reboot")
    finally:
        board.stop()
    assert [a["id"] for a in log.json("/up/ack")] == ["small", "after"]
    assert board.console().count("mqtt: refused") == 1
    assert "connection lost" not in board.console()
    assert ("26", 1) not in flash.pins()  # the oversized set_relay never ran


# -- 5. more commands queued for a sleeping board than its inbox holds ------------------


@pytest.mark.parametrize("inbox_bytes", [None, 1024], ids=["default-inbox", "1k-inbox"])
def test_thirty_commands_queued_for_a_sleeping_board_all_run(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog], inbox_bytes: int | None
) -> None:
    dev = unique_device_id("queue")
    log = subscribe(dev)
    extra = {} if inbox_bytes is None else {"inbox_bytes": inbox_bytes}
    flash = Flash(tmp_path / "flash")
    flash.install_example(
        "battery_sensor", **_config(broker.port, dev, upload_every=1, awake_ms=500, period_ms=60000, **extra)
    )
    board = Board(flash)
    board.start()  # the first wake makes the broker keep a session for it
    assert board.wait(30) == DEEPSLEEP_EXIT, board.console()[-3000:]
    ids = [f"q-{i:02d}" for i in range(30)]
    for i, cid in enumerate(ids):
        cmd = {"id": cid, "name": "set_period", "args": {"period_ms": 1000 + i}}
        mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps(cmd))
    for _ in range(4):
        board.start()
        assert board.wait(60) == DEEPSLEEP_EXIT, board.console()[-3000:]
        if {a["id"] for a in log.json("/up/ack")} >= set(ids):
            break
    log.wait_for(lambda m: {a["id"] for a in m.json("/up/ack")} >= set(ids), 10, "an ack for each of the 30")
    acks = log.json("/up/ack")
    assert all(a["status"] == "ok" for a in acks)
    # each ran once (a redelivered one is acknowledged again, not run again)
    first: dict[str, Any] = {}
    for a in acks:
        first.setdefault(a["id"], a)
    assert [first[c]["result"]["period_ms"] for c in ids] == [1000 + i for i in range(30)]
    if inbox_bytes is not None:
        assert "inbox full: reconnecting for the rest" in board.console() or "connection lost: InboxFull" in (
            board.console()
        )


# -- 7. liveness --------------------------------------------------------------------------


def test_a_silent_broker_is_detected_from_the_missing_pingresp(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("deaf")
    log = subscribe(dev)
    with freezable_proxy(broker.port) as proxy:
        flash = Flash(tmp_path / "flash")
        # quiet: nothing to send for a minute; keepalive 4 s: a PINGREQ after 2 s
        flash.install_example("actuator", **_config(proxy.port, dev, period_ms=60000, keepalive=4))
        board = Board(flash).start()
        try:
            wait_console(board, "[iggy] connected to")
            # the board sends its one buffered record at connect and waits
            # for its PUBACK: freezing before that PUBACK passes the proxy
            # detects the silence on that wait, not from the PINGRESP
            log.wait_for(lambda m: len(m.messages()) >= 1, 10, "the buffered record on the broker")
            time.sleep(1.0)  # its PUBACK through the proxy; the PINGREQ is due 2 s after it
            proxy.freeze()
            # bound: keepalive/2 (2 s) + the step timeout (1 s) + one poll
            wait_console(board, "no PINGRESP within 1000 ms", timeout=10)
            wait_console(board, "mqtt connect failed: OSError(110", timeout=10)  # still silent
            proxy.thaw()
            wait_console(board, "[iggy] connected to", 2, timeout=20)
            mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps({"id": "c-1", "name": "get_state"}))
            log.wait_for(lambda m: len(m.json("/up/ack")) == 1, 20, "the ack after the broker came back")
        finally:
            board.stop()


def test_wifi_loss_while_connected_is_noticed_and_the_driver_reconnects_by_itself(
    broker: Broker, tmp_path: Path, subscribe: Callable[[str], MqttLog]
) -> None:
    dev = unique_device_id("wifi-drop")
    log = subscribe(dev)
    flash = Flash(tmp_path / "flash")
    flash.install_example("actuator", **_config(broker.port, dev, period_ms=60000, wifi_timeout_ms=500))
    board = Board(flash).start()
    try:
        wait_console(board, "[iggy] connected to")
        flash.path("_hw_wifi_down").write_text("")
        wait_console(board, "wifi: link lost", timeout=10)
        wait_console(board, "wifi connect failed", timeout=10)
        flash.path("_hw_wifi_down").unlink()
        wait_console(board, "[iggy] connected to", 2)
        mqtt_publish(broker, f"edge/{dev}/down/cmd", json.dumps({"id": "c-1", "name": "get_state"}))
        log.wait_for(lambda m: len(m.json("/up/ack")) == 1, 20, "the ack after WiFi came back")
    finally:
        board.stop()
    # the library asked the driver to connect once and then left its own
    # reconnect alone (disconnect() would have cancelled it)
    assert flash.text("_hw_wifi.log").split() == ["connect"]


def test_wifi_attempts_do_not_hold_up_readings(tmp_path: Path) -> None:
    flash = Flash(tmp_path / "flash")
    # the default wifi_timeout_ms (15 s) and no access point at all
    flash.install_example(
        "env_sensor", **_config(1, unique_device_id("no-ap"), period_ms=50, cycles=40, wdt_ms=0)
    )
    flash.path("_hw_wifi_down").write_text("")
    board = Board(flash).start()
    # 40 readings 50 ms apart take 2 s; one blocking WiFi attempt alone 15 s
    assert board.wait(12) == 0, board.console()[-3000:]
    done = board.done()
    assert done["cycles"] == 40
    assert done["buffered"] == 40
