"""Opening the buffer file, and what happens when that fails: the one place
that tells a full or failing disk (the file stays, `StoreUnavailable`, retry)
from a confirmed corruption (move aside, salvage, go on with the fresh file).
`open_database` for opening; `open_loaded` for opening and loading (the
outbox: a corruption can also show first when the rows are read)."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

from ...metrics import Metrics
from ..db import Database
from ..schema import open_file
from .errors import StoreUnavailable, as_store_error, integrity_problem, is_corruption
from .events import Event, record_events
from .salvage import move_aside, salvage
from .wal import check_wal

log = logging.getLogger(__name__)

T = TypeVar("T")


async def open_database(path: Path, metrics: Metrics | None = None) -> Database:
    """Open (creating) the buffer database.  A damaged WAL header is copied
    aside first; a confirmed corruption moves the file aside and salvages it
    into a fresh one; any other failure leaves the file in place and raises
    (`StoreUnavailable`, or `StoreError` "locked").  See the package docstring."""
    events: list[Event] = []
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        wal = check_wal(path)
    except OSError as e:
        raise StoreUnavailable(f"{path}: {e}; the file is left in place") from e
    if wal is not None:
        events.append(wal)
        if metrics is not None:
            metrics.store_wal_damaged.inc()
            metrics.store_wal_frames_lost.inc(wal.frames_lost)
    return await reopen(path, metrics, events)


async def reopen(
    path: Path, metrics: Metrics | None, events: list[Event], *, recovered: bool = False
) -> Database:
    """`_open`, salvaging once on a confirmed corruption; records `events`."""
    try:
        db = await open_file(path)
    except (sqlite3.Error, OSError) as e:
        if metrics is not None:
            metrics.store_errors.inc()
        if not recovered and await recover(path, e, metrics, events):
            return await reopen(path, metrics, events, recovered=True)
        raise as_store_error(path, e) from e
    if events:
        try:
            await record_events(db, events)
        except BaseException:
            await db.close()
            raise
    return db


async def recover(path: Path, e: BaseException, metrics: Metrics | None, events: list[Event]) -> bool:
    """On a confirmed corruption: move the file aside, salvage it into a
    fresh one and return True.  Otherwise (not a corruption code, or
    integrity_check says ok, or the check itself hits the disk) False."""
    if not is_corruption(e):
        return False
    try:
        problem = await asyncio.to_thread(integrity_problem, path)
    except (sqlite3.Error, OSError) as check_error:
        log.error("buffer %s: %s, and checking it failed too (%s): leaving it in place", path, e, check_error)
        return False
    if problem is None:
        log.error("buffer %s: %s, but integrity_check is ok: leaving it in place", path, e)
        return False
    # Salvage into a new file beside it first and swap only when that worked:
    # a failure on the way (the disk is also full) leaves the damaged file in
    # place for the next attempt, never an empty buffer in its stead.
    now = time.time()
    tmp = path.with_name(path.name + ".salvage")
    log.error(
        "buffer database %s is damaged (%s; integrity_check: %s): salvaging what can be read"
        " into a fresh buffer",
        path,
        e,
        problem[:300],
    )
    try:
        for side in (tmp, *(tmp.with_name(tmp.name + x) for x in ("-wal", "-shm"))):
            side.unlink(missing_ok=True)
        fresh = await open_file(tmp)
        await fresh.close()
        event = await asyncio.to_thread(salvage, path, tmp, now=now)
        aside = move_aside(path, now)
        for suffix in ("-wal", "-shm"):
            side = tmp.with_name(tmp.name + suffix)
            if side.exists():
                side.rename(path.with_name(path.name + suffix))
        tmp.rename(path)
    except (sqlite3.Error, OSError) as salvage_error:
        raise StoreUnavailable(
            f"{path}: salvage of the damaged buffer failed: {salvage_error}; the file is left in place"
        ) from salvage_error
    event.aside = str(aside)
    log.error(
        "salvaged %d records from %s into a fresh buffer (ids and order kept); %d unreadable, %d became dead "
        "letters (route unreadable); %s.  Acknowledge with: iggy-edge buffer ack-salvage",
        event.salvaged,
        aside,
        event.unreadable,
        event.dead_letters,
        event.detail,
    )
    if metrics is not None:
        metrics.store_moved_aside.inc()
        metrics.store_salvaged.inc(event.salvaged)
        metrics.store_unreadable.inc(event.unreadable)
    events.append(event)
    return True


async def open_loaded(path: Path, metrics: Metrics, load: Callable[[Database], Awaitable[T]]) -> T:
    """`open_database`, then `load(db)` (the outbox reads its rows).  An error
    at load takes the same path as one at open: a confirmed corruption is
    salvaged once into a fresh file and loaded again; anything else leaves
    the file in place and raises `StoreError` (`StoreUnavailable` when the
    disk failed), with the connection closed (no aiosqlite thread left
    behind)."""
    db = await open_database(path, metrics)
    recovered = False
    while True:
        try:
            return await load(db)
        except (sqlite3.Error, OSError) as e:
            await db.close()
            metrics.store_errors.inc()
            events: list[Event] = []
            if recovered or not await recover(path, e, metrics, events):
                raise as_store_error(path, e) from e
            db = await reopen(path, metrics, events, recovered=True)
            recovered = True
        except BaseException:
            await db.close()
            raise
