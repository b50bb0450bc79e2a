"""A full or failing disk, flipped bytes, overwritten pages and a damaged WAL
header, on real SQLite files (issue 8, items 1-4, store side).

The full disk is a real small tmpfs (we mount it; root only, skipped with a
reason otherwise).  The damage is done to the bytes of a real buffer file the
outbox wrote and closed."""

from __future__ import annotations

import asyncio
import logging
import random
import shutil
import sqlite3
import struct
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import ack_salvage, read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route, split_message_id
from iggy_edge.store import Incoming, Outbox, StoreUnavailable
from iggy_edge.store.recovery.opening import recover
from iggy_edge.store.recovery.wal import WAL_HEADER, wal_checksum, wal_header_problem

from tests.support.tmpfs import fill_disk
from tests.support.tmpfs import small_tmpfs as tmpfs
from tests.support.wait import async_wait_until

pytestmark = pytest.mark.unit

GW = "gw-recovery"
PAGE = 4096


def settings(**kw: object) -> BufferSettings:
    kw.setdefault("commit_interval_ms", 0)
    return BufferSettings(**kw)  # type: ignore[arg-type]


def item(i: int, size: int = 100) -> Incoming:
    payload = (b'{"seq":%d,"v":"' % i).ljust(size - 2, b"x") + b'"}'
    return Incoming(
        Route("edge", "telemetry", f"dev-{i % 7}"), f"edge/dev-{i % 7}/up/env", 1, False, i + 1, payload
    )


async def fill(path: Path, n: int, *, close: bool = True, size: int = 100) -> Outbox:
    box = await Outbox.open(path, settings(), GW, Metrics())
    box.start()
    futures = [box.submit(item(i, size)) for i in range(n)]
    for f in futures:
        await f
    if close:
        await box.close()  # checkpoints the WAL into the file
    return box


async def drain_all(box: Outbox) -> list[tuple[int, int, bytes]]:
    """(seq, message id, payload) of every record, oldest first."""
    out: list[tuple[int, int, bytes]] = []
    while True:
        batch = await box.read_batch(1000, 1 << 30)
        if not batch:
            return out
        out.extend((r.seq, r.message_id, r.payload) for r in batch)
        await box.confirm(batch)


def aiosqlite_threads() -> int:
    """Threads alive (each aiosqlite connection runs one; the test checks the
    count sees an open connection, so it cannot pass blind)."""
    return sum(1 for t in threading.enumerate() if not t.name.startswith("asyncio_"))  # not to_thread's pool


# -- 1. a full disk is not a damaged file -------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    with tmpfs(tmp_path / "fs", "4m") as mnt:
        yield mnt


async def test_full_disk_at_open_leaves_the_buffer_in_place_and_resumes(small_tmpfs: Path) -> None:
    path = small_tmpfs / "buffer.db"
    await fill(path, 4560)
    filler = fill_disk(small_tmpfs / "filler")
    threads = aiosqlite_threads()
    for _ in range(3):  # the agent retries; every attempt must leave the file alone
        with pytest.raises(StoreUnavailable, match="left in place"):
            await Outbox.open(path, settings(), GW, Metrics())
    # <=: a thread of an earlier test may still be finishing when we counted
    await async_wait_until(lambda: aiosqlite_threads() <= threads, 5, what="no thread left by a failed open")
    assert path.exists()
    assert not list(small_tmpfs.glob("*.corrupt-*")), "an intact buffer was moved aside on a full disk"

    filler.unlink()  # space returns
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        assert conn.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        conn.close()
    before = aiosqlite_threads()
    box = await Outbox.open(path, settings(), GW, Metrics())
    assert aiosqlite_threads() == before + 1, "the thread count must see an open connection"
    box.start()
    try:
        assert box.records == 4560
        assert box.attention == ""
        rows = await drain_all(box)
        assert [s for s, _, _ in rows] == list(range(1, 4561))
    finally:
        await box.close()


async def test_open_when_possible_waits_for_the_disk_then_opens(small_tmpfs: Path) -> None:
    path = small_tmpfs / "buffer.db"
    await fill(path, 500)
    filler = fill_disk(small_tmpfs / "filler")
    failures: list[str] = []
    stop = asyncio.Event()

    def report(e: Exception | None) -> None:
        if e is not None:
            failures.append(str(e))
            if len(failures) == 2:
                filler.unlink()

    box = await asyncio.wait_for(
        Outbox.open_when_possible(
            path, settings(), GW, Metrics(), stop=stop, on_failure=report, max_delay_s=0.2
        ),
        30,
    )
    assert box is not None
    try:
        assert len(failures) >= 2
        assert box.records == 500
    finally:
        await box.close()


# -- 2. flipped bytes: every error at open or load takes one path ----------------------


def flip(path: Path, seed: int, n: int = 20) -> None:
    data = bytearray(path.read_bytes())
    rng = random.Random(seed)
    for _ in range(n):
        i = rng.randrange(len(data))
        data[i] ^= 1 << rng.randrange(8)
    path.write_bytes(bytes(data))


def load_fails(path: Path) -> bool:
    """What Outbox._load reads on main: does plain SQLite raise on it?"""
    conn = sqlite3.connect(path)
    try:
        conn.execute("SELECT count(*) FROM outbox").fetchall()
        conn.execute("SELECT id, route_id, pkey, mqtt_topic FROM sources").fetchall()
        conn.execute("SELECT count(*), sum(length(payload) + length(mqtt_topic)) FROM outbox_rows").fetchall()
        conn.execute("SELECT mqtt_topic, device_seq, crc FROM ingest_recent ORDER BY seq DESC").fetchall()
        conn.execute("SELECT id, stream, topic FROM routes").fetchall()
    except sqlite3.DatabaseError:
        return True
    finally:
        conn.close()
    return False


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
async def test_flipped_bytes_never_wedge_the_open(tmp_path: Path, seed: int) -> None:
    path = tmp_path / "buffer.db"
    await fill(path, 3000)
    rng_seed = seed
    while True:  # the first derived seed whose flips SQLite notices (deterministic)
        broken = tmp_path / f"try-{rng_seed}.db"
        shutil.copy(path, broken)
        flip(broken, rng_seed)
        if load_fails(broken):
            break
        broken.unlink()
        rng_seed += 100
    threads = aiosqlite_threads()
    metrics = Metrics()
    box = await asyncio.wait_for(Outbox.open(broken, settings(), GW, metrics), 30)
    box.start()
    try:
        assert box.attention, "a damaged buffer must show in health until acknowledged"
        rows = await drain_all(box)
        seqs = [s for s, _, _ in rows]
        assert seqs == sorted(seqs)
        assert len(set(seqs)) == len(seqs)
        assert len(rows) == box.recovery[0].salvaged
        assert metrics.value("iggy_edge_store_moved_aside_total") == 1
    finally:
        await box.close()
    # <=: a thread of an earlier test may still be finishing when we counted
    await async_wait_until(lambda: aiosqlite_threads() <= threads, 5, what="no connection thread left")


# -- 3. overwritten pages: salvage what can be read, with ids and order ----------------


async def test_overwritten_pages_are_salvaged_with_ids_and_order(tmp_path: Path) -> None:
    path = tmp_path / "state" / "buffer.db"
    path.parent.mkdir()
    n = 4710
    box = await fill(path, n, close=False)
    epoch = box.epoch
    await box.close()
    pages = path.stat().st_size // PAGE
    rng = random.Random(8)
    damaged = sorted(rng.sample(range(pages // 4, 3 * pages // 4), 8))
    with path.open("r+b") as f:
        for p in damaged:
            f.seek(p * PAGE)
            f.write(rng.randbytes(PAGE))
    assert load_fails(path), "the overwritten pages must break today's open/load"

    metrics = Metrics()
    box = await Outbox.open(path, settings(), GW, metrics)
    box.start()
    try:
        event = box.recovery[-1]
        assert event.kind == "salvaged"
        assert event.unreadable > 0
        assert event.salvaged >= n * 0.9, f"8 of ~{pages} pages lost far more than their share"
        assert event.salvaged + event.dead_letters + event.unreadable >= n
        assert box.records == event.salvaged
        assert metrics.value("iggy_edge_store_salvaged_records_total") == event.salvaged
        assert metrics.value("iggy_edge_store_unreadable_records_total") == event.unreadable
        assert "moved aside" in box.attention
        assert box.epoch == epoch
        stats = read_stats(path)
        assert [e.salvaged for e in stats.unacknowledged] == [event.salvaged]

        rows = await drain_all(box)
        assert len(rows) == event.salvaged
        for seq, mid, payload in rows:
            # the same record under the same id: seq i+1 carries device seq i
            assert payload.startswith(b'{"seq":%d,' % (seq - 1))
            _, ep, s = split_message_id(mid)
            assert (ep, s) == (epoch, seq)
        assert [s for s, _, _ in rows] == sorted(s for s, _, _ in rows)
        # new records continue after the old sequence: no id is reused
        await box.submit(item(99_999))
        (new,) = await box.read_batch(10, 1 << 20)
        assert new.seq > n

        assert ack_salvage(path) == 1
        await box.refresh_age_gauge()
        assert box.attention == ""
        assert not read_stats(path).unacknowledged
    finally:
        await box.close()
    aside = [p for p in path.parent.glob("buffer.db.corrupt-*") if not p.name.endswith(("-wal", "-shm"))]
    assert len(aside) == 1, "the damaged file is kept for inspection"


async def test_a_corruption_code_with_an_intact_file_is_not_moved(tmp_path: Path) -> None:
    """integrity_check must confirm the corruption: the file is not moved."""
    path = tmp_path / "buffer.db"
    await fill(path, 10)
    err = sqlite3.DatabaseError("database disk image is malformed")
    err.sqlite_errorcode = sqlite3.SQLITE_CORRUPT
    assert not await recover(path, err, None, [])
    assert path.exists()
    assert not list(tmp_path.glob("*.corrupt-*"))


# -- 4. a damaged WAL header ------------------------------------------------------------


async def test_damaged_wal_header_is_copied_aside_and_reported(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    live = tmp_path / "live" / "buffer.db"
    live.parent.mkdir()
    box = await fill(live, 4000, close=False)
    await fill_more(box, 400)
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    # what a power cut leaves: the file and its WAL, not yet checkpointed
    shutil.copy(live, crashed / "buffer.db")
    shutil.copy(live.with_name("buffer.db-wal"), crashed / "buffer.db-wal")
    await box.close()
    wal = crashed / "buffer.db-wal"
    good = wal.read_bytes()
    assert wal_header_problem(good[:WAL_HEADER]) is None
    wal.write_bytes(random.Random(32).randbytes(32) + good[32:])

    metrics = Metrics()
    with caplog.at_level(logging.ERROR):
        box = await Outbox.open(crashed / "buffer.db", settings(), GW, metrics)
    try:
        event = box.recovery[-1]
        assert event.kind == "wal_damaged"
        assert event.frames_lost > 0
        copy = Path(event.aside)
        assert copy.read_bytes()[32:] == good[32:], "the copy keeps the frames"
        assert metrics.value("iggy_edge_store_wal_damaged_total") == 1
        assert metrics.value("iggy_edge_store_wal_lost_frames_total") == event.frames_lost
        assert any("MISSING" in r.getMessage() for r in caplog.records)
        assert "damaged WAL" in box.attention
    finally:
        await box.close()


async def fill_more(box: Outbox, n: int) -> None:
    futures = [box.submit(item(100_000 + i)) for i in range(n)]
    for f in futures:
        await f


def test_wal_header_check_follows_the_file_format() -> None:
    """A header SQLite wrote passes; each damaged field is named."""
    salt = (0x12345678, 0x9ABCDEF0)
    head = struct.pack(">6I", 0x377F0682, 3007000, 4096, 0, *salt)
    good = head + struct.pack(">2I", *wal_checksum(head, big_endian=False))
    assert wal_header_problem(good) is None
    assert "magic" in str(wal_header_problem(b"\0" * 4 + good[4:]))
    assert "version" in str(wal_header_problem(good[:4] + struct.pack(">I", 1) + good[8:]))
    assert "page size" in str(wal_header_problem(good[:8] + struct.pack(">I", 1000) + good[12:]))
    salt_flipped = good[:16] + bytes([good[16] ^ 1]) + good[17:]
    assert "checksum" in str(wal_header_problem(salt_flipped))
