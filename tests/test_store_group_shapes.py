"""Group commits of every size around the 128-row statement (issue 14).

A group goes out as full 128-row statements and then power-of-two pieces (a
few statement shapes for the sqlite3 module's cache instead of one per
size).  Whatever the size, the rows land in arrival order and each
redelivery-window row points at its own record.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

import pytest
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("sizes", [[1, 2, 3, 127, 128, 129], [255, 256, 257, 300, 383, 1]])
async def test_groups_of_any_size_keep_order_and_window_rows(tmp_path: Path, sizes: list[int]) -> None:
    db = tmp_path / "buffer.db"
    box = await Outbox.open(db, BufferSettings(commit_interval_ms=0), "gw-shapes", Metrics())
    box.start()
    n = 0
    try:
        for size in sizes:
            done = None
            for _ in range(size):  # submitted in one go: one group
                n += 1
                d = f"dev{n % 3}"
                done = box.submit(
                    Incoming(Route("edge", "t", d), f"edge/{d}/up/env", 1, False, n, b'{"seq":%d}' % n, n)
                )
            assert done is not None
            await done
    finally:
        await box.close()
    conn = sqlite3.connect(db)
    try:
        rows = conn.execute(
            "SELECT seq, mqtt_topic, device_seq, payload FROM outbox_rows ORDER BY seq"
        ).fetchall()
        window = conn.execute("SELECT seq, mqtt_topic, device_seq FROM ingest_recent ORDER BY seq").fetchall()
    finally:
        conn.close()
    assert [r[2] for r in rows] == list(range(1, n + 1))  # arrival order
    assert [r[3] for r in rows] == [b'{"seq":%d}' % i for i in range(1, n + 1)]
    assert window == [(seq, topic, dseq) for seq, topic, dseq, _ in rows]
