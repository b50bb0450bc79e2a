"""Salvage: everything readable of a damaged buffer file copied into a fresh
one, with its ids and order (see the package docstring)."""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Final

from ..db import sync_transaction
from ..sources import Catalog
from .events import Event

log = logging.getLogger(__name__)

SALVAGE_CHUNK: Final = 512
SEQ_MARGIN: Final = 1_000_000  # seqs skipped when the old sequence is unreadable


def move_aside(path: Path, now: float) -> Path:
    aside = path.with_name(f"{path.name}.corrupt-{int(now)}")
    path.rename(aside)
    for suffix in ("-wal", "-shm"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            side.rename(aside.with_name(aside.name + suffix))
    return aside


def _try(read: Callable[[], Any]) -> Any:
    try:
        return read()
    except sqlite3.DatabaseError as e:
        log.warning("salvage: %s", e)
        return None


def _read_range(
    src: sqlite3.Connection, sql: str, lo: int, hi: int, bad: list[int]
) -> Iterator[tuple[Any, ...]]:
    """Rows with key in [lo, hi); a range that fails is halved down to single
    keys, and the keys that still fail are appended to `bad`."""
    try:
        rows = src.execute(sql, (lo, hi)).fetchall()
    except sqlite3.DatabaseError:
        if hi - lo <= 1:
            bad.append(lo)
            return
        mid = (lo + hi) // 2
        yield from _read_range(src, sql, lo, mid, bad)
        yield from _read_range(src, sql, mid, hi, bad)
        return
    yield from rows


def _key_range(src: sqlite3.Connection, table: str, key: str, last: int | None) -> tuple[int, int] | None:
    lo = _try(lambda: src.execute(f"SELECT min({key}) FROM {table}").fetchone()[0])  # noqa: S608 - fixed names
    hi = _try(lambda: src.execute(f"SELECT max({key}) FROM {table}").fetchone()[0])  # noqa: S608
    if hi is None:
        hi = last
    if lo is None and hi is not None:
        lo = 1
    if lo is None or hi is None:
        return None
    return int(lo), int(hi)


def _outbox_row_ok(r: tuple[Any, ...]) -> bool:
    """Flipped bytes can leave a row SQLite reads but that is not ours (NULLs,
    wrong types): such a row counts as unreadable."""
    seq, rid, pkey, topic, flags, recv, dseq, payload = r
    return (
        all(isinstance(x, int) for x in (seq, rid, flags, recv))
        and isinstance(pkey, str)
        and isinstance(topic, str)
        and (dseq is None or isinstance(dseq, int))
        and isinstance(payload, bytes)
    )


def _dead_row_ok(r: tuple[Any, ...]) -> bool:
    recv, topic, qos, retain, reason, detail, payload, size = r
    return (
        all(isinstance(x, int) for x in (recv, qos, retain, size))
        and isinstance(topic, (bytes, str))
        and isinstance(reason, str)
        and isinstance(detail, str)
        and isinstance(payload, bytes)
    )


def _scan(src: sqlite3.Connection, sql: str) -> Iterator[tuple[Any, ...]]:
    """Rows of `sql` until the first error."""
    try:
        cur = src.execute(sql)
        while rows := cur.fetchmany(SALVAGE_CHUNK):
            yield from rows
    except sqlite3.DatabaseError as e:
        log.warning("salvage scan stopped: %s", e)


def _write_outbox(
    dst: sqlite3.Connection, rows: Iterator[tuple[Any, ...]], route_ids: set[int], orphan_seqs: set[int]
) -> tuple[int, int]:
    """Insert the valid rows not yet in `dst` (seq kept); rows whose route is
    unknown become dead letters.  Returns (records, dead letters) added."""
    n = k = d = 0
    batch: list[tuple[Any, ...]] = []
    orphans: list[tuple[Any, ...]] = []

    catalog = Catalog()

    def source(r: tuple[Any, ...]) -> int:
        return catalog.source_id_sync(dst, (r[1], r[2], r[3]))

    def flush() -> tuple[int, int]:
        with sync_transaction(dst):
            placed = [(r[0], source(r), r[4], r[5], r[6], r[7]) for r in batch]
            before = dst.total_changes  # after the sources: count the records only
            dst.executemany(
                "INSERT OR IGNORE INTO outbox(seq, source_id, flags, received_us, device_seq, payload)"
                " VALUES (?,?,?,?,?,?)",
                placed,
            )
            added = dst.total_changes - before
            fresh = list({r[0]: r for r in orphans if r[0] not in orphan_seqs}.values())
            dst.executemany(
                f"INSERT INTO dead_letters({DEAD_COLS}) VALUES (?,?,?,?,?,?,?,?)",  # noqa: S608
                [
                    (
                        r[5],
                        r[3].encode(),
                        r[4] & 3,
                        (r[4] >> 2) & 1,
                        "salvaged",
                        f"salvaged from a damaged buffer (seq {r[0]}); its route was unreadable",
                        r[7],
                        len(r[7]),
                    )
                    for r in fresh
                ],
            )
            orphan_seqs.update(r[0] for r in fresh)
        batch.clear()
        orphans.clear()
        return added, len(fresh)

    for r in rows:
        if not _outbox_row_ok(r):
            continue
        (batch if r[1] in route_ids else orphans).append(r)
        n += 1
        if n % SALVAGE_CHUNK == 0:
            a, b = flush()
            k += a
            d += b
    a, b = flush()
    return k + a, d + b


OUTBOX_COLS: Final = "seq, route_id, pkey, mqtt_topic, flags, received_us, device_seq, payload"
OUTBOX_V2_COLS: Final = "seq, source_id, flags, received_us, device_seq, payload"


def _v1_shape(
    rows: Iterable[tuple[Any, ...]], sources: dict[int, tuple[Any, Any, Any]] | None
) -> Iterator[tuple[Any, ...]]:
    """Rows of either schema version as version 1 rows (OUTBOX_COLS).  A
    version 2 row whose source is unreadable cannot be placed: skipped (it
    counts as unreadable)."""
    if sources is None:
        yield from rows
        return
    for seq, sid, flags, recv, dseq, payload in rows:
        src = sources.get(sid)
        if src is not None:
            yield (seq, *src, flags, recv, dseq, payload)


DEAD_COLS: Final = "received_us, mqtt_topic, qos, retain, reason, detail, payload, payload_size"


def salvage(src_path: Path, dst_path: Path, *, now: float | None = None) -> Event:
    """Copy everything readable from the damaged `src_path` into the fresh
    buffer `dst_path` (schema created, empty).  See the module docstring."""
    now = time.time() if now is None else now
    src = sqlite3.connect(f"file:{src_path}?mode=ro", uri=True, timeout=5)
    dst = sqlite3.connect(dst_path, isolation_level=None, timeout=5)
    salvaged = unreadable = dead = 0
    notes: list[str] = []
    try:
        epoch = _try(lambda: src.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchone())
        routes = _try(lambda: src.execute("SELECT id, stream, topic FROM routes").fetchall()) or []
        last = _try(lambda: src.execute("SELECT seq FROM sqlite_sequence WHERE name = 'outbox'").fetchone())
        route_ids = {int(r[0]) for r in routes}
        # Version 2 files name each row's source by id (schema.py); read the
        # sources first and put the rows back into the version 1 shape.
        columns = _try(lambda: {str(r[1]) for r in src.execute("PRAGMA table_info(outbox)")}) or set()
        src_sources: dict[int, tuple[Any, Any, Any]] | None = None
        cols = OUTBOX_COLS
        if "source_id" in columns:
            cols = OUTBOX_V2_COLS
            rows_of_sources = _try(
                lambda: src.execute("SELECT id, route_id, pkey, mqtt_topic FROM sources").fetchall()
            )
            src_sources = {int(r[0]): (r[1], r[2], r[3]) for r in rows_of_sources or []}
        with sync_transaction(dst):
            if epoch is not None:
                dst.execute("INSERT OR REPLACE INTO meta(key, value) VALUES ('epoch', ?)", (str(epoch[0]),))
            else:
                notes.append("epoch unreadable: salvaged records get new ids")
            dst.executemany("INSERT OR IGNORE INTO routes(id, stream, topic) VALUES (?, ?, ?)", routes)
        span = _key_range(src, "outbox", "seq", None if last is None else int(last[0]))
        top = 0
        if span is not None:
            sql = f"SELECT {cols} FROM outbox WHERE seq >= ? AND seq < ? ORDER BY seq"  # noqa: S608
            orphan_seqs: set[int] = set()
            for lo in range(span[0], span[1] + 1, SALVAGE_CHUNK):
                rows = _v1_shape(
                    _read_range(src, sql, lo, min(lo + SALVAGE_CHUNK, span[1] + 1), []), src_sources
                )
                k, d = _write_outbox(dst, rows, route_ids, orphan_seqs)
                salvaged += k
                dead += d
            # A damaged interior page can hide leaf pages from the seq search;
            # a plain scan walks the leaves in b-tree order and may still reach them.
            scan = _v1_shape(_scan(src, f"SELECT {cols} FROM outbox"), src_sources)  # noqa: S608
            k, d = _write_outbox(dst, scan, route_ids, orphan_seqs)
            salvaged += k
            dead += d
            top = span[1]
            unreadable = max(0, span[1] - span[0] + 1 - salvaged - dead)
        old_last = None if last is None else int(last[0])
        next_seq = old_last if old_last is not None else top + SEQ_MARGIN
        if old_last is None:
            notes.append(f"sequence unreadable: new records continue after seq {next_seq}")
        with sync_transaction(dst):
            # AUTOINCREMENT: the next seq follows the largest ever handed out.
            dst.execute("DELETE FROM sqlite_sequence WHERE name = 'outbox'")
            dst.execute("INSERT INTO sqlite_sequence(name, seq) VALUES ('outbox', ?)", (max(next_seq, top),))
            drops = _try(lambda: src.execute("SELECT reason, count FROM drops").fetchall()) or []
            dst.executemany("INSERT OR REPLACE INTO drops(reason, count) VALUES (?, ?)", drops)
        dspan = _key_range(src, "dead_letters", "id", None)
        if dspan is not None:
            bad_dead: list[int] = []
            sql = f"SELECT {DEAD_COLS} FROM dead_letters WHERE id >= ? AND id < ? ORDER BY id"  # noqa: S608
            for lo in range(dspan[0], dspan[1] + 1, SALVAGE_CHUNK):
                drows: list[tuple[Any, ...]] = []
                for r in _read_range(src, sql, lo, min(lo + SALVAGE_CHUNK, dspan[1] + 1), bad_dead):
                    if _dead_row_ok(r):
                        drows.append(r)
                    else:
                        bad_dead.append(-1)
                with sync_transaction(dst):
                    dst.executemany(f"INSERT INTO dead_letters({DEAD_COLS}) VALUES (?,?,?,?,?,?,?,?)", drows)  # noqa: S608
            if bad_dead:
                notes.append(f"{len(bad_dead)} dead letters unreadable")
    finally:
        src.close()
        dst.close()
    detail = "; ".join(notes) or "all readable rows kept with their ids"
    return Event(
        "salvaged",
        now,
        detail,
        aside=str(src_path),
        salvaged=salvaged,
        unreadable=unreadable,
        dead_letters=dead,
    )
