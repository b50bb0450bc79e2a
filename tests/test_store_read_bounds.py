"""Large payloads: a batch read loads no more payload bytes than the batch
may hold, and the forwarder does not wait for a record count bytes already fill.

`read_batch(max_records, max_bytes)` used to fetch `max_records` rows and cut
them at `max_bytes` afterwards: with a backlog of 200 kB payloads it loaded
200 MB to return five records (1 MiB), on every read -- on a gateway with a
few hundred MB, after an outage with large messages.  The cut is now made in
SQLite on the payload lengths.  Python's allocations are traced
(tracemalloc sees the bytes objects the sqlite3 module creates)."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest
from iggy_edge.config import ForwardSettings
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord
from iggy_edge.store import Outbox
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.wait import async_wait_until
from tests.test_store import buffer_settings, incoming, open_box, submit_all

pytestmark = pytest.mark.unit

MiB = 1 << 20


async def _peak_of_read(
    box: Outbox, max_records: int, max_bytes: int, after: int = 0
) -> tuple[list[OutboundRecord], int]:
    tracemalloc.start()
    try:
        batch = await box.read_batch(max_records, max_bytes, after=after)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return batch, peak


async def test_a_backlog_of_large_payloads_is_read_a_batch_at_a_time(tmp_path: Path) -> None:
    box = await open_box(tmp_path / "buffer.db", buffer_settings(), Metrics())
    try:
        big = [incoming("dev-1", bytes([i]) * 200_000) for i in range(120)]  # 24 MB
        for lo in range(0, len(big), 20):
            await submit_all(box, big[lo : lo + 20])
        batch, peak = await _peak_of_read(box, 1000, MiB)
        assert [r.payload for r in batch] == [b.payload for b in big[:5]]  # 5 x 200 kB <= 1 MiB < 6
        assert peak < 2 * MiB, f"reading 5 records took {peak / MiB:.1f} MiB"
        # The next read goes on after the cut, and an over-size single record
        # still comes out on its own (at least one record per read).
        batch2, _ = await _peak_of_read(box, 1000, MiB, after=batch[-1].seq)
        assert [r.payload for r in batch2] == [b.payload for b in big[5:10]]
        one, _ = await _peak_of_read(box, 1000, 1000)
        assert [r.payload for r in one] == [big[0].payload]
    finally:
        await box.close()


async def test_small_records_before_large_ones_are_cut_at_the_byte_limit(tmp_path: Path) -> None:
    box = await open_box(tmp_path / "buffer.db", buffer_settings(), Metrics())
    try:
        small = [incoming("dev-1", b"s%03d" % i) for i in range(100)]  # 4 bytes each
        large = [incoming("dev-1", bytes([i]) * 300_000) for i in range(10)]
        await submit_all(box, small)
        await submit_all(box, large)
        batch, peak = await _peak_of_read(box, 1000, MiB)
        # 400 bytes of small ones, then three 300 kB ones (900,400 <= 1 MiB), not a fourth.
        assert [r.payload for r in batch] == [i.payload for i in small + large[:3]]
        assert peak < 2 * MiB
    finally:
        await box.close()


async def test_the_payload_high_water_mark_survives_a_restart_and_resets_when_empty(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box = await open_box(path, buffer_settings(), Metrics())
    await submit_all(box, [incoming("dev-1", b"x" * 100), incoming("dev-1", b"y" * 150_000)])
    assert box.payload_high == 150_000
    await box.close()
    box = await open_box(path, buffer_settings(), Metrics())  # read back from the file
    try:
        assert box.payload_high == 150_000
        batch, peak = await _peak_of_read(box, 1000, 100_000)
        assert [len(r.payload) for r in batch] == [100]  # the large one does not fit after it
        assert peak < MiB
        await box.confirm(await box.read_batch(1000, MiB))
        assert box.records == 0
        assert box.payload_high == 0
        await submit_all(box, [incoming("dev-1", b"z" * 60)])
        assert box.payload_high == 60
    finally:
        await box.close()


async def test_a_backlog_of_large_payloads_does_not_wait_for_a_full_count(tmp_path: Path) -> None:
    """The forwarder lingers for a fuller batch only while the unread records
    fill neither `batch_records` nor `batch_bytes`: twelve 300 kB records
    fill four batches by bytes, so none of them waits out the (here 30 s)
    linger for a thousand records (before: one linger per read, so a drain
    of large messages ran at batch_bytes per linger_ms, 20 MB/s)."""
    box = await open_box(tmp_path / "buffer.db", buffer_settings(), Metrics())
    await submit_all(box, [incoming("dev-1", bytes([i]) * 300_000) for i in range(12)])
    iggy = MemoryIggy(keep_payloads=False)
    fwd = Forwarder(box, iggy.uplink(), ForwardSettings(linger_ms=30_000, batch_records=1000), Metrics())
    task = asyncio.create_task(fwd.run())
    try:
        # 9 of 12 go without any linger; the last three (900 kB, under a
        # batch) wait for it once, as any short tail does.
        await async_wait_until(lambda: box.records <= 3, 10, what="the large records forwarded")
    finally:
        fwd.stop()
        await task
        await box.close()
    assert iggy.count() >= 9
