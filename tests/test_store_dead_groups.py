"""Dead letters written in groups, bounded by count and bytes, and the
outbox's pending_bytes (issue 8, item 6, store side)."""

from __future__ import annotations

import asyncio
import tracemalloc
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import read_dead_letters, read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from iggy_edge.store.dead import DEAD_GROUP_MAX, DEAD_GROUP_MAX_BYTES

pytestmark = pytest.mark.unit


async def open_box(path: Path, metrics: Metrics, **kw: object) -> Outbox:
    kw.setdefault("commit_interval_ms", 0)
    box = await Outbox.open(path, BufferSettings(**kw), "gw-dead", metrics)  # type: ignore[arg-type]
    box.start()
    return box


def letter(box: Outbox, i: int, payload: bytes = b"") -> asyncio.Future[None]:
    return box.enqueue_dead_letter(
        mqtt_topic=f"bad/{i % 10}",
        payload=payload,
        qos=0,
        retain=False,
        reason="unroutable",
        detail="no route",
    )


async def test_a_flood_of_dead_letters_commits_in_groups_bounded_by_count(tmp_path: Path) -> None:
    metrics = Metrics()
    box = await open_box(tmp_path / "b.db", metrics, max_dead_letters=100_000)
    try:
        n = 5000
        futures = [letter(box, i) for i in range(n)]  # synchronous, before the committer runs
        groups = {id(f) for f in futures}
        assert len(groups) == n // DEAD_GROUP_MAX
        await asyncio.gather(*futures)
        assert metrics.value("iggy_edge_store_dead_letters_total", reason="unroutable") == n
        assert box.pending_bytes == 0
    finally:
        await box.close()
    assert read_stats(tmp_path / "b.db").dead_letters == n


async def test_groups_are_bounded_by_bytes_and_payloads_cut_on_arrival(tmp_path: Path) -> None:
    metrics = Metrics()
    cap = 64 * 1024
    box = await open_box(tmp_path / "b.db", metrics, max_payload_bytes=cap, max_dead_letters=1000)
    try:
        big = b"x" * (cap * 4)  # oversize: only `cap` bytes are kept, from the start
        futures = [letter(box, i, big) for i in range(200)]
        per_group = -(-DEAD_GROUP_MAX_BYTES // (cap + len("bad/0")))
        assert len({id(f) for f in futures}) == -(-200 // per_group)
        assert box.pending_bytes == 200 * (cap + len("bad/0"))
        waiter = asyncio.create_task(box.wait_pending_below(1, max_bytes=1))
        await asyncio.gather(*futures)
        await asyncio.wait_for(waiter, 10)
        assert box.pending_bytes == 0
    finally:
        await box.close()
    (newest,) = read_dead_letters(tmp_path / "b.db", limit=1)
    assert newest.payload == b"x" * cap
    assert newest.payload_size == cap * 4


async def test_pending_bytes_counts_records_until_their_commit(tmp_path: Path) -> None:
    box = await open_box(tmp_path / "b.db", Metrics())
    try:
        futures = [
            box.submit(Incoming(Route("edge", "t", "k"), "edge/k/up/env", 1, False, i, b"p" * 100))
            for i in range(50)
        ]
        dead = letter(box, 0, b"q" * 10)
        assert box.pending_bytes == 50 * 100 + 10 + len("bad/0")
        await asyncio.gather(*futures, dead)
        assert box.pending_bytes == 0
    finally:
        await box.close()


async def test_dead_letter_api_still_commits_before_returning_without_a_committer(tmp_path: Path) -> None:
    box = await Outbox.open(tmp_path / "b.db", BufferSettings(), "gw-dead", Metrics())  # not started
    try:
        await asyncio.wait_for(
            box.dead_letter(
                mqtt_topic="x", payload=b"1", qos=1, retain=False, reason="unroutable", detail="d"
            ),
            10,
        )
        assert read_stats(tmp_path / "b.db").dead_letters == 1
    finally:
        await box.close()


async def test_memory_of_a_flood_of_50000_dead_letters_stays_small(tmp_path: Path) -> None:
    """50,000 empty QoS0 payloads that do not route (the issue's flood): the
    store side holds one small row each, not a task and a transaction each."""
    box = await open_box(tmp_path / "b.db", Metrics(), max_dead_letters=100_000)
    try:
        tracemalloc.start()
        futures = [letter(box, i) for i in range(50_000)]
        await asyncio.gather(*futures)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < 40 * 1024 * 1024, f"peak {peak / 1e6:.1f} MB"
        print(f"50,000 dead letters: traced peak {peak / 1e6:.1f} MB")
    finally:
        await box.close()
