"""The outbox shares one SQLite connection between the commit loop, the
forwarder and housekeeping: their transactions must not interleave (a second
BEGIN inside the first would fail, and its ROLLBACK would undo the other's
rows or let an insert commit at the delete's synchronous level)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox

pytestmark = pytest.mark.unit


async def test_commits_confirms_and_expiry_interleave_without_errors(tmp_path: Path) -> None:
    metrics = Metrics()
    box = await Outbox.open(tmp_path / "buffer.db", BufferSettings(commit_interval_ms=0), "gw-conc", metrics)
    box.start()
    route = Route("edge", "telemetry", "dev1")
    now_us = time.time_ns() // 1000
    total = 3000
    forwarded: list[int] = []

    async def produce() -> None:
        for i in range(total):
            fut = box.submit(Incoming(route, "edge/dev1/up/env", 1, False, now_us, b'{"seq":%d}' % i, i))
            if i % 7 == 0:
                await fut  # groups of varied sizes
            if i % 50 == 0:
                await asyncio.sleep(0)

    async def forward() -> None:
        while len(forwarded) < total:
            if not await box.wait_for_data(timeout=0.01):
                continue
            batch = await box.read_batch(37, 1 << 20)
            if len(batch) > 2 and batch[0].seq % 2:
                # partial confirmation: the explicit-transaction path
                keep = frozenset(r.seq for r in batch[: len(batch) // 2])
                await box.confirm(batch, keep)
                forwarded.extend(r.seq for r in batch if r.seq in keep)
            else:
                await box.confirm(batch)
                forwarded.extend(r.seq for r in batch)

    async def housekeeping() -> None:
        while len(forwarded) < total:
            await box.expire()  # nothing is old enough: only the transaction matters
            await box.dead_letter(
                mqtt_topic="x/y", payload=b"?", qos=1, retain=False, reason="unroutable", detail="test"
            )
            await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(produce(), forward(), housekeeping()), 60)
    await box.close()
    assert metrics.value("iggy_edge_store_errors_total") == 0
    assert sorted(forwarded) == list(range(1, total + 1))
    assert box.records == 0
