"""Several Iggy nodes: addresses, moving to the next node, the recovery probe
after a link cut, and a real 3-node cluster losing the node in use.

Tests marked ``iggy`` need `iggy-server` on PATH (skipped with a reason
otherwise).  The bounds below are generous for a loaded 2-core machine; the
measured figures are printed (``pytest -s``) and quoted in the README.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import socket
import struct
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.cli.main import app
from iggy_edge.config import ConfigError, IggySettings, Settings, load_config
from iggy_edge.downlink.commands import make_command, return_topic
from iggy_edge.relay import TcpRelay
from iggy_edge.runtime import Agent, build_agent
from iggy_edge.uplink.iggy import IggyCommandSource, IggyUplink, send_command
from iggy_edge.uplink.iggy.cluster import decode_cluster_metadata
from iggy_edge.uplink.iggy.connection import first_reachable
from iggy_edge.uplink.protocol import UplinkAmbiguous, UplinkUnavailable
from pydantic import SecretStr
from typer.testing import CliRunner

from tests.support.agent import make_settings, wait_subscribed
from tests.support.broker import Broker
from tests.support.downlink import DeviceSubscriber
from tests.support.iggy_server import IggyCluster, IggyServer, busiest_peer
from tests.support.mqtt import Publisher
from tests.support.ports import free_port
from tests.support.provisioning import provision
from tests.support.tcp_proxy import TcpProxy
from tests.support.wait import async_wait_until
from tests.test_uplink_iggy import rec

# -- settings --------------------------------------------------------------------------


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "config.toml"
    p.write_text('gateway_id = "gw-1"\n' + text)
    return p


def test_addresses_list_and_single_address(tmp_path: Path) -> None:
    s = load_config(
        write(tmp_path, '[iggy]\nkind = "iggy"\naddresses = ["n1:8090", "n2:8090", "n3:8090"]\n'), env={}
    )
    assert s.iggy.nodes == ("n1:8090", "n2:8090", "n3:8090")
    one = load_config(write(tmp_path, '[iggy]\nkind = "iggy"\naddress = "n1:8090"\n'), env={})
    assert one.iggy.nodes == ("n1:8090",)
    assert one.iggy.where == "n1:8090"


def test_iggy_address_env_takes_a_comma_separated_list(tmp_path: Path) -> None:
    cfg = write(tmp_path, '[iggy]\naddresses = ["file-1:8090", "file-2:8090"]\n')
    s = load_config(cfg, env={"IGGY_ADDRESS": "n1:8090, n2:8090,n3:8090"})
    assert s.iggy.kind == "iggy"
    assert s.iggy.nodes == ("n1:8090", "n2:8090", "n3:8090")
    # A single address in the environment replaces the file's list too.
    s = load_config(cfg, env={"IGGY_ADDRESS": "10.0.0.5:8090"})
    assert s.iggy.nodes == ("10.0.0.5:8090",)
    assert s.iggy.address == "10.0.0.5:8090"


@pytest.mark.parametrize(
    "nodes", [["n1:8090", "nohost"], ["n1:8090", "n1:8090"], ["n1:8090,n2:8090"], ["n1:8090"] * 17]
)
def test_bad_addresses_are_refused(tmp_path: Path, nodes: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, f'[iggy]\nkind = "iggy"\naddresses = {json.dumps(nodes)}\n'), env={})
    assert any(key.startswith("iggy") for key, _ in info.value.problems)


# -- pieces ----------------------------------------------------------------------------


def test_cluster_metadata_decodes_roles_and_statuses() -> None:
    def text(s: str) -> bytes:
        return struct.pack("<I", len(s)) + s.encode()

    def node(name: str, port: int, role: int, status: int) -> bytes:
        return text(name) + text("10.0.0.1") + struct.pack("<HHHHBB", port, 0, 0, 0, role, status)

    reply = text("c") + struct.pack("<I", 3) + node("a", 1, 1, 0) + node("b", 2, 0, 0) + node("c", 3, 1, 3)
    meta = decode_cluster_metadata(reply)
    assert meta.name == "c"
    assert [(n.name, n.role, n.status) for n in meta.nodes] == [
        ("a", "follower", "healthy"),
        ("b", "leader", "healthy"),
        ("c", "follower", "unreachable"),
    ]
    assert meta.leader is not None
    assert meta.leader.address == "10.0.0.1:2"
    with pytest.raises(ValueError, match="cut short"):
        decode_cluster_metadata(reply[:-3])


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_first_reachable_is_one_tcp_connect_per_node() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        up = f"127.0.0.1:{listening.getsockname()[1]}"
        down = f"127.0.0.1:{free_port()}"
        t = time.monotonic()
        assert await first_reachable([down, up], 0.5) == up
        assert await first_reachable([down], 0.5) is None
        assert time.monotonic() - t < 1.5


# -- one real server -------------------------------------------------------------------


def iggy_settings(nodes: list[str], user: str, password: str, **kw: object) -> IggySettings:
    base: dict[str, object] = {
        "kind": "iggy",
        "addresses": nodes,
        "username": user,
        "password": SecretStr(password),
        "request_timeout_s": 5.0,
        "connect_timeout_s": 5.0,
        "partitions": 3,
    }
    base.update(kw)
    return IggySettings.model_validate(base)


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_an_unreachable_first_node_is_skipped_at_once(iggy_server: IggyServer) -> None:
    dead = f"127.0.0.1:{free_port()}"
    s = iggy_settings([dead, iggy_server.address], iggy_server.username, iggy_server.password)
    up = IggyUplink(s, "gw-1", topics=[("edge", "telemetry")])
    t = time.monotonic()
    await up.start()
    assert time.monotonic() - t < 5.0
    assert up.node == iggy_server.address
    await up.close()

    s = iggy_settings([dead, f"127.0.0.1:{free_port()}"], iggy_server.username, iggy_server.password)
    up = IggyUplink(s, "gw-1")
    with pytest.raises(UplinkUnavailable, match="no node answered") as info:
        await up.start()
    assert dead in str(info.value)
    await up.close()


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_a_node_that_stops_answering_is_left_for_the_next(
    tmp_path: Path, iggy_server: IggyServer
) -> None:
    """Two servers stand in for two nodes: the first freezes (SIGSTOP: its
    connections stay open, nothing answers); the send in flight is ambiguous
    within request_timeout_s, and the re-send of the same records (same ids)
    goes to the second node."""
    other = IggyServer(
        tmp_path / "other", username=iggy_server.username, password=iggy_server.password
    ).start()
    try:
        s = iggy_settings(
            [iggy_server.address, other.address],
            iggy_server.username,
            iggy_server.password,
            request_timeout_s=2.0,
            connect_timeout_s=2.0,
        )
        up = IggyUplink(s, "gw-1", topics=[("edge", "telemetry")])
        await up.start()
        assert up.node == iggy_server.address
        await up.send([rec(1, "a")])
        iggy_server.pause()
        t = time.monotonic()
        with pytest.raises(UplinkAmbiguous):
            await up.send([rec(2, "a")])
        # The forwarder's re-sends: the same record, the same id.  (These two
        # servers are no cluster: the first attempt on the second finds the
        # topic missing, the next creates it.)
        for _attempt in range(3):
            try:
                await up.send([rec(2, "a")])
                break
            except UplinkUnavailable:
                continue
        assert time.monotonic() - t < 2.0 + 3 * 2.0 + 3.0
        assert up.node == other.address
        await up.close()
        stored = await read_all(iggy_settings([other.address], other.username, other.password), raw=True)
        assert [m["id"] for m in stored] == [rec(2, "a").message_id]
    finally:
        iggy_server.resume()
        other.stop()


async def read_all(
    settings: IggySettings, topic: str = "telemetry", *, raw: bool = False
) -> list[dict[str, Any]]:
    """Every message in edge/<topic>, partition by partition: its id and
    partition, and the JSON payload's fields unless `raw`."""
    source = IggyCommandSource(settings, "gw-test", "test-reader")
    out: list[dict[str, Any]] = []
    try:
        for partition in range(settings.partitions):
            offset = 0
            while True:
                batch = await source.poll("edge", topic, partition, offset, 1000)
                if not batch:
                    break
                for m in batch:
                    doc = {} if raw else json.loads(m.payload)
                    out.append({"id": m.message_id, "partition": partition, **doc})
                offset = batch[-1].offset + 1
    finally:
        await source.close()
    return out


def check_delivery(acked: list[tuple[str, int]], stored: list[dict[str, Any]]) -> int:
    """Everything the broker acknowledged is stored; per device the first
    copies are in publish order; copies carry one id.  Returns the number of
    duplicate copies."""
    ids: dict[tuple[str, int], set[int]] = defaultdict(set)
    order: dict[str, list[int]] = defaultdict(list)
    for m in stored:
        key = (m["dev"], m["n"])
        if key not in ids:
            order[m["dev"]].append(m["n"])
        ids[key].add(m["id"])
    missing = sorted(set(acked) - set(ids))
    assert not missing, f"{len(missing)} acknowledged records lost, e.g. {missing[:5]}"
    for dev, seen in order.items():
        assert seen == sorted(seen), f"{dev}: out of order"
    assert all(len(v) == 1 for v in ids.values()), "a copy with another id"
    return len(stored) - len(ids)


async def wait_forwarded(agent: Agent, n: int, timeout: float) -> None:
    await async_wait_until(
        lambda: agent.metrics.value("iggy_edge_forward_records_total") >= n,
        timeout,
        what=f"{n} records forwarded",
    )


def agent_settings(
    tmp_path: Path, broker: Broker, nodes: list[str], server: IggyServer, **kw: Any
) -> Settings:
    iggy = {
        "kind": "iggy",
        "addresses": nodes,
        "username": server.username,
        "password": server.password,
        "request_timeout_s": 5.0,
        "connect_timeout_s": 8.0,
        "partitions": 3,
    }
    return make_settings(tmp_path, broker, iggy=iggy, metrics={"enabled": False}, **kw)


async def publish_through_a_cut(agent: Agent, pub: Publisher, proxy: TcpRelay, cut_s: float = 12.0) -> int:
    """10 readings forwarded, then the link cut for `cut_s` while 5 more come
    every 0.5 s, all acknowledged by the broker; how many were published.
    The link is still cut: the caller restores it."""
    n = 0

    async def publish(count: int) -> None:
        nonlocal n
        for _ in range(count):
            await pub.publish(
                "edge/dev-1/up/t", json.dumps({"dev": "dev-1", "n": n}).encode(), tag=("dev-1", n)
            )
            n += 1

    await publish(10)
    await wait_forwarded(agent, 10, 30)
    await proxy.cut()
    cut_at = time.monotonic()
    while time.monotonic() - cut_at < cut_s:  # records keep coming during the cut
        await publish(5)
        await asyncio.sleep(0.5)
    assert agent.forwarder is not None
    assert not agent.forwarder.up.is_set()
    await pub.wait_all_acked(30)
    return n


@contextlib.asynccontextmanager
async def agent_behind_a_proxy(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer, client_id: str, timeout_s: float | None = None
) -> AsyncIterator[tuple[Agent, Publisher, TcpRelay]]:
    """The agent with the production backoff (0.5 s doubling to a 30 s cap),
    its Iggy behind a proxy the test cuts, and a publisher; ready and
    subscribed, all stopped on exit.  `timeout_s`: the Iggy connect and
    request timeouts (else the defaults)."""
    proxy = await TcpProxy("127.0.0.1", iggy_server.port).start()
    settings = agent_settings(
        tmp_path,
        broker,
        [proxy.address],
        iggy_server,
        forward={"linger_ms": 5, "backoff_initial_s": 0.5, "backoff_max_s": 30.0},
    )
    if timeout_s is not None:
        timeouts = {"connect_timeout_s": timeout_s, "request_timeout_s": timeout_s}
        settings = settings.model_copy(update={"iggy": settings.iggy.model_copy(update=timeouts)})
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    pub = await Publisher(broker.host, broker.port, client_id).connect()
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await wait_subscribed(agent)
        yield agent, pub, proxy
    finally:
        await pub.close()
        agent.stop()
        await asyncio.wait_for(task, 20)
        await proxy.stop()


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
@pytest.mark.iggy
async def test_forwarding_resumes_within_seconds_of_a_long_cut(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """The production backoff (0.5 s doubling to a 30 s cap) with a 12 s cut:
    without the probe the next attempt could come up to 16 s after the link
    returns; with it, within a probe interval (0.5-1 s) plus a connect."""
    async with agent_behind_a_proxy(tmp_path, broker, iggy_server, "pub-cut") as (agent, pub, proxy):
        n = await publish_through_a_cut(agent, pub, proxy)
        assert agent.forwarder is not None
        await proxy.restore()
        back_at = time.monotonic()
        await asyncio.wait_for(agent.forwarder.up.wait(), 30)
        resumed = time.monotonic() - back_at
        print(f"\nrecovery after a 12 s cut: forwarding resumed {resumed:.2f} s after the link returned")
        assert resumed < 5.0, f"resumed {resumed:.1f}s after the link returned"
        await wait_forwarded(agent, n, 30)
        acked = list(pub.acked)
    stored = await read_all(iggy_settings([iggy_server.address], iggy_server.username, iggy_server.password))
    check_delivery(acked, stored)


def forward_errors(agent: Agent) -> float:
    return sum(agent.metrics.value("iggy_edge_forward_errors_total", kind=k) for k in KINDS)


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
@pytest.mark.iggy
async def test_a_failure_right_after_a_long_cut_heals_is_retried_within_seconds(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """The link returns after a 12 s cut (production backoff: it has grown to
    16-30 s), but the server does not answer the first login in time (SIGSTOP
    here; a loaded machine or a fleet logging in at once elsewhere).  That
    failure comes with the server reachable, so no probe cuts the wait after
    it: with the outage's backoff the uplink stayed down up to 30 s after the
    server answered again (19.4 s in one run).  The link's return ends the
    outage, so the backoff starts again from backoff_initial_s.  (The old
    code passed this only when its 0-16 or 0-30 s draw happened to be short;
    it failed with 17.2 and 22.9 s.)"""
    async with agent_behind_a_proxy(tmp_path, broker, iggy_server, "pub-cut-slow", timeout_s=1.0) as (
        agent,
        pub,
        proxy,
    ):
        n = await publish_through_a_cut(agent, pub, proxy)
        assert agent.forwarder is not None
        errors = forward_errors(agent)
        iggy_server.pause()
        try:
            await proxy.restore()
            await async_wait_until(
                lambda: forward_errors(agent) > errors, 15, what="the first attempt after the heal failing"
            )
        finally:
            iggy_server.resume()
        answering_at = time.monotonic()
        await asyncio.wait_for(agent.forwarder.up.wait(), 40)
        resumed = time.monotonic() - answering_at
        print(f"\nthe first attempt after the heal failed; forwarding resumed {resumed:.2f} s later")
        assert resumed < 4.0, f"resumed {resumed:.1f}s after the server answered again"
        await wait_forwarded(agent, n, 30)
        acked = list(pub.acked)
    stored = await read_all(iggy_settings([iggy_server.address], iggy_server.username, iggy_server.password))
    check_delivery(acked, stored)


# -- a real 3-node cluster -------------------------------------------------------------

DEVICES = ("dev-a", "dev-b", "dev-c")
KINDS = ("ambiguous", "rejected", "unavailable")


class Load:
    """QoS1 telemetry from three devices at a steady rate, until stopped."""

    def __init__(self, pub: Publisher, rate_per_s: float = 150.0) -> None:
        self.pub = pub
        self.rate = rate_per_s
        self.n = 0
        self._stop = asyncio.Event()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        while not self._stop.is_set():
            for dev in DEVICES:
                doc = {"dev": dev, "n": self.n}
                await self.pub.publish(f"edge/{dev}/up/t", json.dumps(doc).encode(), tag=(dev, self.n))
            self.n += 1
            await asyncio.sleep(len(DEVICES) / self.rate)

    async def stop(self) -> None:
        self._stop.set()
        await self.task
        await self.pub.wait_all_acked(30)

    async def cancel(self) -> None:
        self._stop.set()
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)


def restart_killed_node(node: IggyServer) -> str:
    """Start a SIGKILLed node again.  Server 0.9.0-edge.5 sometimes refuses
    to recover its own journal after a SIGKILL ("interior WAL corruption ...
    refusing to truncate", 2 runs in 4 here); the operator's remedy is to
    replace the node: an empty data directory, repaired from its peers."""
    try:
        node.start(timeout=90)
        return "restarted"
    except RuntimeError as e:
        if "WAL corruption" not in str(e):
            raise
    shutil.rmtree(node.workdir / "data")
    node.start(timeout=90)
    return "replaced (empty data dir): the server could not recover its journal after SIGKILL"


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
@pytest.mark.iggy
async def test_return_poll_resumes_within_seconds_of_a_long_cut(
    tmp_path: Path, broker: Broker, iggy_server: IggyServer
) -> None:
    """The return path's backoff (poll interval doubling to 30 s) with a 12 s
    cut: without the probe the next poll could come up to 16 s after the
    link returns; with it, within a probe interval (0.5-1 s) plus a connect.
    The command is written straight to the server while the agent's link is
    still cut, so its delivery time measures the poll's recovery."""
    proxy = await TcpProxy("127.0.0.1", iggy_server.port).start()
    settings = agent_settings(
        tmp_path, broker, [proxy.address], iggy_server, downlink={"enabled": True, "poll_interval_s": 0.5}
    )
    await provision(settings)
    rt = return_topic(settings)
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    direct = iggy_settings([iggy_server.address], iggy_server.username, iggy_server.password)
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await wait_subscribed(agent)
        first = make_command("dev-r", "go", {"i": 0})
        await send_command(direct, rt.stream, rt.topic, rt.partition, first.wire(), first.headers())
        await async_wait_until(lambda: first.id in dev.ids(), 30, what="a command before the cut")
        errors = agent.metrics.value("iggy_edge_downlink_errors_total", kind="poll")
        await proxy.cut()
        cut_at = time.monotonic()
        await async_wait_until(
            lambda: agent.metrics.value("iggy_edge_downlink_errors_total", kind="poll") >= errors + 4,
            30,
            what="the return poll backing off",
        )
        await asyncio.sleep(max(0.0, 12.0 - (time.monotonic() - cut_at)))
        cmd = make_command("dev-r", "go", {"i": 1})
        await send_command(direct, rt.stream, rt.topic, rt.partition, cmd.wire(), cmd.headers())
        await proxy.restore()
        back_at = time.monotonic()
        await async_wait_until(
            lambda: cmd.id in dev.ids(), 30, interval=0.05, what="the command after the cut"
        )
        resumed = time.monotonic() - back_at
        print(f"\nreturn path after a 12 s cut: command delivered {resumed:.2f} s after the link returned")
        assert resumed < 5.0, f"delivered {resumed:.1f}s after the link returned"
    finally:
        await dev.stop()
        agent.stop()
        await asyncio.wait_for(task, 20)
        await proxy.stop()


SERVER_FAULTS = ("dropping out-of-order prepare", "Cannot append message", "non-primary partition replica")


async def skip_if_the_survivors_cannot_commit(
    survivors: list[IggyServer], settings: Settings, error: BaseException, when: str = "after the kill"
) -> None:
    """The agent did not resume after the kill (or, `when` says, did not
    forward before it: a cluster whose partitions' primaries sit away from
    the metadata leader the SDK talks to refuses every write to them,
    "non-primary partition replica", docs/scaling.md run E).  When a fresh client cannot
    write to the same topic through the surviving nodes either, the cluster
    is at fault, not the agent: skip, with the evidence.  Seen with server
    0.9.0-edge.5 under load: after the leader was SIGKILLed, the surviving
    backup logged "dropping out-of-order prepare (gap)" and "Cannot append
    message" for the telemetry partitions, so the new primary had no quorum
    and answered no send (the agent retried with the same ids, nothing
    lost).  Otherwise the original failure stands."""
    first = survivors[0]
    direct = iggy_settings([n.address for n in survivors], first.username, first.password)
    stream, topic = "edge", "telemetry"  # where the load goes (the default route of edge/+/up/#)
    stuck = []
    for part in range(settings.iggy.partitions):
        try:
            await asyncio.wait_for(send_command(direct, stream, topic, part, b'{"probe": 1}'), 20)
        except (UplinkAmbiguous, UplinkUnavailable, TimeoutError) as e:  # no answer: not an error reply
            stuck.append(f"{stream}/{topic}/{part}: {e or type(e).__name__}")
    if not stuck:
        raise error
    seen = {f: sum(n.log_path.read_text(errors="replace").count(f) for n in survivors) for f in SERVER_FAULTS}
    pytest.skip(
        f"server fault, not the agent: {when} the nodes commit no write"
        f" ({'; '.join(stuck)}); their logs: {seen}; the agent's wait: {error or type(error).__name__}"
    )


@pytest.mark.iggy
async def test_cluster_node_in_use_is_killed_under_load(
    tmp_path: Path, broker: Broker, iggy_cluster: IggyCluster
) -> None:
    cluster = iggy_cluster
    first = cluster.nodes[0]
    settings = agent_settings(
        tmp_path,
        broker,
        cluster.addresses,
        first,
        forward={"linger_ms": 5, "backoff_initial_s": 0.5, "backoff_max_s": 30.0},
        downlink={"enabled": True, "poll_interval_s": 0.2},
    )
    await provision(settings)
    rt = return_topic(settings)
    agent = build_agent(settings)
    task = asyncio.create_task(agent.run())
    pub = await Publisher(broker.host, broker.port, "pub-load").connect()
    dev = await DeviceSubscriber(broker.host, broker.port, "edge/+/down/#").start()
    load: Load | None = None
    try:
        await asyncio.wait_for(agent.ready.wait(), 15)
        await wait_subscribed(agent)
        load = Load(pub)
        try:
            await wait_forwarded(agent, 300, 60)
        except AssertionError as e:
            await skip_if_the_survivors_cannot_commit(cluster.nodes, settings, e, when="before the kill")
        # The SDK may move a session to the leader after login, so the node
        # in use is not always the one dialed: it is the node the agent sends
        # its load to.
        in_use = await busiest_peer(cluster.addresses)
        victim = cluster.node_at(in_use)
        fwd = agent.forwarder
        assert fwd is not None
        before = agent.metrics.value("iggy_edge_forward_records_total")
        survivors = [n for n in cluster.nodes if n is not victim]
        victim.kill()
        killed_at = time.monotonic()
        try:
            await async_wait_until(lambda: not fwd.up.is_set(), 30, what="the uplink notices the kill")
            await asyncio.wait_for(fwd.up.wait(), 60)
            failover = time.monotonic() - killed_at
            await async_wait_until(
                lambda: agent.metrics.value("iggy_edge_forward_records_total") >= before + 300,
                60,
                what="forwarding on another node",
            )
        except (TimeoutError, AssertionError) as e:
            await skip_if_the_survivors_cannot_commit(survivors, settings, e)
        new_leader = cluster.wait_leader(30, among=survivors)
        print(f"\nfailover: node in use ({in_use}) SIGKILLed; forwarding resumed after {failover:.2f} s")
        assert failover < 30.0, f"failover took {failover:.1f}s"
        assert new_leader != in_use

        # A command sent through a surviving node reaches the device.
        via = iggy_settings([survivors[0].address], first.username, first.password)
        cmd = make_command("dev-a", "go", {"i": 1})
        await send_command(via, rt.stream, rt.topic, rt.partition, cmd.wire(), cmd.headers())
        await async_wait_until(lambda: cmd.id in dev.ids(), 60, what="command delivered after failover")

        # The dead node returns: forwarding goes on as before, and the node
        # catches up (it holds what was written while it was dead).
        rejoined = restart_killed_node(victim)
        mark = agent.metrics.value("iggy_edge_forward_records_total")
        failures = sum(agent.metrics.value("iggy_edge_forward_errors_total", kind=k) for k in KINDS)
        await async_wait_until(
            lambda: agent.metrics.value("iggy_edge_forward_records_total") >= mark + 600,
            60,
            what="forwarding after the return",
        )
        assert sum(agent.metrics.value("iggy_edge_forward_errors_total", kind=k) for k in KINDS) == failures
        await load.stop()
        await wait_forwarded(agent, len(pub.acked), 60)
        # The count also holds records of other topics (the command's ack),
        # and the broker acknowledged the last readings before the agent got
        # them, so it can be reached with those still on their way: wait
        # (bounded) until Iggy holds every acknowledged reading before the
        # agent stops; check_delivery below says what is missing if not.
        wanted = set(pub.acked)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            held = {
                (m["dev"], m["n"])
                for m in await read_all(iggy_settings([survivors[0].address], first.username, first.password))
            }
            if wanted <= held:
                break
            await asyncio.sleep(0.5)
        acked = list(pub.acked)
    finally:
        if load is not None:
            await load.cancel()
        await dev.stop()
        await pub.close()
        agent.stop()
        await asyncio.wait_for(task, 20)
    read = iggy_settings([survivors[0].address], first.username, first.password)
    duplicates = check_delivery(acked, await read_all(read))
    print(f"{len(acked)} acknowledged, 0 lost, {duplicates} duplicate copies (same ids)")
    print(f"dead node {rejoined}")

    # The returned node catches up: it serves every acknowledged record too.
    back = iggy_settings([victim.address], first.username, first.password)
    deadline = time.monotonic() + 60
    while True:
        try:
            check_delivery(acked, await read_all(back))
            break
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(1.0)


# -- doctor ----------------------------------------------------------------------------


@pytest.mark.iggy
def test_doctor_checks_every_node_and_names_the_leader(
    tmp_path: Path, broker: Broker, iggy_cluster: IggyCluster
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    nodes = [*iggy_cluster.addresses, dead]
    leader = iggy_cluster.wait_leader(30)
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-doc"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nhost = "127.0.0.1"\nport = {broker.port}\n'
        f'[metrics]\nlisten = "127.0.0.1:{free_port()}"\n'
        f'[iggy]\nkind = "iggy"\naddresses = {json.dumps(nodes)}\n'
        f'username = "{iggy_cluster.nodes[0].username}"\n'
    )
    argv = ["doctor", "-c", str(config), "--env-file", str(tmp_path / "no-env"), "--json"]
    result = CliRunner().invoke(app, argv, env={"IGGY_PASSWORD": iggy_cluster.nodes[0].password})
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["iggy nodes"]["status"] == "warn", checks["iggy nodes"]
    assert "3 of 4 reachable" in checks["iggy nodes"]["detail"]
    assert dead in checks["iggy nodes"]["detail"]
    assert checks["iggy"]["status"] == "ok", checks["iggy"]
    assert checks["iggy cluster"]["status"] == "ok", checks["iggy cluster"]
    assert f"({leader})" in checks["iggy cluster"]["detail"]
