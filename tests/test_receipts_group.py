"""Receipts take a group commit's messages in one call (`observe_group`):
one receipt decision per device and group, the newest reading winning
(issue 22: the cost of receipts on ingest)."""

from __future__ import annotations

import zlib

import pytest
from iggy_edge.config import ReceiptSettings
from iggy_edge.metrics import Metrics
from iggy_edge.receipts import Receipts

pytestmark = pytest.mark.unit


def receipts() -> tuple[Receipts, list[tuple[str, bytes, bool]]]:
    sent: list[tuple[str, bytes, bool]] = []

    def publish(topic: str, payload: bytes, retain: bool) -> bool:
        sent.append((topic, payload, retain))
        return True

    return Receipts(ReceiptSettings(min_interval_ms=0), Metrics(), publish), sent


def receipt(payload: bytes, seq: int) -> bytes:
    return b'{"seq":%d,"crc":%d}' % (seq, zlib.crc32(payload))


async def test_one_receipt_per_device_for_a_group() -> None:
    r, sent = receipts()
    msgs = [(f"edge/d{i % 10}/up/env", b'{"seq":%d}' % i) for i in range(1000)]
    r.observe_group(msgs)
    assert len(sent) == 10  # not 1,000 decisions
    newest = {f"edge/d{d}/down/receipt": b'{"seq":%d}' % (990 + d) for d in range(10)}
    assert {t: p for t, p, _ in sent} == {t: receipt(p, 990 + d) for d, (t, p) in enumerate(newest.items())}


async def test_the_newest_reading_of_a_device_wins_across_its_topics() -> None:
    r, sent = receipts()
    a, b, a2 = b'{"seq":1,"a":1}', b'{"seq":2,"b":1}', b'{"seq":3,"a":2}'
    r.observe_group([("edge/d/up/a", a), ("edge/d/up/b", b), ("edge/d/up/a", a2)])
    assert sent[-1] == ("edge/d/down/receipt", receipt(a2, 3), True)
