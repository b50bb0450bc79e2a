"""Ingest's fast path (no task per message, one write per group of acks):
QoS2 still completes its handshake after the commit, acknowledgements of a
group share one write, and counters catch up once the group is acknowledged."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import publish_all
from tests.support.wait import async_wait_until

N_QOS2 = 10


def reading(seq: int) -> bytes:
    return json.dumps({"seq": seq}).encode()


async def test_qos2_messages_are_committed_and_acknowledged(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker, mqtt={"subscriptions": [{"filter": "edge/+/up/#", "qos": 2}]})
    async with running_agent(settings) as agent:
        assert agent.ingest is not None
        assert agent.ingest._client is not None
        handler = agent.ingest._client._package_handler
        assert "_handle_qos_2_publish_packet" in vars(handler), "fast path not installed"
        # mosquitto_pub exits 0 only after its QoS2 flow with the broker completed
        for i in range(N_QOS2):
            proc = await asyncio.create_subprocess_exec(
                *("mosquitto_pub", "-h", broker.host, "-p", str(broker.port), "-q", "2"),
                *("-t", "edge/dev-q2/up/env", "-m", reading(i).decode()),
            )
            assert await asyncio.wait_for(proc.wait(), 30) == 0
        await async_wait_until(lambda: agent.outbox is not None and agent.outbox.records == N_QOS2, 10)
        await async_wait_until(lambda: agent.ingest is not None and agent.ingest._handlers == 0, 10)
        assert agent.metrics.value("iggy_edge_ingest_messages_total", qos="2") == N_QOS2


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
        await async_wait_until(lambda: agent.ingest is not None and agent.ingest._handlers == 0, 10)
        assert agent.metrics.value("iggy_edge_ingest_messages_total", qos="1") == 3000
        assert agent.metrics.value("iggy_edge_ingest_payload_bytes_total") == sum(
            len(reading(i)) for i in range(3000)
        )
