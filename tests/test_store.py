"""The outbox against a plain-list model, and its bounds, TTL, identity,
corruption handling and dead letters."""

from __future__ import annotations

import random
import sqlite3
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.buffer_admin import read_dead_letters, read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route, gateway_hash32, make_message_id, split_message_id
from iggy_edge.store import ROW_OVERHEAD, Incoming, Outbox, device_seq_of
from iggy_edge.store.devices import water_fill

pytestmark = pytest.mark.unit

GW = "gw-store"
BIG = 1 << 40


def buffer_settings(**kw: Any) -> BufferSettings:
    kw.setdefault("commit_interval_ms", 0)
    return BufferSettings(**kw)


async def open_box(path: Path, settings: BufferSettings, metrics: Metrics | None = None) -> Outbox:
    box = await Outbox.open(path, settings, GW, metrics or Metrics())
    box.start()
    return box


def incoming(device: str, payload: bytes, received_us: int = 1, *, topic: str | None = None) -> Incoming:
    return Incoming(
        route=Route("edge", "telemetry", device),
        mqtt_topic=topic or f"edge/{device}/up/env",
        qos=1,
        retain=False,
        received_us=received_us,
        payload=payload,
        device_seq=device_seq_of(payload),
    )


async def submit_all(box: Outbox, items: list[Incoming]) -> None:
    futures = [box.submit(it) for it in items]
    for f in futures:
        await f


# -- model-based test ------------------------------------------------------------


@dataclass
class Row:
    seq: int
    key: str
    topic: str
    payload: bytes
    received_us: int

    @property
    def accounted(self) -> int:
        return len(self.payload) + len(self.topic) + ROW_OVERHEAD


class Model:
    """What the outbox should hold: a list, the next seq, drop counts."""

    def __init__(self, s: BufferSettings) -> None:
        self.s = s
        self.rows: list[Row] = []
        self.next_seq = 1
        self.drops: dict[str, int] = {}

    @property
    def bytes(self) -> int:
        return sum(r.accounted for r in self.rows)

    def _drop(self, reason: str, n: int) -> None:
        if n:
            self.drops[reason] = self.drops.get(reason, 0) + n

    def submit(self, items: list[Incoming]) -> None:
        new = [Row(0, it.route.key, it.mqtt_topic, it.payload, it.received_us) for it in items]
        add = sum(r.accounted for r in new)
        if self.s.overflow == "reject_new":
            while new and (
                len(self.rows) + len(new) > self.s.max_records or self.bytes + add > self.s.max_bytes
            ):
                add -= new.pop().accounted
                self._drop("buffer_full_rejected", 1)
        else:
            # fair: the largest devices give first, each its oldest (store/devices.py)
            before = len(self.rows) + len(new)
            over = before - self.s.max_records
            if over > 0:
                shares: dict[str, int] = {}
                for r in self.rows + new:
                    shares[r.key] = shares.get(r.key, 0) + 1
                for dev, quota in water_fill(shares, over).items():
                    mine = [r for r in self.rows if r.key == dev][:quota]
                    self.rows = [r for r in self.rows if r not in mine]
                    gone = [r for r in new if r.key == dev][: quota - len(mine)]
                    new = [r for r in new if r not in gone]
            over_b = self.bytes + sum(r.accounted for r in new) - self.s.max_bytes
            if over_b > 0:
                shares = {}
                for r in self.rows + new:
                    shares[r.key] = shares.get(r.key, 0) + r.accounted
                for dev, quota in water_fill(shares, over_b).items():
                    in_table = min(quota, sum(r.accounted for r in self.rows if r.key == dev))
                    got = self._take(self.rows, dev, in_table)
                    if quota > got:
                        self._take(new, dev, quota - got)
            self._drop("buffer_full_oldest", before - len(self.rows) - len(new))
        for r in new:
            r.seq = self.next_seq
            self.next_seq += 1
            self.rows.append(r)

    @staticmethod
    def _take(rows: list[Row], dev: str, nbytes: int) -> int:
        """Remove the oldest rows of `dev` from `rows` until `nbytes` are freed."""
        freed = 0
        for r in [r for r in rows if r.key == dev]:
            if freed >= nbytes:
                break
            rows.remove(r)
            freed += r.accounted
        return freed

    def confirm(self, seqs: set[int]) -> None:
        self.rows = [r for r in self.rows if r.seq not in seqs]

    def expire(self, now_us: int) -> None:
        cutoff = now_us - self.s.ttl_s * 1_000_000
        keep = [r for r in self.rows if r.received_us >= cutoff]
        self._drop("ttl_expired", len(self.rows) - len(keep))
        self.rows = keep

    def batch(self, max_records: int, max_bytes: int) -> list[Row]:
        out: list[Row] = []
        total = 0
        for r in self.rows[:max_records]:
            total += len(r.payload)
            if out and total > max_bytes:
                break
            out.append(r)
        return out


async def check(box: Outbox, model: Model, path: Path) -> None:
    assert box.records == len(model.rows)
    assert box.bytes == model.bytes
    got = await box.read_batch(BIG, BIG)
    assert [(r.seq, r.key, r.headers["mqtt-topic"], r.payload) for r in got] == [
        (m.seq, m.key, m.topic, m.payload) for m in model.rows
    ]
    h = gateway_hash32(GW)
    assert all(r.message_id == make_message_id(h, box.epoch, r.seq) for r in got)
    stats = read_stats(path)  # what `buffer stats` shows, read by another connection
    assert stats.records == len(model.rows)
    assert stats.bytes == model.bytes
    assert {k: v for k, v in stats.drops_by_reason.items() if v} == model.drops


@pytest.mark.parametrize("overflow", ["drop_oldest", "reject_new"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_outbox_matches_list_model(tmp_path: Path, seed: int, overflow: str) -> None:
    rng = random.Random(seed)
    s = buffer_settings(max_records=40, max_bytes=4000, overflow=overflow, ttl_s=60)
    path = tmp_path / "buffer.db"
    box = await open_box(path, s)
    epoch = box.epoch
    model = Model(s)
    clock = 1_000_000_000
    devices = [f"dev-{seed}-{i}" for i in range(4)]
    seq_per_device = dict.fromkeys(devices, 0)
    try:
        for _ in range(120):
            op = rng.choices(
                ["submit", "confirm_all", "confirm_part", "read", "expire", "reopen"],
                weights=[10, 3, 3, 2, 2, 1],
            )[0]
            if op == "submit":
                items = []
                for _ in range(rng.randint(1, 8)):
                    clock += rng.randint(0, 8_000_000)
                    dev = rng.choice(devices)
                    seq_per_device[dev] += 1
                    body = b'{"seq":%d,"v":"%s"}' % (seq_per_device[dev], b"x" * rng.randint(0, 150))
                    # occasionally a clock step back: TTL must look at the time, not the order
                    received = clock - rng.choice([0, 0, 0, 30_000_000])
                    items.append(incoming(dev, body, received))
                await submit_all(box, items)
                model.submit(items)
            elif op in ("confirm_all", "confirm_part", "read"):
                n, nbytes = rng.randint(1, 15), rng.randint(50, 1500)
                batch = await box.read_batch(n, nbytes)
                assert [r.seq for r in batch] == [r.seq for r in model.batch(n, nbytes)]
                if op == "confirm_all":
                    assert await box.confirm(batch) == len(batch)
                    model.confirm({r.seq for r in batch})
                elif op == "confirm_part" and batch:
                    part = frozenset(r.seq for r in batch if rng.random() < 0.5)
                    assert await box.confirm(batch, part) == len(part)
                    model.confirm(set(part))
            elif op == "expire":
                await box.expire(now_us=clock)
                model.expire(clock)
            else:
                await box.close()
                box = await open_box(path, s)
                assert box.epoch == epoch  # the id space survives a restart
            await check(box, model, path)
    finally:
        await box.close()
    assert model.drops, "the sequence never hit a bound: make the bounds tighter"


# -- bounds ------------------------------------------------------------------------


async def test_drop_oldest_keeps_newest_and_counts(tmp_path: Path) -> None:
    metrics = Metrics()
    path = tmp_path / "b.db"
    box = await open_box(path, buffer_settings(max_records=100, overflow="drop_oldest"), metrics)
    try:
        for i in range(250):
            await submit_all(box, [incoming("d-oldest", b'{"seq":%d}' % i)])
        got = await box.read_batch(BIG, BIG)
        assert [device_seq_of(r.payload) for r in got] == list(range(150, 250))
        assert metrics.value("iggy_edge_store_dropped_records_total", reason="buffer_full_oldest") == 150
        assert read_stats(path).drops_by_reason == {"buffer_full_oldest": 150}
    finally:
        await box.close()


async def test_reject_new_keeps_oldest_and_counts(tmp_path: Path) -> None:
    metrics = Metrics()
    path = tmp_path / "b.db"
    box = await open_box(path, buffer_settings(max_records=100, overflow="reject_new"), metrics)
    try:
        for i in range(250):
            await submit_all(box, [incoming("d-reject", b'{"seq":%d}' % i)])
        got = await box.read_batch(BIG, BIG)
        assert [device_seq_of(r.payload) for r in got] == list(range(100))
        assert metrics.value("iggy_edge_store_dropped_records_total", reason="buffer_full_rejected") == 150
        assert read_stats(path).drops_by_reason == {"buffer_full_rejected": 150}
    finally:
        await box.close()


@pytest.mark.parametrize("overflow", ["drop_oldest", "reject_new"])
async def test_byte_bound_holds(tmp_path: Path, overflow: str) -> None:
    s = buffer_settings(max_bytes=10_000, overflow=overflow)
    box = await open_box(tmp_path / "b.db", s)
    try:
        for i in range(100):
            await submit_all(box, [incoming("d-bytes", b'{"seq":%d,"p":"%s"}' % (i, b"y" * 300))])
            assert box.bytes <= s.max_bytes
        assert 0 < box.records < 100
    finally:
        await box.close()


async def test_one_group_larger_than_the_bound_still_respects_it(tmp_path: Path) -> None:
    """A commit group bigger than max_records (or max_bytes) must not leave the
    outbox over its bound under drop_oldest: the group's own oldest go."""
    metrics = Metrics()
    box = await open_box(tmp_path / "b.db", buffer_settings(max_records=10, overflow="drop_oldest"), metrics)
    try:
        await submit_all(box, [incoming("d-group", b'{"seq":%d}' % i) for i in range(25)])
        assert box.records == 10
        got = await box.read_batch(BIG, BIG)
        assert [device_seq_of(r.payload) for r in got] == list(range(15, 25))
        assert metrics.value("iggy_edge_store_dropped_records_total", reason="buffer_full_oldest") == 15
    finally:
        await box.close()


async def test_ttl_expires_old_records_and_counts(tmp_path: Path) -> None:
    metrics = Metrics()
    path = tmp_path / "b.db"
    box = await open_box(path, buffer_settings(ttl_s=10), metrics)
    now = 5_000_000_000
    try:
        await submit_all(box, [incoming("d-ttl", b"old", now - 11_000_000), incoming("d-ttl", b"new", now)])
        assert await box.expire(now_us=now) == 1
        assert [r.payload for r in await box.read_batch(10, BIG)] == [b"new"]
        assert metrics.value("iggy_edge_store_dropped_records_total", reason="ttl_expired") == 1
        assert read_stats(path).drops_by_reason == {"ttl_expired": 1}
    finally:
        await box.close()
    box = await open_box(path, buffer_settings(ttl_s=0))
    try:
        assert await box.expire(now_us=now * 10) == 0  # ttl_s = 0: no expiry
    finally:
        await box.close()


# -- identity ----------------------------------------------------------------------


async def test_seq_never_reused_after_emptying_and_reopening(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    s = buffer_settings()
    box = await open_box(path, s)
    await submit_all(box, [incoming("d-seq", b"a"), incoming("d-seq", b"b")])
    first = await box.read_batch(10, BIG)
    await box.confirm(first)
    assert box.records == 0
    epoch = box.epoch
    await box.close()
    box = await open_box(path, s)
    try:
        await submit_all(box, [incoming("d-seq", b"c")])
        (again,) = await box.read_batch(10, BIG)
        assert again.seq > max(r.seq for r in first)
        assert again.message_id not in {r.message_id for r in first}
        assert box.epoch == epoch
    finally:
        await box.close()


async def test_message_id_scheme(tmp_path: Path) -> None:
    box = await open_box(tmp_path / "b.db", buffer_settings())
    try:
        await submit_all(box, [incoming("d-id", b"x")])
        (rec,) = await box.read_batch(1, BIG)
        assert rec.message_id < 1 << 128
        assert split_message_id(rec.message_id) == (gateway_hash32(GW), box.epoch, rec.seq)
        assert gateway_hash32(GW) == gateway_hash32(GW)  # stable, not Python's salted hash
        assert gateway_hash32("gw-a") != gateway_hash32("gw-b")
        assert rec.headers["gateway-id"] == GW
    finally:
        await box.close()
    other = await open_box(tmp_path / "other.db", buffer_settings())
    try:
        assert other.epoch != box.epoch  # a fresh database draws a fresh epoch (32 random bits)
    finally:
        await other.close()


async def test_seen_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    box = await open_box(path, buffer_settings())
    payload = b'{"seq":42,"t":1}'
    await submit_all(box, [incoming("d-seen", payload)])
    crc = zlib.crc32(payload)
    assert box.seen("edge/d-seen/up/env", 42, crc)
    assert not box.seen("edge/d-seen/up/env", 43, crc)
    await box.close()
    box = await open_box(path, buffer_settings())
    try:
        assert box.seen("edge/d-seen/up/env", 42, crc)
    finally:
        await box.close()


# -- corruption, dead letters ------------------------------------------------------------


async def test_corrupt_database_is_moved_aside_and_a_fresh_one_works(tmp_path: Path) -> None:
    path = tmp_path / "buffer.db"
    path.write_bytes(b"this is not a database, just garbage from a bad SD card\x00" * 200)
    metrics = Metrics()
    box = await open_box(path, buffer_settings(), metrics)
    try:
        await submit_all(box, [incoming("d-corrupt", b"fresh")])
        assert [r.payload for r in await box.read_batch(10, BIG)] == [b"fresh"]
        assert metrics.value("iggy_edge_store_errors_total") == 1
    finally:
        await box.close()
    aside = list(tmp_path.glob("buffer.db.corrupt-*"))
    assert len(aside) == 1
    assert aside[0].read_bytes().startswith(b"this is not a database")
    with pytest.raises(sqlite3.DatabaseError):
        sqlite3.connect(aside[0]).execute("SELECT 1 FROM sqlite_master").fetchall()


async def test_dead_letters_are_stored_with_reason_and_bounded(tmp_path: Path) -> None:
    path = tmp_path / "b.db"
    metrics = Metrics()
    box = await open_box(path, buffer_settings(max_dead_letters=5, max_payload_bytes=8), metrics)
    try:
        for i in range(12):
            await box.dead_letter(
                mqtt_topic=f"bad/{i}",
                payload=b"0123456789",
                qos=1,
                retain=False,
                reason="unroutable",
                detail="d",
            )
        await box.dead_letter(
            mqtt_topic=b"edge/\xff/x", payload=b"p", qos=0, retain=True, reason="invalid_topic", detail="utf8"
        )
    finally:
        await box.close()
    letters = read_dead_letters(path)
    assert len(letters) == 5
    assert letters[0].mqtt_topic == b"edge/\xff/x"  # bytes kept as they came
    assert letters[0].reason == "invalid_topic"
    assert letters[0].retain is True
    assert [d.mqtt_topic for d in letters[1:]] == [b"bad/11", b"bad/10", b"bad/9", b"bad/8"]
    assert letters[1].payload == b"01234567"  # truncated to max_payload_bytes
    assert letters[1].payload_size == 10
    assert metrics.value("iggy_edge_store_dead_letters_total", reason="unroutable") == 12
    stats = read_stats(path)
    assert stats.dead_letters == 5
    assert stats.dead_letters_by_reason == {"unroutable": 4, "invalid_topic": 1}


def test_device_seq_parsing() -> None:
    assert device_seq_of(b'{"seq": 17, "t": 1}') == 17
    assert device_seq_of(b'{"t":1,"seq":3}') == 3
    assert device_seq_of(b"seq: 3") is None
    assert device_seq_of(b'{"seqx":3}') is None
    assert device_seq_of(b"\xff\xfe") is None
