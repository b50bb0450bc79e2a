"""Desired state survives a broker that lost it (issue 15), against a real
Mosquitto and the in-memory Iggy: the broker is SIGKILLed before its first
autosave, so it comes back without sessions and without retained messages,
and the agent publishes every device's newest config again from its inbox.

The agent reaches the broker through a `FreezableProxy` so a test can keep
it away from the restarted broker until its own subscribers are in place:
they then see everything the agent (re)publishes, and that nothing else
(no command) goes out again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gmqtt
import pytest
from gmqtt.mqtt.constants import MQTTv50
from iggy_edge.cli.main import app
from iggy_edge.config import Settings
from iggy_edge.downlink.commands import make_command, make_config, return_topic
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.inbox_admin import read_commands
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.broker import Broker
from tests.support.downlink import FreezableProxy, downlink_settings
from tests.support.return_path import running, send
from tests.support.wait import async_wait_until

DEVICES = ("dev-a", "dev-b", "dev-c")
REPUBLISHED = "iggy_edge_config_republished_total"
# From the agent reaching the restarted broker to the last restored config
# at a subscriber: ingest reconnects (backoff <= 0.3 s here), sees the lost
# session, marks the rows; the deliverer reconnects and publishes.  Measured
# well under a second on an idle machine; the bound leaves room for a loaded one.
RESTORE_BOUND_S = 15.0


@dataclass
class Got:
    topic: str
    payload: bytes
    retain: bool
    config_id: str | None
    at: float


@dataclass
class Watcher:
    """A real MQTT 5 subscriber that records each message's config_id user property."""

    port: int
    filters: tuple[str, ...]
    messages: list[Got] = field(default_factory=list)
    client: gmqtt.Client | None = None

    async def start(self) -> Watcher:
        client = gmqtt.Client(f"watcher-{id(self)}", clean_session=True)
        subscribed = asyncio.get_running_loop().create_future()
        client.on_message = self._on_message
        client.on_subscribe = lambda *_: subscribed.done() or subscribed.set_result(None)  # type: ignore[func-returns-value]
        await client.connect("127.0.0.1", self.port, version=MQTTv50)
        client.subscribe([gmqtt.Subscription(f, qos=1) for f in self.filters])
        await asyncio.wait_for(subscribed, 5)
        self.client = client
        return self

    def _on_message(self, client: Any, topic: str, payload: bytes, qos: int, props: dict[str, Any]) -> int:
        ids = [v for k, v in props.get("user_property", []) if k == "config_id"]
        self.messages.append(
            Got(topic, payload, bool(props.get("retain")), ids[0] if ids else None, time.monotonic())
        )
        return 0

    def configs(self, *, live: bool = False) -> list[tuple[str, str | None, Any]]:
        """(device, config id, config) of every config message, in arrival
        order; `live`: only those published while subscribed (not the
        retained ones the broker sent on subscribing)."""
        return [
            (m.topic.split("/")[1], m.config_id, json.loads(m.payload))
            for m in self.messages
            if m.topic.endswith("/down/config") and not (live and m.retain)
        ]

    def commands(self) -> list[Got]:
        return [m for m in self.messages if m.topic.endswith("/down/cmd")]

    async def stop(self) -> None:
        if self.client is not None:
            with contextlib.suppress(OSError, RuntimeError, TimeoutError):
                await asyncio.wait_for(self.client.disconnect(), 5)


@contextlib.asynccontextmanager
async def watching(port: int, *filters: str) -> AsyncIterator[Watcher]:
    w = await Watcher(port, filters).start()
    try:
        yield w
    finally:
        await w.stop()


async def retained_now(port: int) -> list[tuple[str, str | None, Any]]:
    """What a fresh subscriber to edge/+/down/config gets retained: the
    broker sends retained messages right after the SUBACK, so what arrived
    before a marker published afterwards (on another topic, same session
    order) is all of it."""
    async with watching(port, "edge/+/down/config", "test/marker") as w:
        assert w.client is not None
        w.client.publish("test/marker", b"m", qos=1)
        await async_wait_until(lambda: any(m.topic == "test/marker" for m in w.messages), what="marker")
        return w.configs()


def push_config(iggy: MemoryIggy, settings: Settings, device: str, config: dict[str, Any], cid: str) -> None:
    cfg = make_config(device, config, config_id=cid)
    send(iggy, settings, cfg)


def config_states(settings: Settings) -> dict[str, tuple[str, str]]:
    with contextlib.closing(sqlite3.connect(settings.buffer_path)) as c:
        try:
            rows = c.execute("SELECT device, id, state FROM downlink_config").fetchall()
        except sqlite3.OperationalError:  # the return path has not created it yet
            return {}
    return {r[0]: (r[1], r[2]) for r in rows}


def all_delivered(settings: Settings, expected: dict[str, str]) -> bool:
    states = config_states(settings)
    return all(states.get(d) == (cid, "delivered") for d, cid in expected.items())


def crash_broker(tmp_path: Path) -> Broker:
    # Persistence on, but the first autosave an hour away: a SIGKILL loses
    # every session and retained message, as a crash before the autosave does.
    return Broker(tmp_path / "broker", autosave_interval=3600)


async def setup(tmp_path: Path, rate: float = 50.0) -> tuple[Broker, FreezableProxy, Settings, MemoryIggy]:
    broker = crash_broker(tmp_path).start()
    proxy = await FreezableProxy(broker.port).start()
    settings = downlink_settings(
        tmp_path, None, mqtt={"host": "127.0.0.1", "port": proxy.port}, downlink={"republish_rate": rate}
    )
    return broker, proxy, settings, MemoryIggy(partitions=3)


async def push_and_deliver(iggy: MemoryIggy, settings: Settings) -> dict[str, str]:
    """Two configs for dev-a (the second is the newest), one for each other
    device, and a command: all delivered."""
    push_config(iggy, settings, "dev-a", {"period_s": 1}, "a-old")
    expected = {"dev-a": "a-2", "dev-b": "b-1", "dev-c": "c-1"}
    for dev, cid in expected.items():
        push_config(iggy, settings, dev, {"period_s": 10, "dev": dev}, cid)
    cmd = make_command("dev-a", "reboot", {}, ttl_s=3600, command_id="cmd-1")
    send(iggy, settings, cmd)
    await async_wait_until(lambda: all_delivered(settings, expected), 20, what="configs delivered")
    await async_wait_until(
        lambda: [r.state for r in read_commands(settings.buffer_path)] == ["delivered"], 20, what="command"
    )
    return expected


async def crash_and_hold(broker: Broker, proxy: FreezableProxy) -> None:
    """SIGKILL the broker and start it again while the agent cannot reach it."""
    await proxy.stop()
    broker.kill()
    broker.start()


async def test_a_broker_crash_before_autosave_gets_every_newest_config_back(tmp_path: Path) -> None:
    broker, proxy, settings, iggy = await setup(tmp_path)
    try:
        async with running(settings, iggy) as agent:
            expected = await push_and_deliver(iggy, settings)
            assert sorted((d, cid) for d, cid, _ in await retained_now(broker.port)) == sorted(
                expected.items()
            )
            assert agent.metric(REPUBLISHED) == 0

            await crash_and_hold(broker, proxy)
            assert await retained_now(broker.port) == [], "the crash really lost the retained configs"
            async with watching(broker.port, "edge/+/down/config", "edge/+/down/cmd") as w:
                await proxy.start()  # the agent reaches the restarted broker
                t0 = time.monotonic()
                await async_wait_until(
                    lambda: len(w.configs()) >= 3, RESTORE_BOUND_S, what="configs restored"
                )
                took = time.monotonic() - t0
                await async_wait_until(lambda: agent.metric(REPUBLISHED) == 3, 5, what="counted")
                # Anything else the agent would publish after the restore has
                # gone out before a config pushed now (one connection, in order).
                push_config(iggy, settings, "dev-b", {"period_s": 99}, "b-2")
                await async_wait_until(lambda: len(w.configs()) >= 4, 20, what="a later config")
            got = w.configs()
            assert [(d, cid) for d, cid, _ in got[:3]] == [
                ("dev-a", "a-2"),
                ("dev-b", "b-1"),
                ("dev-c", "c-1"),
            ]
            assert [c for _, _, c in got[:3]] == [{"period_s": 10, "dev": d} for d in DEVICES]
            assert got[3:] == [("dev-b", "b-2", {"period_s": 99})], (
                "each restored config once, then the new one"
            )
            assert w.commands() == [], "a restore never re-sends commands"
            assert [r.state for r in read_commands(settings.buffer_path)] == ["delivered"]
            assert agent.metric(REPUBLISHED) == 3
            print(
                f"restore: 3 configs at a fresh subscriber {took:.2f}s after the agent could reach the broker"
            )
            # 'delivered' is written when the broker's PUBACK is back, which
            # can be just after the watcher has the message.
            newest = {"dev-a": "a-2", "dev-b": "b-2", "dev-c": "c-1"}
            await async_wait_until(lambda: all_delivered(settings, newest), 20, what="b-2 marked delivered")
        final = await retained_now(broker.port)
        assert sorted((d, cid) for d, cid, _ in final) == [
            ("dev-a", "a-2"),
            ("dev-b", "b-2"),
            ("dev-c", "c-1"),
        ]
        assert {d: s for d, (_, s) in config_states(settings).items()} == dict.fromkeys(DEVICES, "delivered")
    finally:
        await proxy.stop()
        broker.stop()


async def test_a_newer_config_pushed_during_a_restore_wins(tmp_path: Path) -> None:
    # One config per second: the restore of dev-c is still waiting when its
    # newer config arrives.
    broker, proxy, settings, iggy = await setup(tmp_path, rate=1.0)
    try:
        async with running(settings, iggy) as agent:
            await push_and_deliver(iggy, settings)
            await crash_and_hold(broker, proxy)
            async with watching(broker.port, "edge/+/down/config", "edge/+/down/cmd") as w:
                await proxy.start()
                await async_wait_until(lambda: len(w.configs()) >= 1, RESTORE_BOUND_S, what="restore began")
                push_config(iggy, settings, "dev-c", {"period_s": 5}, "c-2")
                await async_wait_until(
                    lambda: config_states(settings)["dev-c"] == ("c-2", "delivered"), 20, what="newer config"
                )
                await async_wait_until(lambda: agent.metric(REPUBLISHED) == 2, 20, what="dev-b restored")
                # dev-c is not restored after its newer config: the row is no
                # longer marked.  A later config on the same connection comes
                # after anything the agent still had to publish.
                push_config(iggy, settings, "dev-a", {"period_s": 7}, "a-3")
                await async_wait_until(lambda: any(cid == "a-3" for _, cid, _ in w.configs()), 20, what="a-3")
            got = [(d, cid) for d, cid, _ in w.configs()]
            assert sorted(got) == sorted(
                [("dev-a", "a-2"), ("dev-b", "b-1"), ("dev-c", "c-2"), ("dev-a", "a-3")]
            )
            assert got.index(("dev-a", "a-2")) < got.index(("dev-b", "b-1")), "device order"
            restored = [m for m in w.messages if m.config_id in ("a-2", "b-1")]
            gap = restored[1].at - restored[0].at
            assert gap >= 0.5, f"republish_rate = 1/s, but two restored configs came {gap:.2f}s apart"
            assert w.commands() == []
            assert agent.metric(REPUBLISHED) == 2
        final = dict((d, cid) for d, cid, _ in await retained_now(broker.port))
        assert final == {"dev-a": "a-3", "dev-b": "b-1", "dev-c": "c-2"}
    finally:
        await proxy.stop()
        broker.stop()


async def test_the_gateway_restarting_with_the_broker_restores_too(tmp_path: Path) -> None:
    """A power cut: broker and agent both down.  The agent starts again and
    learns from its outbox that it had a session the broker no longer has."""
    broker, proxy, settings, iggy = await setup(tmp_path)
    try:
        async with running(settings, iggy) as agent:
            expected = await push_and_deliver(iggy, settings)
            await agent.hard_kill()
        broker.kill()
        broker.start()
        async with running(settings, iggy) as agent:
            await async_wait_until(lambda: agent.metric(REPUBLISHED) == 3, RESTORE_BOUND_S, what="restored")
            final = await retained_now(broker.port)
            assert sorted((d, cid) for d, cid, _ in final) == sorted(expected.items())
    finally:
        await proxy.stop()
        broker.stop()


async def test_a_crash_after_an_autosave_restores_what_changed_since(tmp_path: Path) -> None:
    """The broker comes back with its last autosave: the sessions are there
    (ingest sees nothing amiss), a config delivered since is not.  The
    deliverer publishes the configs of the last republish_recent_s again."""
    broker, proxy, settings, iggy = await setup(tmp_path)
    saved = tmp_path / "autosave.db"
    try:
        async with running(settings, iggy) as agent:
            push_config(iggy, settings, "dev-a", {"period_s": 1}, "a-1")
            await async_wait_until(lambda: all_delivered(settings, {"dev-a": "a-1"}), 20, what="a-1")
            broker.stop()  # SIGTERM: Mosquitto writes its database, as an autosave does
            shutil.copy(broker.workdir / "mosquitto.db", saved)
            broker.start()
            push_config(iggy, settings, "dev-b", {"period_s": 2}, "b-1")
            cmd = make_command("dev-b", "reboot", {}, ttl_s=3600, command_id="cmd-b")
            send(iggy, settings, cmd)
            await async_wait_until(lambda: all_delivered(settings, {"dev-b": "b-1"}), 20, what="b-1")
            await async_wait_until(
                lambda: [r.state for r in read_commands(settings.buffer_path)] == ["delivered"],
                20,
                what="cmd",
            )
            await proxy.stop()
            broker.kill()
            shutil.copy(saved, broker.workdir / "mosquitto.db")  # what the last autosave wrote
            broker.start()
            assert [(d, cid) for d, cid, _ in await retained_now(broker.port)] == [("dev-a", "a-1")]
            async with watching(broker.port, "edge/+/down/config", "edge/+/down/cmd") as w:
                await proxy.start()
                await async_wait_until(
                    lambda: ("dev-b", "b-1") in [(d, c) for d, c, _ in w.configs(live=True)],
                    RESTORE_BOUND_S,
                    what="b-1 restored",
                )
                push_config(iggy, settings, "dev-c", {"period_s": 3}, "c-1")  # after anything still due
                await async_wait_until(lambda: len(w.configs(live=True)) >= 3, 20, what="c-1")
            assert agent.metric("iggy_edge_mqtt_session_lost_total") == 0, "the session survived"
            assert sorted((d, cid) for d, cid, _ in w.configs(live=True)) == [
                ("dev-a", "a-1"),
                ("dev-b", "b-1"),
                ("dev-c", "c-1"),
            ]
            assert w.commands() == []
        final = sorted((d, cid) for d, cid, _ in await retained_now(broker.port))
        assert final == [("dev-a", "a-1"), ("dev-b", "b-1"), ("dev-c", "c-1")]
    finally:
        await proxy.stop()
        broker.stop()


def write_config(tmp_path: Path, settings: Settings) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        f'gateway_id = "{settings.gateway_id}"\nstate_dir = "{settings.state_dir}"\n'
        f'[mqtt]\nhost = "{settings.mqtt.host}"\nport = {settings.mqtt.port}\n'
    )
    return path


async def test_config_republish_against_a_running_agent(tmp_path: Path) -> None:
    broker, proxy, settings, iggy = await setup(tmp_path)
    config = write_config(tmp_path, settings)
    runner = CliRunner()
    try:
        async with running(settings, iggy) as agent:
            await push_and_deliver(iggy, settings)
            # Someone wiped dev-b's retained config (an empty retained message clears it).
            wiper = gmqtt.Client("wiper", clean_session=True)
            await wiper.connect(broker.host, broker.port, version=MQTTv50)
            wiper.publish("edge/dev-b/down/config", b"", qos=1, retain=True)
            await wiper.disconnect()
            assert "dev-b" not in [d for d, _, _ in await retained_now(broker.port)]
            async with watching(broker.port, "edge/+/down/config", "edge/+/down/cmd") as w:
                one = ["config", "republish", "--device", "dev-b", "-c", str(config), "--json"]
                result = await asyncio.to_thread(runner.invoke, app, one)
                assert result.exit_code == 0, result.output
                assert json.loads(result.stdout) == {"marked": 1, "device": "dev-b", "still_due": []}
                await async_wait_until(lambda: agent.metric(REPUBLISHED) == 1, 10, what="republished")
                await async_wait_until(lambda: len(w.configs(live=True)) >= 1, 10, what="at the subscriber")
                # Every device: the other two come again too, in device order.
                result = await asyncio.to_thread(
                    runner.invoke, app, ["config", "republish", "-c", str(config)]
                )
                assert result.stdout.startswith("marked 3 config(s) for the running agent to publish again")
                await async_wait_until(lambda: agent.metric(REPUBLISHED) == 4, 10, what="all republished")
                await async_wait_until(
                    lambda: len(w.configs(live=True)) >= 4, 10, what="all at the subscriber"
                )
            assert [(d, cid) for d, cid, _ in w.configs(live=True)] == [
                ("dev-b", "b-1"),
                ("dev-a", "a-2"),
                ("dev-b", "b-1"),
                ("dev-c", "c-1"),
            ]
            assert w.commands() == []
            assert ("dev-b", "b-1") in [(d, cid) for d, cid, _ in await retained_now(broker.port)]
            unknown = await asyncio.to_thread(
                runner.invoke, app, ["config", "republish", "--device", "nope", "-c", str(config)]
            )
            assert unknown.exit_code != 0
            assert "no desired config for device 'nope'" in unknown.output
    finally:
        await proxy.stop()
        broker.stop()


# -- the inbox's side of a restore, without a broker ------------------------------------


@pytest.mark.unit
async def test_marking_respects_newer_configs_and_the_time_bounds(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:

        async def store(dev: str, cid: str, period: int) -> None:
            cfg = make_config(dev, {"period_s": period}, config_id=cid)
            rt = return_topic(settings)
            await inbox.store_polled(rt.stream, rt.topic, 0, 0, configs=[(cfg, "t/0@0")])

        async def deliver_all() -> None:
            await inbox.finish_configs([(c, "delivered", "") for c in await inbox.due_configs(10)])

        for dev in DEVICES:
            await store(dev, f"{dev}-1", 1)
        await deliver_all()
        t = time.time()
        assert await inbox.mark_republish(before=t - 3600) == 0, "all delivered after `before`"
        assert await inbox.mark_republish(since=t + 3600) == 0, "all delivered before `since`"
        assert await inbox.mark_republish(device="dev-b") == 1
        assert await inbox.mark_republish() == 2, "dev-b is marked already"
        due = await inbox.due_republish(10)
        assert [(c.device, c.id) for c in due] == [(d, f"{d}-1") for d in DEVICES], "device order"
        # A newer config for dev-c replaces the marked row: it is new, not a restore.
        await store("dev-c", "dev-c-2", 2)
        assert [(c.device, c.id) for c in await inbox.due_republish(10)] == [
            ("dev-a", "dev-a-1"),
            ("dev-b", "dev-b-1"),
        ]
        assert [(c.device, c.id) for c in await inbox.due_configs(10)] == [("dev-c", "dev-c-2")]
        # Finishing the stale restore of dev-c (read before the newer one came)
        # does not mark the newer one delivered.
        await inbox.finish_configs([(due[2], "delivered", "")])
        assert [(c.device, c.id) for c in await inbox.due_configs(10)] == [("dev-c", "dev-c-2")]
        await inbox.finish_configs([(c, "delivered", "") for c in due[:2]])
        assert await inbox.due_republish(10) == []
    finally:
        await inbox.close()


@pytest.mark.unit
def test_cli_republish_without_a_buffer_says_so(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    result = CliRunner().invoke(app, ["config", "republish", "-c", str(write_config(tmp_path, settings))])
    assert result.exit_code != 0
    assert "no buffer database" in result.output
    assert not settings.buffer_path.exists(), "the CLI does not create one"
