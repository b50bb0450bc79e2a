"""A backlog queued in the broker is taken in bounded bites.

Mosquitto 2.0.11 keeps to the agent's receive maximum only for the first
burst to a resumed session; after that it sends a queued backlog as fast as
the agent reads.  Ingest stops reading while READ_PAUSE_AT records wait for
their commit, so memory stays bounded and TCP holds the rest in the broker.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from iggy_edge.ingest_acks import READ_PAUSE_AT

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import Publisher
from tests.support.wait import async_wait_until

BACKLOG = 3 * READ_PAUSE_AT


async def test_a_broker_backlog_is_read_in_bounded_bites(tmp_path: Path, broker: Broker) -> None:
    settings = make_settings(tmp_path, broker)
    async with running_agent(settings):
        pass  # creates the persistent session and its subscriptions
    pub = await Publisher(broker.host, broker.port, "bp-pub", max_inflight=2000).connect()
    try:
        for i in range(BACKLOG):
            await pub.publish(f"edge/bp-{i % 8}/up/env", b'{"seq": %d, "t": 21.5}' % i, qos=1)
        await pub.wait_all_acked(timeout=60)
    finally:
        await pub.close()

    async with running_agent(settings) as agent:
        assert agent.outbox is not None
        outbox = agent.outbox
        most = 0

        async def watch() -> None:
            nonlocal most
            while True:
                most = max(most, outbox.pending_count)
                await asyncio.sleep(0)

        watcher = asyncio.create_task(watch())
        try:
            await async_wait_until(lambda: outbox.records >= BACKLOG, 60, what="backlog committed")
        finally:
            watcher.cancel()
        assert outbox.records == BACKLOG
        # one 64 KiB read past the limit at most (~700 of these messages)
        assert most < READ_PAUSE_AT + 2_000, most
        assert agent.metrics.value("iggy_edge_ingest_read_pauses_total") > 0
