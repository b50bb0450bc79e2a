"""Issue 9's attack list against a real Mosquitto started from the packaged
snippet and ACL, with the real agent (ingest and return path) on its own
listener and the MemoryIggy uplink.

Attackers are the real `mosquitto_pub` / `mosquitto_sub` (MQTT 3.1.1, as
umqtt.simple speaks) with a device's valid credentials.  A denied PUBLISH is
dropped silently under 3.1.1 and Mosquitto 2.0 grants a wildcard SUBSCRIBE
and then filters each delivery, so "denied" is proven by what a subscriber
*with* the rights receives: a later legitimate message arrives, the forged
one never does (same broker, same order).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.config import Settings
from iggy_edge.downlink import return_path
from iggy_edge.downlink.commands import make_command, make_config
from iggy_edge.runtime import Agent
from iggy_edge.uplink.factory import consumer_name
from iggy_edge.uplink.memory import MemoryIggy
from iggy_edge.uplink.protocol import PolledMessage

from tests.support.agent import wait_subscribed
from tests.support.broker import mosquitto_binary
from tests.support.downlink import downlink_settings
from tests.support.gateway_broker import AGENT_USER, GatewayBroker
from tests.support.return_path import provision, send
from tests.support.wait import async_wait_until

GW = "gw-acl"
AGENT_ID = f"iggy-edge-{GW}"
DEVICES = {"s1": "s1-password-123", "s2": "s2-password-456"}


@pytest.fixture
def gw() -> Iterator[GatewayBroker]:
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: run .ci/setup")
    b = GatewayBroker(devices=dict(DEVICES)).start()
    try:
        yield b
    finally:
        b.close()


def agent_settings(tmp_path: Path, gw: GatewayBroker) -> Settings:
    mqtt = {"host": gw.host, "port": gw.agent_port, "username": AGENT_USER, "password": gw.agent_password}
    return downlink_settings(tmp_path, None, gateway_id=GW, mqtt=mqtt)


class RunningAgent:
    def __init__(self, settings: Settings, iggy: MemoryIggy) -> None:
        self.settings = settings
        self.iggy = iggy
        provision(iggy, settings)
        self.agent = Agent(
            settings,
            uplink=iggy.uplink(),
            command_source=iggy.command_source(consumer_name(settings)),
            components=(return_path,),
        )
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> RunningAgent:
        self.task = asyncio.create_task(self.agent.run(), name="agent-under-test")
        await asyncio.wait_for(self.agent.ready.wait(), 10)
        await wait_subscribed(self.agent)
        return self

    async def stop(self) -> None:
        if self.task is not None and not self.task.done():
            self.agent.stop()
            await asyncio.wait_for(self.task, 15)

    def uplinked(self, mqtt_topic: str) -> list[bytes]:
        out: list[PolledMessage] = []
        for topic in ("telemetry", "events", "acks"):
            if ("edge", topic) in self.iggy.topics:
                for p in range(self.settings.iggy.partitions):
                    out += self.iggy.messages("edge", topic, p)
        return [m.payload for m in out if m.headers.get("mqtt-topic") == mqtt_topic]

    def send_command(self, device: str, name: str) -> str:
        cmd = make_command(device, name, {})
        send(self.iggy, self.settings, cmd)
        return cmd.id

    def send_config(self, device: str, config: dict[str, Any]) -> None:
        send(self.iggy, self.settings, make_config(device, config))


@pytest.fixture
async def agent(tmp_path: Path, gw: GatewayBroker) -> AsyncIterator[RunningAgent]:
    r = await RunningAgent(agent_settings(tmp_path, gw), MemoryIggy(partitions=3)).start()
    try:
        yield r
    finally:
        await r.stop()


# -- real MQTT 3.1.1 clients --------------------------------------------------------------
def _auth(port: int, user: str | None, password: str | None) -> list[str]:
    argv = ["-h", "127.0.0.1", "-p", str(port)]
    if user is not None:
        argv += ["-u", user, "-P", password or ""]
    return argv


async def pub(
    port: int,
    user: str | None,
    password: str | None,
    topic: str,
    payload: str | bytes,
    *,
    retain: bool = False,
    client_id: str | None = None,
) -> subprocess.CompletedProcess[bytes]:
    argv = ["mosquitto_pub", *_auth(port, user, password), "-t", topic, "-q", "1"]
    argv += ["-s"] if isinstance(payload, bytes) else ["-m", payload]
    if retain:
        argv.append("-r")
    if client_id:
        argv += ["-i", client_id]
    data = payload if isinstance(payload, bytes) else None
    return await asyncio.to_thread(
        subprocess.run, argv, input=data, capture_output=True, timeout=15, check=False
    )


class Sub:
    """mosquitto_sub -d -v: the SUBACK it got and every message, by topic."""

    def __init__(
        self,
        workdir: Path,
        port: int,
        user: str | None,
        password: str | None,
        filters: list[str],
        *,
        client_id: str | None = None,
        persistent: bool = False,
    ) -> None:
        self.path = workdir / f"sub-{user}-{time.monotonic_ns()}.log"
        self._out = self.path.open("wb")
        argv = ["stdbuf", "-oL", "mosquitto_sub", *_auth(port, user, password), "-d", "-v", "-q", "1"]
        for f in filters:
            argv += ["-t", f]
        if client_id:
            argv += ["-i", client_id]
        if persistent:
            argv.append("-c")
        self.proc = subprocess.Popen(argv, stdout=self._out, stderr=subprocess.STDOUT)

    def lines(self) -> list[str]:
        return self.path.read_text(errors="replace").splitlines()

    def granted(self) -> list[int] | None:
        for line in self.lines():
            if line.startswith("Subscribed (mid:"):
                return [int(x) for x in line.split(":", 2)[2].split(",")]
        return None

    def messages(self) -> list[tuple[str, str]]:
        out = []
        for line in self.lines():
            if line.startswith(("Client ", "Subscribed", "Connection error", "Error")) or not line:
                continue
            topic, _, payload = line.partition(" ")
            out.append((topic, payload))
        return out

    def refused(self) -> bool:
        return self.proc.poll() is not None and "not authorised" in self.path.read_text(errors="replace")

    async def subscribed(self) -> Sub:
        await async_wait_until(lambda: self.granted() is not None or self.proc.poll() is not None, 10)
        assert self.granted() is not None, self.path.read_text()
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=5)
        self._out.close()


@pytest.fixture
def subs(tmp_path: Path) -> Iterator[list[Sub]]:
    made: list[Sub] = []
    yield made
    for s in made:
        s.stop()


async def sub(subs: list[Sub], *args: Any, **kw: Any) -> Sub:
    s = Sub(*args, **kw)
    subs.append(s)
    return await s.subscribed()


# -- who may connect ------------------------------------------------------------------------
async def test_logins_are_confined_to_their_listener(gw: GatewayBroker) -> None:
    dev, ag = gw.device_port, gw.agent_port
    s1 = DEVICES["s1"]
    assert (await pub(dev, "s1", s1, "edge/s1/up/t", "1")).returncode == 0
    assert (await pub(ag, AGENT_USER, gw.agent_password, "edge/s1/down/cmd", "x")).returncode == 0
    for port, user, pw in (
        (dev, None, None),  # anonymous, devices' listener
        (ag, None, None),  # anonymous, agent's listener
        (dev, "s1", "wrong-password"),
        (ag, "s1", s1),  # a device's credentials do not open the agent's listener
        (dev, AGENT_USER, gw.agent_password),  # the agent's user does not exist on the LAN
    ):
        done = await pub(port, user, pw, "edge/s1/up/t", "1")
        assert done.returncode != 0, (port, user)
        assert b"not authorised" in done.stderr.lower(), done.stderr


# -- the attack list ------------------------------------------------------------------------
async def test_a_device_cannot_publish_telemetry_as_another(gw: GatewayBroker, agent: RunningAgent) -> None:
    dev = gw.device_port
    await pub(dev, "s1", DEVICES["s1"], "edge/s2/up/temp", "forged-by-s1")
    await pub(dev, "s1", DEVICES["s1"], "edge/s2/status", "forged-status")
    await pub(dev, "s1", DEVICES["s1"], "edge/s1/up/temp", "genuine-s1")
    await pub(dev, "s2", DEVICES["s2"], "edge/s2/up/temp", "genuine-s2")
    await async_wait_until(
        lambda: agent.uplinked("edge/s2/up/temp") and agent.uplinked("edge/s1/up/temp"), 10, what="ingested"
    )
    assert agent.uplinked("edge/s1/up/temp") == [b"genuine-s1"]
    assert agent.uplinked("edge/s2/up/temp") == [b"genuine-s2"]  # the forged one never reached the agent
    assert agent.uplinked("edge/s2/status") == []
    assert "Denied PUBLISH from s1" in gw.log()


async def test_a_device_reads_only_its_own_commands_and_cannot_send_any(
    tmp_path: Path, gw: GatewayBroker, agent: RunningAgent, subs: list[Sub]
) -> None:
    dev = gw.device_port
    victim = await sub(subs, tmp_path, dev, "s2", DEVICES["s2"], ["edge/s2/down/#"])
    # s1 tries to command s2 directly (before its own subscriber starts: a
    # second connection of the same user takes over the first)
    await pub(dev, "s1", DEVICES["s1"], "edge/s2/down/cmd", '{"id":"forged","name":"open"}')
    spy = await sub(
        subs, tmp_path, dev, "s1", DEVICES["s1"], ["edge/+/down/cmd", "edge/s2/down/#", "#", "edge/s1/down/#"]
    )
    # the agent delivers one command to each (the legitimate flow)
    to_s2 = agent.send_command("s2", "relay")
    to_s1 = agent.send_command("s1", "relay")

    # (overlapping subscriptions each get a copy: compare sets)
    def ids(s: Sub, topic: str) -> set[str]:
        return {json.loads(p)["id"] for t, p in s.messages() if t == topic}

    await async_wait_until(lambda: ids(victim, "edge/s2/down/cmd") == {to_s2}, 15, what="s2 got its command")
    await async_wait_until(lambda: ids(spy, "edge/s1/down/cmd") == {to_s1}, 15, what="s1 got its command")
    assert {t for t, _ in spy.messages()} == {"edge/s1/down/cmd"}  # nothing of s2's, nothing via '#'
    assert ids(victim, "edge/s2/down/cmd") == {to_s2}  # the forged command never arrived


async def test_subscribing_to_everything_yields_only_ones_own_topics(
    tmp_path: Path, gw: GatewayBroker, agent: RunningAgent, subs: list[Sub]
) -> None:
    dev = gw.device_port
    spy = await sub(subs, tmp_path, dev, "s1", DEVICES["s1"], ["#", "$SYS/#", "edge/#"])
    await pub(dev, "s2", DEVICES["s2"], "edge/s2/up/temp", "s2-reading")
    await pub(dev, "s2", DEVICES["s2"], "edge/s2/status", "online", retain=True)
    agent.send_config("s2", {"period_ms": 1000})
    await async_wait_until(lambda: agent.uplinked("edge/s2/up/temp"), 10, what="s2's reading ingested")
    marker = agent.send_command("s1", "marker")  # arrives after everything above
    await async_wait_until(spy.messages, 15, what="s1's own command")
    await asyncio.sleep(0.3)  # room for a wrong delivery to show up after the marker
    assert {(t, json.loads(p)["id"]) for t, p in spy.messages()} == {("edge/s1/down/cmd", marker)}


async def test_a_device_cannot_take_the_agents_queued_session(
    tmp_path: Path, gw: GatewayBroker, subs: list[Sub]
) -> None:
    settings = agent_settings(tmp_path, gw)
    iggy = MemoryIggy(partitions=3)
    first = await RunningAgent(settings, iggy).start()
    await first.stop()  # persistent session: the broker now queues for AGENT_ID
    for i in range(5):
        assert (await pub(gw.device_port, "s2", DEVICES["s2"], "edge/s2/up/q", f"queued-{i}")).returncode == 0
    # s1 connects with the agent's client id and a persistent session, on
    # the devices' listener: it gets its own user name as client id instead
    thief = await sub(
        subs,
        tmp_path,
        gw.device_port,
        "s1",
        DEVICES["s1"],
        ["edge/s1/down/#"],
        client_id=AGENT_ID,
        persistent=True,
    )
    # ... and on the agent's listener its credentials are refused
    refused = await pub(gw.agent_port, "s1", DEVICES["s1"], "edge/s2/up/q", "x", client_id=AGENT_ID)
    assert refused.returncode != 0
    # a marker the thief may read: queued messages would have come first
    await pub(gw.agent_port, AGENT_USER, gw.agent_password, "edge/s1/down/marker", "marker")
    await async_wait_until(thief.messages, 10, what="marker")
    assert thief.messages() == [("edge/s1/down/marker", "marker")]
    assert "as s1 (p2, c0" in gw.log()  # the broker replaced the client id with the user name
    second = await RunningAgent(settings, iggy).start()
    try:
        await async_wait_until(lambda: len(second.uplinked("edge/s2/up/q")) == 5, 15, what="queue kept")
        assert second.uplinked("edge/s2/up/q") == [f"queued-{i}".encode() for i in range(5)]
    finally:
        await second.stop()


async def test_a_device_using_the_agents_client_id_does_not_kick_it(
    tmp_path: Path, gw: GatewayBroker, agent: RunningAgent, subs: list[Sub]
) -> None:
    ingest = agent.agent.ingest
    assert ingest is not None
    before = ingest.client
    await sub(subs, tmp_path, gw.device_port, "s1", DEVICES["s1"], ["edge/s1/down/#"], client_id=AGENT_ID)
    await pub(gw.device_port, "s1", DEVICES["s1"], "edge/s1/up/t", "while-impostor", client_id=AGENT_ID)
    await pub(gw.device_port, "s2", DEVICES["s2"], "edge/s2/up/t", "after")
    await async_wait_until(
        lambda: agent.uplinked("edge/s2/up/t") == [b"after"], 10, what="agent still ingests"
    )
    assert agent.uplinked("edge/s1/up/t") == [b"while-impostor"]  # own topic, own identity: allowed
    assert ingest.connected.is_set()
    assert ingest.client is before
    assert f"Client {AGENT_ID} already connected" not in gw.log()


async def test_retained_config_of_another_device_cannot_be_poisoned(
    tmp_path: Path, gw: GatewayBroker, agent: RunningAgent, subs: list[Sub]
) -> None:
    dev = gw.device_port
    big = b"x" * 60_000
    await pub(dev, "s1", DEVICES["s1"], "edge/s2/down/config", big, retain=True)
    await pub(
        dev, "s2", DEVICES["s2"], "edge/s2/down/config", b'{"self": 1}', retain=True
    )  # not even its own
    agent.send_config("s2", {"period_ms": 5000})
    # a board booting later sees the retained config the agent set, nothing else
    await async_wait_until(lambda: _config_state(agent.settings, "s2") == "delivered", 15, what="retained")
    late = await sub(subs, tmp_path, dev, "s2", DEVICES["s2"], ["edge/s2/down/config"])
    await async_wait_until(late.messages, 10, what="retained config at subscribe")
    await asyncio.sleep(0.3)
    ((topic, payload),) = late.messages()
    assert topic == "edge/s2/down/config"
    assert json.loads(payload) == {"period_ms": 5000}
    assert gw.log().count("Denied PUBLISH from s") >= 2


def _config_state(settings: Settings, dev: str) -> str:
    with contextlib.closing(sqlite3.connect(settings.buffer_path)) as c:
        row = c.execute("SELECT state FROM downlink_config WHERE device = ?", (dev,)).fetchone()
    return "" if row is None else str(row[0])
