"""Delivery receipts from a running agent (receipts.py): real Mosquitto, the
agent in process, MemoryIggy; the "devices" here are plain MQTT clients, so
each test sees the wire exactly (the device library's side is in
tests/device/test_receipts_device.py)."""

from __future__ import annotations

import asyncio
import json
import time
import zlib
from pathlib import Path
from typing import Any

import gmqtt
import pytest
from gmqtt.mqtt.constants import MQTTv311
from iggy_edge.cli.main import app as cli
from iggy_edge.config import ConfigError, ReceiptSettings, parse_config
from iggy_edge.httpd import http_endpoint
from iggy_edge.metrics import Metrics
from iggy_edge.receipts import Receipts
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.ports import free_port
from tests.support.wait import async_wait_until


class Device:
    """An MQTT client publishing readings as the device library does and
    collecting the receipts it gets (with their retain flag)."""

    def __init__(self, broker: Broker, dev: str) -> None:
        self.dev = dev
        self.receipts: list[tuple[dict[str, Any], bool]] = []
        self.arrivals: list[float] = []  # monotonic, one per receipt
        self.client = gmqtt.Client(f"{dev}-test", clean_session=True)
        self.client.on_message = self._on_message
        self._broker = broker

    def _on_message(self, client: Any, topic: str, payload: bytes, qos: int, props: dict[str, Any]) -> int:
        self.receipts.append((json.loads(payload), bool(props.get("retain"))))
        self.arrivals.append(time.monotonic())
        return 0

    async def connect(self) -> Device:
        await self.client.connect(self._broker.host, self._broker.port, version=MQTTv311)
        self.client.subscribe(f"edge/{self.dev}/down/receipt", qos=0)
        await asyncio.sleep(0.1)
        return self

    def reading(self, seq: int) -> bytes:
        return json.dumps({"seq": seq, "ts": 1700000000 + seq, "v": seq % 7}, separators=(",", ":")).encode()

    def publish(self, seq: int) -> bytes:
        payload = self.reading(seq)
        self.client.publish(f"edge/{self.dev}/up/env", payload, qos=1)
        return payload

    def last(self) -> dict[str, Any] | None:
        return self.receipts[-1][0] if self.receipts else None

    async def close(self) -> None:
        await self.client.disconnect()


def _env(iggy: MemoryIggy, dev: str) -> list[int]:
    if ("edge", "telemetry") not in iggy.topics:
        return []
    out = []
    for p in range(3):
        for m in iggy.messages("edge", "telemetry", p):
            if m.headers["mqtt-topic"] == f"edge/{dev}/up/env":
                out.append(int(m.headers["device-seq"]))
    return out


async def test_receipt_names_the_newest_committed_reading_throttled(tmp_path: Path, broker: Broker) -> None:
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker, receipts={"min_interval_ms": 300})
    async with running_agent(settings, iggy.uplink()) as agent:
        dev = await Device(broker, "rc-a").connect()
        started = time.monotonic()
        payloads = []
        for i in range(50):  # spread over about 1 s: unthrottled, that is a receipt per commit
            payloads.append(dev.publish(i))
            await asyncio.sleep(0.02)
        await async_wait_until(lambda: dev.last() == {"seq": 49, "crc": zlib.crc32(payloads[49])}, 10)
        elapsed = time.monotonic() - started
        await asyncio.sleep(0.5)  # nothing more comes: the trailing receipt was the last
        sent = agent.metrics.value("iggy_edge_receipts_sent_total")
        lag_count = agent.metrics.value("iggy_edge_receipts_lag_seconds_count")
        await dev.close()
    assert _env(iggy, "rc-a") == list(range(50))
    # at most one per 300 ms window (plus the first), and the last covers seq 49
    assert 1 <= len(dev.receipts) <= 2 + elapsed / 0.3, (len(dev.receipts), elapsed)
    assert len(dev.receipts) < 50
    # the throttle itself, independent of how long the run took: receipts
    # come min_interval_ms (300) apart, less what delivery jitter takes off
    gaps = [b - a for a, b in zip(dev.arrivals, dev.arrivals[1:], strict=False)]
    assert all(g >= 0.15 for g in gaps), gaps
    assert sent == len(dev.receipts) == lag_count
    seqs = [r["seq"] for r, _ in dev.receipts]
    assert seqs == sorted(seqs)
    assert all(retained is False for _, retained in dev.receipts)  # live deliveries


async def test_resent_readings_without_dup_are_stored_once_and_receipted_again(
    tmp_path: Path, broker: Broker
) -> None:
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings, iggy.uplink()) as agent:
        dev = await Device(broker, "rc-b").connect()
        payloads = [dev.publish(i) for i in range(10)]
        await async_wait_until(lambda: dev.last() == {"seq": 9, "crc": zlib.crc32(payloads[9])}, 10)
        await asyncio.sleep(0.3)
        dev.receipts.clear()
        for i in range(5, 10):  # what a device re-sends after a reconnect: new publishes, no DUP
            dev.publish(i)
        dev.publish(10)
        await async_wait_until(lambda: dev.last() is not None and dev.last()["seq"] == 10, 10)  # type: ignore[index]
        copies = agent.metrics.value("iggy_edge_ingest_known_copies_total")
        await dev.close()
    assert _env(iggy, "rc-b") == list(range(11)), "each once, in order"
    assert copies == 5


async def test_with_receipts_off_a_resend_is_stored_again_and_no_receipt_comes(
    tmp_path: Path, broker: Broker
) -> None:
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker, receipts={"enabled": False})
    async with running_agent(settings, iggy.uplink()):
        dev = await Device(broker, "rc-c").connect()
        for i in range(3):
            dev.publish(i)
        dev.publish(1)
        await async_wait_until(lambda: len(_env(iggy, "rc-c")) >= 4, 10)
        await asyncio.sleep(0.3)
        await dev.close()
    assert _env(iggy, "rc-c") == [0, 1, 2, 1]  # at-least-once, as before receipts
    assert dev.receipts == []


async def test_reconnecting_device_gets_its_receipt_retained_and_online_answers(
    tmp_path: Path, broker: Broker
) -> None:
    iggy = MemoryIggy()
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings, iggy.uplink()):
        # a device the agent knows nothing of: "online" gets the empty answer, not retained
        fresh = await Device(broker, "rc-new").connect()
        fresh.client.publish("edge/rc-new/status", b"online", qos=1, retain=True)
        await async_wait_until(lambda: fresh.receipts == [({"seq": -1}, False)], 10)
        dev = await Device(broker, "rc-d").connect()
        payload = dev.publish(7)
        await async_wait_until(lambda: dev.last() == {"seq": 7, "crc": zlib.crc32(payload)}, 10)
        await dev.close()
        again = await Device(broker, "rc-d").connect()  # the broker kept it, retained
        await async_wait_until(lambda: bool(again.receipts), 10)
        assert again.receipts[0] == ({"seq": 7, "crc": zlib.crc32(payload)}, True)
        again.client.publish("edge/rc-d/status", b"online", qos=1, retain=True)
        await async_wait_until(lambda: len(again.receipts) >= 2, 10)
        assert again.receipts[1][0] == {"seq": 7, "crc": zlib.crc32(payload)}
        await again.close()
        await fresh.close()


async def test_confirmed_by_iggy_mode_receipts_only_after_the_uplink_confirmed(
    tmp_path: Path, broker: Broker
) -> None:
    iggy = MemoryIggy()
    iggy.down = True
    settings = make_settings(tmp_path, broker, receipts={"mode": "iggy"})
    async with running_agent(settings, iggy.uplink()) as agent:
        dev = await Device(broker, "rc-e").connect()
        payloads = [dev.publish(i) for i in range(5)]
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records >= 5, 10)
        await asyncio.sleep(0.5)
        assert dev.receipts == [], "committed is not enough in this mode"
        assert agent.receipts is not None
        assert "rc-e" in agent.receipts.unreceipted()
        iggy.down = False
        await async_wait_until(lambda: dev.last() == {"seq": 4, "crc": zlib.crc32(payloads[4])}, 15)
        await asyncio.sleep(0.3)
        assert agent.receipts.unreceipted() == {}
        await dev.close()
    assert _env(iggy, "rc-e") == list(range(5))


async def test_receipts_metrics_show_devices_holding_unreceipted_readings() -> None:
    sent: list[tuple[str, bytes, bool]] = []
    up = [False]

    def publish(topic: str, payload: bytes, retain: bool) -> bool:
        if up[0]:
            sent.append((topic, payload, retain))
        return up[0]

    metrics = Metrics()
    r = Receipts(ReceiptSettings(min_interval_ms=50), metrics, publish)
    r.observe("edge/m1/up/env", b'{"seq":3,"v":1}')
    r.observe("edge/m2/up/env", b'{"v":1}')  # no seq: nothing to receipt
    r.observe("elsewhere/m3/up/env", b'{"seq":1}')  # not a device topic
    await asyncio.sleep(0)  # the group's end
    assert set(r.unreceipted()) == {"m1"}
    assert metrics.value("iggy_edge_receipts_devices_unreceipted") == 1
    assert metrics.value("iggy_edge_receipts_unreceipted_age_seconds", device="m1") >= 0
    up[0] = True  # the session is back: the retry goes out
    await async_wait_until(lambda: bool(sent), 5)
    assert sent == [("edge/m1/down/receipt", b'{"seq":3,"crc":%d}' % zlib.crc32(b'{"seq":3,"v":1}'), True)]
    assert r.unreceipted() == {}
    assert metrics.value("iggy_edge_receipts_devices_unreceipted") == 0


@pytest.mark.parametrize(
    "topic", ["edge/down/receipt", "edge/{device}x/down", "edge/{device}", "a/+/{device}/r"]
)
def test_receipt_topic_must_hold_the_device_as_a_whole_level(topic: str) -> None:
    with pytest.raises(ConfigError):
        parse_config({"gateway_id": "g", "receipts": {"topic": topic}}, source="t", env={})


async def test_device_list_shows_devices_holding_unreceipted_readings(tmp_path: Path, broker: Broker) -> None:
    port = free_port()
    iggy = MemoryIggy()
    iggy.down = True  # Iggy mode and no uplink: the readings stay unreceipted
    settings = make_settings(
        tmp_path, broker, metrics={"listen": f"127.0.0.1:{port}"}, receipts={"mode": "iggy"}
    )
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        f'gateway_id = "gw-test"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "{broker.host}"\nport = {broker.port}\n'
        f'[metrics]\nlisten = "127.0.0.1:{port}"\n[receipts]\nmode = "iggy"\n'
    )
    async with running_agent(settings, iggy.uplink(), components=(http_endpoint,)) as agent:
        dev = await Device(broker, "rc-held").connect()
        for i in range(3):
            dev.publish(i)
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records >= 3, 10)
        runner = CliRunner()
        human = await asyncio.to_thread(runner.invoke, cli, ["device", "list", "-c", str(cfg)])
        as_json = await asyncio.to_thread(runner.invoke, cli, ["device", "list", "--json", "-c", str(cfg)])
        iggy.down = False
        await async_wait_until(lambda: dev.last() is not None and dev.last()["seq"] == 2, 15)  # type: ignore[index]
        await async_wait_until(lambda: agent.receipts is not None and not agent.receipts.unreceipted(), 5)
        after = await asyncio.to_thread(runner.invoke, cli, ["device", "list", "--json", "-c", str(cfg)])
        await dev.close()
    assert human.exit_code == 0, human.output
    assert "UNRCPT" in human.output
    assert any(line.startswith("rc-held ") for line in human.output.splitlines()), human.output
    held = {d["device"]: d for d in json.loads(as_json.output)["devices"]}
    assert held["rc-held"]["unreceipted_age_s"] >= 0
    assert held["rc-held"]["buffered"] >= 3
    assert json.loads(after.output)["devices"][0]["unreceipted_age_s"] is None  # nothing waits now


async def test_an_agent_subscribed_to_everything_does_not_ingest_its_own_receipts(
    tmp_path: Path, broker: Broker
) -> None:
    settings = make_settings(tmp_path, broker, mqtt={"subscriptions": [{"filter": "#", "qos": 1}]})
    async with running_agent(settings) as agent:
        dev = await Device(broker, "rc-hash").connect()
        payload = dev.publish(1)
        await async_wait_until(lambda: dev.last() == {"seq": 1, "crc": zlib.crc32(payload)}, 10)
        await asyncio.sleep(0.5)
        received = sum(agent.metrics.value("iggy_edge_ingest_messages_total", qos=q) for q in "012")
        await dev.close()
    assert received == 1, "the receipt came back to the agent's own session (no_local)"
