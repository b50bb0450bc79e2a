"""The ring's receipt mode (``Ring.hold``) under CPython, against a list
model: two cursors (send, receipt), releases by (seq, CRC), rewinds, seq-less
records (command acks), reopening, and overflow counting held records as
evicted, not dropped.  The device side end to end is in
test_receipts_device.py."""

from __future__ import annotations

import json
import random
import zlib
from pathlib import Path

import pytest
from iggy_device.receipts import release
from iggy_device.ring import Ring, seq_of

pytestmark = pytest.mark.unit


def _payload(rid: int, seq: int | None) -> bytes:
    doc: dict[str, object] = {"i": rid}
    if seq is not None:
        doc["seq"] = seq
    return json.dumps(doc, separators=(",", ":")).encode()


class Model:
    """records: (id, seq, payload); r = receipt cursor, s = send cursor."""

    def __init__(self) -> None:
        self.recs: list[tuple[int, int | None, bytes]] = []
        self.r = 0
        self.s = 0

    def release(self, seq: int, crc: int) -> int:
        for k in range(self.r, len(self.recs)):
            if self.recs[k][1] == seq and zlib.crc32(self.recs[k][2]) == crc:
                end = k + 1
                self.s = max(self.s, end)
                while end < self.s and self.recs[end][1] is None:
                    end += 1
                n = end - self.r
                self.r = end
                return n
        return 0


@pytest.mark.parametrize("seed", range(8))
def test_hold_mode_against_a_model(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    d = str(tmp_path / "ring")
    ring = Ring(d, max_bytes=64 * 1024, segment_bytes=256, cursor_every=4)
    ring.hold = True
    m = Model()
    next_id = 0
    next_seq = 0
    for _ in range(1500):
        op = rnd.random()
        if op < 0.4:
            seq = None if rnd.random() < 0.15 else next_seq
            if seq is not None:
                next_seq += 1
            p = _payload(next_id, seq)
            assert ring.append("ch", p) == 0
            m.recs.append((next_id, seq, p))
            next_id += 1
        elif op < 0.75:
            rec = ring.peek()
            if m.s >= len(m.recs):
                assert rec is None
                continue
            assert rec is not None
            assert rec[1] == m.recs[m.s][2]
            unnumbered = m.recs[m.s][1] is None
            ring.pop()
            m.s += 1
            if unnumbered and m.r == m.s - 1:
                m.r = m.s  # PUBACK is enough: nothing held before it
        elif op < 0.9:
            # a receipt: usually for a sent record, sometimes one past the
            # send cursor (after a rewind), sometimes stale or foreign
            if m.recs and rnd.random() < 0.85:
                k = rnd.randrange(max(0, m.r - 3), len(m.recs))
                _, seq, p = m.recs[k]
                if seq is None:
                    continue
                crc = zlib.crc32(p) if rnd.random() < 0.9 else 12345
            else:
                seq, crc = rnd.randrange(0, next_seq + 5), rnd.randrange(1 << 32)
            assert release(ring, seq, crc) == m.release(seq, crc)
        elif op < 0.95:
            ring.rewind()
            m.s = m.r
        else:
            ring.flush()
            ring = Ring(d, max_bytes=64 * 1024, segment_bytes=256, cursor_every=4)
            ring.hold = True
            m.s = m.r  # the send cursor lives in RAM: after a reboot, send again from the receipt
        assert len(ring) == len(m.recs) - m.r
        assert ring.unreceipted() == m.s - m.r
    assert ring.dropped == 0
    ring.flush()  # closes its reader


def test_overflow_counts_held_records_as_evicted_not_dropped(tmp_path: Path) -> None:
    ring = Ring(str(tmp_path / "r"), max_bytes=1024, segment_bytes=256)
    ring.hold = True
    for i in range(10):
        ring.append("env", _payload(i, i))
    while ring.peek() is not None:
        ring.pop()
    assert ring.unreceipted() == 10
    total = len(ring)
    lost = sum(ring.append("env", _payload(100 + i, 100 + i)) for i in range(80))
    # the 10 held (sent, PUBACK) records left as evicted; only unsent ones count as dropped
    assert ring.evicted == 10
    assert ring.unreceipted() == 0
    assert ring.dropped == lost > 0
    assert len(ring) == total + 80 - 10 - lost
    ring.flush()


def test_release_all_and_seq_parsing(tmp_path: Path) -> None:
    assert seq_of(b'{"v":1,"seq":42,"ts":3}') == 42
    assert seq_of(b'{"v":1,"seq":7}') == 7
    assert seq_of(b'{"id":"c1","status":"ok"}') is None
    ring = Ring(str(tmp_path / "r"), max_bytes=4096, segment_bytes=512)
    ring.hold = True
    for i in range(5):
        ring.append("env", _payload(i, i))
    for _ in range(3):
        ring.peek()
        ring.pop()
    assert ring.release_all() == 3
    assert len(ring) == 2
    assert ring.unreceipted() == 0
    # a receipt for a record past the send cursor (after a reconnect): released, and skipped
    assert release(ring, 4, zlib.crc32(_payload(4, 4))) == 2
    assert ring.peek() is None
    assert len(ring) == 0
    ring.flush()
