"""Connections, transactions and pragmas: the one database layer.

Every user of the buffer file goes through here: the outbox and the inbox
(each its own `Database`, i.e. its own aiosqlite connection and lock) and the
CLI's buffer tools (plain `sqlite3`, a separate process).

* `Database.lock` serialises every statement on its connection.  A
  ``BEGIN ... COMMIT`` spans awaits, and the tasks sharing a connection
  (committer, forwarder, dead letters, housekeeping; poll, deliverer, acks)
  would otherwise interleave: "cannot start a transaction within a
  transaction", a read seeing another task's uncommitted rows, one task's
  ``PRAGMA synchronous`` changing another's commit.
* `Database.transaction()` is the only ``BEGIN IMMEDIATE ... COMMIT`` of the
  agent.  BEGIN is inside the ``try``: a task cancelled while awaiting BEGIN
  still has it executed by aiosqlite's thread, so it must roll back, and any
  error or cancellation rolls back so the connection is never left inside a
  transaction for the next caller.  `sync_transaction()` is the same for the
  CLI's blocking connections.
* Pragmas: WAL, a busy timeout, ``synchronous`` as asked (tracked, so setting
  the level it already has costs no round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiosqlite


class StoreError(Exception):
    """The buffer cannot take or give records (disk full, I/O error)."""


class NoDatabase(StoreError, FileNotFoundError):
    """The buffer file does not exist (the agent has not run yet)."""


class Database:
    """One aiosqlite connection, the lock that serialises its statements, and
    its transactions.  See the module docstring."""

    def __init__(self, conn: aiosqlite.Connection) -> None:
        self.conn = conn
        self.lock = asyncio.Lock()
        self._sync_now = ""  # PRAGMA synchronous as last set through synchronous()

    @classmethod
    async def connect(
        cls,
        path: Path,
        *,
        busy_timeout_ms: int = 5000,
        synchronous: str | None = None,
        schema: str | None = None,
    ) -> Database:
        """Open `path` (WAL, busy timeout, optional synchronous level and
        schema script).  The connection is closed again on any failure, also
        when cancelled: an unclosed aiosqlite connection keeps its thread alive
        and reports into a closed event loop at exit."""
        conn = await aiosqlite.connect(path, isolation_level=None)  # explicit BEGIN/COMMIT
        db = cls(conn)
        try:
            await conn.execute("PRAGMA journal_mode=WAL")
            await conn.execute(f"PRAGMA busy_timeout={int(busy_timeout_ms)}")
            if synchronous is not None:
                await db.synchronous(synchronous)
            if schema is not None:
                await conn.executescript(schema)
        except BaseException:
            await conn.close()
            raise
        return db

    async def close(self, *, checkpoint: bool = False) -> None:
        if checkpoint:
            with contextlib.suppress(sqlite3.Error):
                await self.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        await self.conn.close()

    async def synchronous(self, level: str) -> None:
        """PRAGMA synchronous for the next commit (lock held), skipping the
        round trip when it is already set."""
        level = level.upper()
        if self._sync_now != level:
            await self.conn.execute(f"PRAGMA synchronous={level}")
            self._sync_now = level

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[aiosqlite.Connection]:
        """BEGIN IMMEDIATE ... COMMIT; ROLLBACK on any error or cancellation.
        The caller holds `lock` (so it can prepare and finish under the same
        lock); `write()` takes both."""
        assert self.lock.locked(), "Database.transaction() needs Database.lock"
        try:
            await self.conn.execute("BEGIN IMMEDIATE")  # inside try: a cancelled BEGIN still rolls back
            yield self.conn
            await self.conn.execute("COMMIT")
        except BaseException:
            with contextlib.suppress(sqlite3.Error):
                await self.conn.execute("ROLLBACK")
            raise

    @contextlib.asynccontextmanager
    async def write(self) -> AsyncIterator[aiosqlite.Connection]:
        """The lock and a transaction."""
        async with self.lock, self.transaction() as conn:
            yield conn

    async def fetchall(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        """One statement under the lock, all rows, one round trip."""
        async with self.lock:
            return list(await self.conn.execute_fetchall(sql, params))

    async def fetchone(self, sql: str, params: tuple[Any, ...] = ()) -> Any:
        """The first row or None (caller holds the lock, or needs none yet)."""
        async with self.conn.execute(sql, params) as cur:
            return await cur.fetchone()


# -- the CLI's blocking connections (a separate process; WAL lets it read) ----


def ro_connect(path: Path) -> sqlite3.Connection:
    """A read-only connection to an existing buffer file."""
    if not path.exists():
        raise NoDatabase(f"{path}: no buffer database (has the agent run yet?)")
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)


@contextlib.contextmanager
def sync_transaction(conn: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
    """BEGIN IMMEDIATE ... COMMIT on a blocking connection (isolation_level
    None); ROLLBACK on any error or interruption."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield conn
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


class BufferBusy(StoreError):
    """The buffer is open in another process (normally the running agent)."""


@contextlib.contextmanager
def exclusive(path: Path) -> Iterator[sqlite3.Connection]:
    """A read-write connection that holds the buffer exclusively (see above)."""
    if not path.exists():
        raise StoreError(f"{path}: no buffer database (has the agent run yet?)")
    conn = sqlite3.connect(path, isolation_level=None, timeout=0)
    try:
        conn.execute("PRAGMA locking_mode=EXCLUSIVE")
        conn.execute("BEGIN IMMEDIATE")  # takes the exclusive lock now, or fails
        conn.execute("COMMIT")
    except sqlite3.OperationalError as e:
        conn.close()
        if "locked" in str(e) or "busy" in str(e):
            raise BufferBusy(
                f"{path} is in use by another process -- is the agent running? "
                "Stop it first (systemctl stop iggy-edge)"
            ) from e
        raise StoreError(f"{path}: {e}") from e
    try:
        yield conn
    finally:
        conn.close()
