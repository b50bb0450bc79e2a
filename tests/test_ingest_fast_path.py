"""Ingest's fast path (no task per message, one write per group of acks),
against a real Mosquitto: the hooks are in place, QoS2 still completes its
handshake after the commit, the acknowledgements of a group commit leave in
ONE write on the real socket (counted), counters catch up once the group is
acknowledged, and an unexpected error closes the session instead of
stopping reads."""

from __future__ import annotations

import asyncio
import json
import random
from pathlib import Path
from typing import Any, cast

import gmqtt
from gmqtt.mqtt.protocol import MQTTProtocol
from iggy_edge import gmqtt_hooks, mqtt_codec
from iggy_edge.runtime import Agent

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import Publisher, agent_transport, publish_all
from tests.support.wait import async_wait_until

N_QOS2 = 10
GROUP = 300


def reading(seq: int) -> bytes:
    return json.dumps({"seq": seq}).encode()


def live_client(agent: Agent) -> Any:
    assert agent.ingest is not None
    assert agent.ingest.client is not None
    return agent.ingest.client


async def test_hooks_are_in_place_on_the_live_session(tmp_path: Path, broker: Broker) -> None:
    async with running_agent(make_settings(tmp_path, broker)) as agent:
        assert gmqtt_hooks.installed(live_client(agent)) == dict.fromkeys(
            ("reconnect", "publish", "qos1", "qos2", "shortcut", "throttle", "framing"), True
        )


async def test_qos2_messages_are_committed_and_acknowledged(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker, mqtt={"subscriptions": [{"filter": "edge/+/up/#", "qos": 2}]})
    async with running_agent(settings) as agent:
        assert gmqtt_hooks.installed(live_client(agent))["qos2"]
        # mosquitto_pub exits 0 only after its QoS2 flow with the broker completed
        for i in range(N_QOS2):
            proc = await asyncio.create_subprocess_exec(
                *("mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-q", "2"),
                *("-t", "edge/dev-q2/up/env", "-m", reading(i).decode()),
            )
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == N_QOS2, 10)
        await async_wait_until(lambda: agent.ingest is not None and agent.ingest.in_flight == 0, 10)
        assert agent.metrics.value("iggy_edge_ingest_messages_total", qos="2") == N_QOS2


async def test_acks_of_a_group_commit_leave_in_one_socket_write(tmp_path: Path, broker: Broker) -> None:
    """Count the writes on the agent's real transport: every write that holds
    PUBACKs holds the acks of one whole group commit.  A group closes at
    GROUP records (or after 1 s), so GROUP messages make one or a few groups,
    never one write per message."""
    settings = make_settings(
        tmp_path,
        broker,
        buffer={"commit_max_records": GROUP, "commit_interval_ms": 1000},
        mqtt={"receive_maximum": 2 * GROUP},
    )
    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        transport = agent_transport(live_client(agent))
        writes: list[bytes] = []
        real_write = transport.write

        def counting_write(data: Any) -> None:
            writes.append(bytes(data))
            real_write(data)

        transport.write = counting_write  # type: ignore[method-assign]
        commits_before = agent.metrics.value("iggy_edge_store_commit_seconds_count")
        pub = await Publisher(broker.host, broker.port, "pub-group", max_inflight=GROUP).connect()
        try:
            for i in range(GROUP):
                await pub.publish("edge/dev-w/up/env", reading(i))
            await pub.wait_all_acked(timeout=30)
        finally:
            await pub.close()
        await async_wait_until(lambda: agent.ingest is not None and agent.ingest.in_flight == 0, 10)
        groups = agent.metrics.value("iggy_edge_store_commit_seconds_count") - commits_before
    ack_writes = []
    for data in writes:
        packets, used = mqtt_codec.split_packets(data)
        assert used == len(data), "a write ends inside a packet"
        acks = [p for p in packets if p[0] == mqtt_codec.PUBACK]
        if acks:
            assert len(acks) == len(packets), "acks share a write only with acks"
            ack_writes.append(len(acks))
    assert sum(ack_writes) == GROUP
    assert len(ack_writes) == groups, f"{len(ack_writes)} writes for {groups:.0f} group commits"
    assert groups <= 3, f"{groups:.0f} group commits for {GROUP} messages sent at once"


async def test_an_unexpected_error_closes_the_session_which_reconnects(
    tmp_path: Path, broker: Broker
) -> None:
    """gmqtt's own exception guard is bypassed by the shortcut; ours logs,
    counts and reconnects, and the broker redelivers the message."""
    async with running_agent(make_settings(tmp_path, broker)) as agent:
        assert agent.ingest is not None
        first_client = live_client(agent)
        real_accept = agent.ingest._accept  # noqa: SLF001 - inject a bug at the routing seam
        failed: list[str] = []

        def buggy_once(topic: str | bytes, *args: Any) -> Any:
            if not failed:
                failed.append(str(topic))
                raise RuntimeError("simulated bug in the message path")
            return real_accept(topic, *args)

        agent.ingest._accept = buggy_once  # type: ignore[method-assign, assignment]  # noqa: SLF001 - as above
        await publish_all(broker.host, broker.port, "pub-bug", [("edge/dev-bug/up/env", reading(1))])
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == 1, 20)
        assert failed == ["edge/dev-bug/up/env"]
        assert agent.metrics.value("iggy_edge_ingest_handler_errors_total") == 1
        assert live_client(agent) is not first_client, "the session was not reconnected"
        assert agent.metrics.value("iggy_edge_ingest_reconnects_total") >= 1


async def test_many_qos1_messages_acknowledged_once_committed(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings) as agent:
        await publish_all(
            broker.host,
            broker.port,
            "pub-many",
            [(f"edge/dev{i % 7}/up/env", reading(i)) for i in range(3000)],
            qos=1,
        )
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == 3000, 20)
        await async_wait_until(lambda: agent.ingest is not None and agent.ingest.in_flight == 0, 10)
        assert agent.metrics.value("iggy_edge_ingest_messages_total", qos="1") == 3000
        assert agent.metrics.value("iggy_edge_ingest_payload_bytes_total") == sum(
            len(reading(i)) for i in range(3000)
        )


class _Recorder:
    """A PUBLISH sink (gmqtt_hooks.PublishSink) that keeps what it gets."""

    def __init__(self) -> None:
        self.got: list[tuple[int, bytes]] = []

    def raw_publish(self, conn: Any, cmd: int, body: bytes, v5: bool) -> bool:
        self.got.append((cmd, body))
        return True

    def parsed_publish(self, *args: Any) -> None:
        pass

    def hook_error(self, exc: Exception) -> None:
        raise AssertionError(exc)


def _gmqtt_framing(stream: bytes, chunks: list[int]) -> tuple[list[tuple[int, bytes]], list[int]]:
    """What gmqtt's own `_read_packet` delivers of `stream` read in `chunks`."""
    got: list[tuple[int, bytes]] = []
    fake = cast(Any, type("P", (), {}))()
    delivered = type("C", (), {"put_package": lambda _s, pkg: got.append((pkg.cmd, pkg.data))})
    fake._connection = delivered()  # noqa: SLF001 - where gmqtt's framing delivers
    return got, _feed(lambda buf: MQTTProtocol._read_packet(fake, buf), stream, chunks)  # noqa: SLF001


def _feed(read: Any, stream: bytes, chunks: list[int]) -> list[int]:
    """gmqtt's read loop: append a chunk, frame, keep the rest."""
    buf, pos, taken = b"", 0, []
    for n in chunks:
        buf += stream[pos : pos + n]
        pos += n
        size = read(buf)
        taken.append(size)
        if size == -1:
            break
        buf = buf[size:]
    return taken


async def test_framing_hands_publishes_over_as_gmqtt_frames_them(broker: Broker) -> None:
    """The connection hook frames the socket's bytes itself (no Package per
    PUBLISH): the same packets, bodies and consumed sizes as gmqtt's own
    `_read_packet`, for every way the stream is cut into reads, long
    Remaining Lengths and a malformed one included."""
    sink = _Recorder()
    client = gmqtt.Client("canary-framing")
    gmqtt_hooks.install_publish_hooks(client, sink)
    await client.connect(broker.host, broker.port)
    try:
        gmqtt_hooks.install_connection_hooks(client, lambda: None)
        protocol = vars(client)["_package_handler"].current_connection._protocol  # noqa: SLF001
        assert gmqtt_hooks.installed(client)["framing"]
        packets = [
            mqtt_codec.publish(f"edge/d{i}/up/env", b"x" * size, qos=i % 2, mid=i + 1)
            for i, size in enumerate((1, 60, 130, 300, 20_000, 0, 70_000))
        ]
        stream = b"".join(packets)
        rng = random.Random(7)
        for _ in range(30):
            chunks = []
            left = len(stream)
            while left > 0:
                chunks.append(min(left, rng.choice((1, 2, 3, 50, 1000, 65536))))
                left -= chunks[-1]
            sink.got.clear()
            expected, expected_sizes = _gmqtt_framing(stream, chunks)
            assert _feed(protocol._read_packet, stream, chunks) == expected_sizes  # noqa: SLF001
            assert sink.got == expected
            assert len(sink.got) == len(packets)
        # a Remaining Length that never ends: gmqtt waits for more (it gives
        # -1 only once 256 MB are in), and so does the hook
        endless = b"\x30\xff\xff\xff\xff\x01" + b"x" * 10
        expected_sizes = _gmqtt_framing(endless, [len(endless)])[1]
        assert _feed(protocol._read_packet, endless, [len(endless)]) == expected_sizes == [0]  # noqa: SLF001
    finally:
        await client.disconnect()
