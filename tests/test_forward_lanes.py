"""The pipelined forwarder (issue 14): lanes confirm out of order, deletes
follow each record's own confirmation, a crash re-sends only what was not
confirmed (same ids), and per key the order holds through failures."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings, ForwardSettings
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord, Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.store.reader import seq_ranges
from iggy_edge.uplink.memory import MemoryIggy, MemoryUplink
from iggy_edge.uplink.partition import partition_for
from iggy_edge.uplink.protocol import Lane

from tests.support.wait import async_wait_until

pytestmark = pytest.mark.unit

BIG = 1 << 30
PARTITIONS = 3


class WatchedUplink(MemoryUplink):
    """Records what Iggy confirmed; the lanes of `held` partitions wait for
    `release` before they store anything; `jitter` delays every request."""

    def __init__(self, iggy: MemoryIggy, held: frozenset[int] = frozenset(), jitter: float = 0.0) -> None:
        super().__init__(iggy)
        self.held = held
        self.release = asyncio.Event()
        self.holding = 0
        self.jitter = jitter
        self.confirmed: set[int] = set()
        self.rng = random.Random(14)

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        if lane[2] in self.held:
            self.holding += 1
            await self.release.wait()
        if self.jitter:
            await asyncio.sleep(self.rng.uniform(0, self.jitter))
        await super().send_lane(lane, records)
        self.confirmed.update(r.seq for r in records)


def watch_deletes(box: Outbox, uplink: WatchedUplink) -> set[int]:
    """Every delete is checked: only seqs Iggy confirmed before it."""
    deleted: set[int] = set()
    real = box.confirm

    async def checked(batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        seqs = {r.seq for r in batch} if confirmed is None else {r.seq for r in batch} & confirmed
        early = seqs - uplink.confirmed
        assert not early, f"deleted before Iggy confirmed them: {sorted(early)[:10]}"
        deleted.update(seqs)
        return await real(batch, confirmed)

    box.confirm = checked  # type: ignore[method-assign]
    return deleted


async def filled(path: Path, devices: int, per_device: int) -> tuple[Outbox, dict[int, OutboundRecord]]:
    box = await Outbox.open(path, BufferSettings(commit_interval_ms=0), "gw-lanes", Metrics())
    box.start()
    routes = [Route("edge", "telemetry", f"dev{d}") for d in range(devices)]
    futures = [
        box.submit(Incoming(routes[d], f"edge/dev{d}/up/env", 1, False, i, b'{"seq":%d}' % i, i))
        for i in range(per_device)
        for d in range(devices)
    ]
    for f in futures:
        await f
    return box, {r.seq: r for r in await box.read_batch(BIG, BIG)}


def assert_per_key_order(iggy: MemoryIggy, records: dict[int, OutboundRecord]) -> None:
    """Per key, the stored ids (first copies) are in outbox order."""
    by_id = {r.message_id: r for r in records.values()}
    for key, ids in iggy.ids_by_key("edge", "telemetry").items():
        firsts = list(dict.fromkeys(ids))
        seqs = [by_id[i].seq for i in firsts]
        assert seqs == sorted(seqs), f"{key}: out of order"


async def test_lanes_confirm_out_of_order_and_a_crash_resends_only_the_unconfirmed(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    box, records = await filled(path, devices=30, per_device=20)
    held = partition_for("dev0", PARTITIONS)
    iggy = MemoryIggy(partitions=PARTITIONS)
    uplink = WatchedUplink(iggy, held=frozenset({held}))
    deleted = watch_deletes(box, uplink)
    fwd = Forwarder(box, uplink, ForwardSettings(linger_ms=0, batch_records=50), Metrics())
    task = asyncio.create_task(fwd.run())
    # The held lane has a request in flight; the other lanes go on until the
    # read-ahead bound is full of the held lane's records, and their
    # confirmations are deleted.
    await async_wait_until(
        lambda: uplink.holding == 1 and uplink.confirmed and deleted == uplink.confirmed and box.records > 0,
        10,
        what="the other lanes to confirm and delete",
    )
    await asyncio.sleep(0.2)  # nothing else can move
    assert deleted == uplink.confirmed
    held_seqs = {s for s, r in records.items() if partition_for(r.key, PARTITIONS) == held}
    assert not held_seqs & uplink.confirmed
    oldest_left = min(set(records) - deleted)
    assert oldest_left in held_seqs
    assert any(s > oldest_left for s in deleted), "later lanes were confirmed and deleted first"

    # Crash: the forwarder dies with the held request in flight (never stored).
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    await box.close()
    box = await Outbox.open(path, BufferSettings(commit_interval_ms=0), "gw-lanes", Metrics())
    box.start()
    try:
        left = await box.read_batch(BIG, BIG)
        assert {r.seq for r in left} == set(records) - uplink.confirmed
        assert all(r.message_id == records[r.seq].message_id for r in left), "same ids after the restart"

        restarted = WatchedUplink(iggy)
        restarted.confirmed = uplink.confirmed  # what Iggy already had
        watch_deletes(box, restarted)
        fwd = Forwarder(box, restarted, ForwardSettings(linger_ms=0, batch_records=50), Metrics())
        task = asyncio.create_task(fwd.run())
        await async_wait_until(lambda: box.records == 0, 10, what="the drain after the restart")
        fwd.stop()
        await task
    finally:
        await box.close()
    ids = iggy.ids("edge", "telemetry")
    assert sorted(ids) == sorted(r.message_id for r in records.values()), "each record once, none lost"
    assert_per_key_order(iggy, records)


async def test_order_per_key_and_no_early_delete_through_failures(tmp_path: Path) -> None:
    box, records = await filled(tmp_path / "buffer.db", devices=12, per_device=60)
    iggy = MemoryIggy(partitions=PARTITIONS)
    uplink = WatchedUplink(iggy, jitter=0.004)
    deleted = watch_deletes(box, uplink)
    metrics = Metrics()
    settings = ForwardSettings(linger_ms=0, batch_records=25, backoff_initial_s=0.01, backoff_max_s=0.02)
    fwd = Forwarder(box, uplink, settings, metrics)
    iggy.fail_next(1, after=3)
    iggy.fail_next(2, ambiguous=True, after=5)
    iggy.fail_next(1, after=11)
    iggy.fail_next(1, ambiguous=True, after=17)
    task = asyncio.create_task(fwd.run())
    try:
        await async_wait_until(lambda: box.records == 0, 20, what="the drain")
    finally:
        fwd.stop()
        await task
        await box.close()
    assert deleted == set(records)
    assert iggy.failed_requests == 5
    stored = iggy.ids("edge", "telemetry")
    assert set(stored) == {r.message_id for r in records.values()}
    assert metrics.value("iggy_edge_forward_records_total") == len(records)
    assert_per_key_order(iggy, records)


def test_seq_ranges_cover_exactly_the_seqs_given() -> None:
    assert seq_ranges([]) == []
    assert seq_ranges([5]) == [(5, 5)]
    assert seq_ranges([3, 1, 2, 2, 7, 9, 8, 11]) == [(1, 3), (7, 9), (11, 11)]
    rng = random.Random(7)
    seqs = set(rng.sample(range(1, 2000), 700))
    covered = {s for a, b in seq_ranges(seqs) for s in range(a, b + 1)}
    assert covered == seqs
