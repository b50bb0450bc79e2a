"""Redelivery recognition lives in the store (`Outbox.copy_of`), and the
payload's CRC is taken once per message (`redelivery_key`, carried in
`Incoming.key`): the hot path of ingest with receipts on (issue 22)."""

from __future__ import annotations

import asyncio
import zlib
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox, device_seq_of, redelivery_key

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
