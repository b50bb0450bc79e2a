"""A delete that fails after Iggy confirmed a batch: the forwarder stage fails,
the supervisor restarts it, the batch goes out again -- and every re-sent
record is counted (issue 8, "smaller")."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings, ForwardSettings
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord, Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.wait import async_wait_until

pytestmark = pytest.mark.unit


async def test_every_resend_after_a_failed_delete_is_counted(tmp_path: Path) -> None:
    metrics = Metrics()
    box = await Outbox.open(
        tmp_path / "buffer.db", BufferSettings(commit_interval_ms=0), "gw-resend", metrics
    )
    box.start()
    n = 21
    futures = [
        box.submit(Incoming(Route("edge", "telemetry", "dev"), "edge/dev/up/env", 1, False, i + 1, b"%d" % i))
        for i in range(n)
    ]
    for f in futures:
        await f
    real_confirm = box.confirm
    failures = 4

    async def failing_confirm(
        batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None
    ) -> int:
        nonlocal failures
        if failures:
            failures -= 1
            raise sqlite3.OperationalError("disk I/O error")
        return await real_confirm(batch, confirmed)

    box.confirm = failing_confirm  # type: ignore[method-assign]
    iggy = MemoryIggy()
    fwd = Forwarder(box, iggy.uplink(), ForwardSettings(linger_ms=0, batch_records=100), metrics)
    try:
        restarts = 0
        while True:  # what the supervisor does: run() again after the stage failed
            task = asyncio.create_task(fwd.run())
            try:
                await async_wait_until(
                    lambda t=task: t.done() or box.records == 0,  # type: ignore[misc]
                    20,
                    what="a failure or a drain",
                )
                if task.done():
                    task.result()
                fwd.stop()
                await task
                break
            except sqlite3.OperationalError:
                restarts += 1
        assert restarts == 4
        assert box.records == 0
        assert iggy.count("edge", "telemetry") == 5 * n  # 1 + 4 re-sends, same ids
        ids = iggy.ids("edge", "telemetry")
        assert len(set(ids)) == n
        assert metrics.value("iggy_edge_forward_resent_records_total") == 4 * n
        assert metrics.value("iggy_edge_forward_records_total") == n
    finally:
        await box.close()
