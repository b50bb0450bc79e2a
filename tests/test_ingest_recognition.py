"""Redelivery recognition lives in the store (`Outbox.copy_of`), and the
payload's CRC is taken once per message (`redelivery_key`, carried in
`Incoming.key`): the hot path of ingest with receipts on (issue 22)."""

from __future__ import annotations

import asyncio
import sqlite3
import zlib
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.routing import DeadLetterReason, Rejected
from iggy_edge.store import Incoming, Outbox, StoreError, device_seq_of, redelivery_key
from iggy_edge.store.commit import Item

pytestmark = pytest.mark.unit

TOPIC = "edge/d1/up/env"


def item(payload: bytes, qos: int = 1, *, key: bool = True) -> Incoming:
    dseq = device_seq_of(payload)
    k = redelivery_key(TOPIC, qos, dseq, payload) if key else None
    return Incoming(Route("edge", "telemetry", "d1"), TOPIC, qos, False, 1, payload, dseq, k)


async def open_box(path: Path, **kw: int) -> Outbox:
    box = await Outbox.open(path, BufferSettings(commit_interval_ms=kw.pop("interval", 0)), "gw", Metrics())
    box.start()
    return box


def test_redelivery_key_only_for_qos1_with_a_device_seq() -> None:
    p = b'{"seq":7,"v":1}'
    assert redelivery_key(TOPIC, 1, 7, p) == (TOPIC, 7 << 32 | zlib.crc32(p))
    assert redelivery_key(TOPIC, 0, 7, p) is None  # QoS0 is never redelivered
    assert redelivery_key(TOPIC, 2, None, p) is None  # nothing tells it from a new one


async def test_copy_of_a_pending_record_is_its_commit_then_the_window(tmp_path: Path) -> None:
    box = await open_box(tmp_path / "b.db", interval=200)
    try:
        p = b'{"seq":5,"v":1}'
        first = item(p)
        assert first.key is not None
        assert box.copy_of(first.key) is False
        done = box.submit(first)
        assert box.copy_of(first.key) is done  # waits in the open group: acked with its commit
        other = item(b'{"seq":5,"v":2}').key
        assert other is not None
        assert box.copy_of(other) is False  # same seq, other CRC: new
        await done
        assert box.copy_of(first.key) is True  # committed: in the redelivery window
        assert box.seen(TOPIC, 5, zlib.crc32(p))
    finally:
        await box.close()


async def test_a_record_given_its_key_is_not_checksummed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    box = await open_box(tmp_path / "b.db")
    try:
        items = [item(b'{"seq":%d}' % i) for i in range(50)]
        calls = []
        real = zlib.crc32

        def counting(b: bytes, *a: int) -> int:
            calls.append(b)
            return real(b, *a)

        monkeypatch.setattr(zlib, "crc32", counting)
        await asyncio.gather(*[box.submit(it) for it in items])
        assert calls == []  # the store used the keys ingest computed
        assert all(box.copy_of(it.key) is True for it in items if it.key is not None)
        # a caller that gives no key gets one derived at submit (and the window entry)
        await box.submit(item(b'{"seq":99}', key=False))
        assert len(calls) == 1
        assert box.seen(TOPIC, 99, real(b'{"seq":99}'))
    finally:
        await box.close()


ROUTE = Route("edge", "telemetry", "d1")


def take(box: Outbox, payload: bytes, *, check: bool = True, topic: str = TOPIC) -> object:
    """Ingest's one call per message (`GroupCommit.take`)."""
    return box.take(ROUTE, topic, 1, 0, 1, payload, device_seq_of(payload), check)


async def test_take_stores_a_new_record_and_recognises_its_copies(tmp_path: Path) -> None:
    metrics = Metrics()
    box = await Outbox.open(tmp_path / "b.db", BufferSettings(commit_interval_ms=200), "gw", metrics)
    box.start()
    try:
        p = b'{"seq":5,"v":1}'
        done = take(box, p)
        assert isinstance(done, asyncio.Future)
        assert take(box, p) is done  # its original waits: acknowledged with that commit
        assert take(box, p, check=False) is done  # not checked: stored again, in the same group
        await done
        assert take(box, p) is True  # committed: acknowledge, store nothing
        assert metrics.value("iggy_edge_ingest_known_copies_total") == 2
        assert box.pending_count == 0
        assert box.records == 2
    finally:
        await box.close()


async def test_take_admits_by_the_device_bounds(tmp_path: Path) -> None:
    box = await Outbox.open(
        tmp_path / "b.db", BufferSettings(commit_interval_ms=200, max_topics_per_device=2), "gw", Metrics()
    )
    box.start()
    try:
        for i in range(2):  # the first of a source is admitted, the second passes as reserved
            assert isinstance(take(box, b'{"seq":1}', topic=f"edge/d1/up/t{i}"), asyncio.Future)
            assert isinstance(take(box, b'{"seq":2}', topic=f"edge/d1/up/t{i}"), asyncio.Future)
        refused = take(box, b'{"seq":3}', topic="edge/d1/up/t9")
        assert isinstance(refused, Rejected)
        assert refused.reason is DeadLetterReason.TOO_MANY_TOPICS
    finally:
        await box.close()


async def test_a_failed_commit_leaves_the_window(tmp_path: Path) -> None:
    """Keys enter the redelivery window at submit; a commit that fails takes
    its own out (a copy is new again), and a record of the open group with
    the same key (taken without the check) holds it from then on."""
    box = await open_box(tmp_path / "b.db", interval=0)
    try:
        release = asyncio.Event()
        real = box.commit._insert  # noqa: SLF001 - fault at the SQL seam

        async def fail_first(items: list[Item]) -> None:
            box.commit._insert = real  # type: ignore[method-assign]  # noqa: SLF001
            await release.wait()
            raise sqlite3.OperationalError("simulated: disk I/O error")

        box.commit._insert = fail_first  # type: ignore[method-assign]  # noqa: SLF001
        p = b'{"seq":8}'
        first = take(box, p)
        assert isinstance(first, asyncio.Future)
        await asyncio.sleep(0.05)  # its commit is under way (held)
        again = take(box, p, check=False)  # stored again in the open group
        assert isinstance(again, asyncio.Future)
        assert again is not first
        release.set()
        with pytest.raises(StoreError):
            await first
        key = redelivery_key(TOPIC, 1, 8, p)
        assert key is not None
        assert box.copy_of(key) is again
        await again
        assert box.copy_of(key) is True
        assert box.records == 1
        other = redelivery_key(TOPIC, 1, 9, b'{"seq":9}')
        assert other is not None
        assert box.copy_of(other) is False
    finally:
        await box.close()
