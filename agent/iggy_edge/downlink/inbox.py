"""The inbox: commands and desired configs read from Iggy, with read offsets.

Design
------
* Same database file as the outbox (store/), own tables (inbox_schema.py), own aiosqlite
  connection.  Not `Outbox.connection`: the outbox runs explicit
  ``BEGIN IMMEDIATE ... COMMIT`` sequences on its connection with awaits in
  between, so a statement of ours issued meanwhile would silently join (or
  end) its transaction.  A second connection gets its own transactions;
  SQLite (WAL) serialises the two writers with ``busy_timeout`` and both
  transactions are a few milliseconds long.
* **Offsets.**  ``downlink_offsets`` holds per (stream, topic, partition) the
  last *consumed* offset; polling resumes at +1.  It is written in the same
  transaction as the commands read up to it (`store_polled`), so after a crash
  either both are there or neither is, and the poll re-reads exactly what is
  missing.  SQLite is the source of truth; ``mirrored_offset`` records what
  the Iggy server last accepted as this gateway's consumer offset.
* **Commands** keep their arrival order (``seq``, AUTOINCREMENT), which is
  per-device Iggy order because a device's commands live in one partition.
  The command id is UNIQUE: a second copy (the cloud side retried an
  ambiguous send; Iggy keeps duplicates) is not delivered again while the
  first is remembered (``history_s``).
* **States**: received -> delivered -> acked, or expired / failed.  Every
  transition is guarded by the state it leaves (``WHERE state IN ...``), so a
  late PUBACK cannot overwrite a device's ack and a command leaves
  ``received`` only once -- the deliverer publishes only ``received`` rows,
  which is why the agent's own bookkeeping never delivers a command twice
  once its delivery is recorded.
* **Config** keeps one row per device, the newest desired config (by Iggy
  order).  An identical re-send does not reset the row, so it is not
  published again.
* One lock per inbox (its `Database`, store/db.py): the poll, the deliverer and the ack listener share
  the connection, and an aiosqlite connection has one transaction at a time.
* Durability follows ``buffer.synchronous`` (FULL by default).
* The rows it hands out and the errors it raises are in inbox_rows.py.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import aiosqlite

from ..config import Settings
from ..store.db import Database
from .commands import Ack, Command, CommandState, DesiredConfig
from .inbox_rows import (
    ENCODE_ERRORS,
    ROW_ERRORS,
    AckResult,
    PendingCommand,
    PendingConfig,
    RowRefused,
    StoredBatch,
)
from .inbox_schema import RECEIVED, REPUBLISH, SCHEMA, mark_sql

TERMINAL: Final = tuple(
    s.value for s in (CommandState.ACKED, CommandState.EXPIRED, CommandState.FAILED, CommandState.DELIVERED)
)

# Whether any row waits for the deliverer (`Inbox.nothing_due`), with the
# file's data_version in the same statement: the commands' EXISTS stops in
# their state index, the configs are one row a device.
_NOTHING_DUE: Final = (
    "SELECT (SELECT data_version FROM pragma_data_version),"
    " EXISTS(SELECT 1 FROM downlink_commands WHERE state = ?)"
    " OR EXISTS(SELECT 1 FROM downlink_config WHERE state IN (?, ?))"
)
_DATA_VERSION: Final = "PRAGMA data_version"


class Inbox:
    def __init__(self, db: Database, settings: Settings) -> None:
        self._db = db
        self._conn = db.conn
        self._settings = settings
        self._waiting_bound: int | None = None  # `waiting_at_most`
        self._writes = 0  # transactions begun (`nothing_due`)
        self._quiet = False  # `nothing_due`: known that nothing waits, no write since
        self._quiet_version = -1  # the file's data_version when that was known

    @classmethod
    async def open(cls, path: Path, settings: Settings) -> Inbox:
        """Open the agent's buffer database (the outbox created it) on a
        connection of our own and create our tables if missing (the
        connection is closed again on failure or cancellation, see
        store/db.py)."""
        path.parent.mkdir(parents=True, exist_ok=True)
        db = await Database.connect(
            path, busy_timeout_ms=10000, synchronous=settings.buffer.synchronous, schema=SCHEMA
        )
        return cls(db, settings)

    def reconfigure(self, settings: Settings) -> None:
        """History and config bounds from `settings` (a reload)."""
        self._settings = settings

    async def close(self) -> None:
        await self._db.close()

    def _transaction(self) -> contextlib.AbstractAsyncContextManager[aiosqlite.Connection]:
        """The inbox's lock and one transaction (store/db.py).  Any write may
        give the deliverer work, so it ends what `nothing_due` knew."""
        self._writes += 1
        self._quiet = False
        return self._db.write()

    async def _fetchall(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        return await self._db.fetchall(sql, params)

    # -- offsets ------------------------------------------------------------

    async def offsets(self) -> dict[tuple[str, str, int], tuple[int, int | None]]:
        """(stream, topic, partition) -> (last consumed, last mirrored)."""
        rows = await self._fetchall(
            "SELECT stream, topic, partition_id, last_offset, mirrored_offset FROM downlink_offsets"
        )
        return {(r[0], r[1], int(r[2])): (int(r[3]), None if r[4] is None else int(r[4])) for r in rows}

    async def set_mirrored(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        async with self._transaction():
            await self._conn.execute(
                "UPDATE downlink_offsets SET mirrored_offset = ?"
                " WHERE stream = ? AND topic = ? AND partition_id = ?",
                (offset, stream, topic, partition_id),
            )

    async def note(self, key: str) -> str | None:
        """A value the return path keeps about itself (``downlink_meta``)."""
        rows = await self._fetchall("SELECT value FROM downlink_meta WHERE key = ?", (key,))
        return None if not rows else str(rows[0][0])

    async def set_note(self, key: str, value: str) -> None:
        async with self._transaction():
            await self._conn.execute(
                "INSERT INTO downlink_meta (key, value, updated_at) VALUES (?, ?, ?)"
                " ON CONFLICT(key) DO UPDATE SET value = excluded.value, updated_at = excluded.updated_at",
                (key, value, time.time()),
            )

    # -- the return poll's transaction ---------------------------------------

    async def store_polled(
        self,
        stream: str,
        topic: str,
        partition_id: int,
        last_offset: int,
        commands: Sequence[tuple[Command, str]] = (),
        configs: Sequence[tuple[DesiredConfig, str]] = (),
        *,
        now: float | None = None,
    ) -> StoredBatch:
        """Insert commands/configs read from one partition and advance its
        offset to `last_offset`, all in one transaction.  Each item carries its
        source (``topic/partition@offset``).  An item SQLite refuses
        (`ROW_ERRORS`) rolls everything back and raises `RowRefused` naming
        it, so the caller can dead-letter it and store the others."""
        now = time.time() if now is None else now
        new = expired = duplicates = replaced = 0
        async with self._transaction():
            for i, (cmd, source) in enumerate(commands):
                try:
                    payload = cmd.device_payload()
                except ENCODE_ERRORS as e:
                    raise RowRefused("command", i, e) from e
                try:
                    added = await self._insert_command(cmd, payload, source, now)
                except ROW_ERRORS as e:
                    raise RowRefused("command", i, e) from e
                if added is None:
                    duplicates += 1
                else:
                    new += 1
                    expired += added is CommandState.EXPIRED
            for i, (cfg, source) in enumerate(configs):
                try:
                    payload = cfg.device_payload()
                except ENCODE_ERRORS as e:
                    raise RowRefused("config", i, e) from e
                try:
                    replaced += await self._upsert_config(cfg, payload, source, now)
                except ROW_ERRORS as e:
                    raise RowRefused("config", i, e) from e
            await self._conn.execute(
                "INSERT INTO downlink_offsets(stream, topic, partition_id, last_offset, updated_at)"
                " VALUES (?,?,?,?,?) ON CONFLICT(stream, topic, partition_id)"
                " DO UPDATE SET last_offset = excluded.last_offset, updated_at = excluded.updated_at",
                (stream, topic, partition_id, last_offset, now),
            )
        if self._waiting_bound is not None:
            self._waiting_bound += new - expired
        return StoredBatch(new, expired, duplicates, replaced)

    async def _insert_command(
        self, cmd: Command, payload: bytes, source: str, now: float
    ) -> CommandState | None:
        """The state it got, or None for a duplicate id."""
        state = CommandState.EXPIRED if cmd.expired(now) else CommandState.RECEIVED
        before = self._conn.total_changes
        await self._conn.execute(
            "INSERT INTO downlink_commands(id, device, name, payload, created_at, expires_at,"
            " received_at, state, updated_at, detail, source) VALUES (?,?,?,?,?,?,?,?,?,?,?)"
            " ON CONFLICT(id) DO NOTHING",
            (
                cmd.id,
                cmd.device,
                cmd.name,
                payload,
                cmd.created_at,
                cmd.expires_at,
                now,
                state.value,
                now,
                "expired before it reached the gateway" if state is CommandState.EXPIRED else "",
                source,
            ),
        )
        return None if self._conn.total_changes == before else state

    async def _upsert_config(self, cfg: DesiredConfig, payload: bytes, source: str, now: float) -> bool:
        """True when the row was inserted or replaced."""
        before = self._conn.total_changes
        await self._conn.execute(
            "INSERT INTO downlink_config(device, id, payload, created_at, received_at, state,"
            " updated_at, detail, source) VALUES (?,?,?,?,?,?,?,'',?)"
            " ON CONFLICT(device) DO UPDATE SET id = excluded.id, payload = excluded.payload,"
            " created_at = excluded.created_at, received_at = excluded.received_at,"
            " state = excluded.state, updated_at = excluded.updated_at, detail = '',"
            " source = excluded.source"
            " WHERE downlink_config.id IS NOT excluded.id"
            " OR downlink_config.payload IS NOT excluded.payload",
            (cfg.device, cfg.id, payload, cfg.created_at, now, RECEIVED, now, source),
        )
        return self._conn.total_changes != before

    async def config_devices(self, devices: Iterable[str]) -> tuple[int, set[str]]:
        """How many devices have a desired config, and which of `devices` do."""
        count = await self._fetchall("SELECT count(*) FROM downlink_config")
        rows = await self._fetchall(
            "SELECT device FROM downlink_config WHERE device IN (SELECT value FROM json_each(?))",
            (json.dumps(sorted(set(devices))),),
        )
        return int(count[0][0]), {r[0] for r in rows}

    # -- the deliverer's side ---------------------------------------------------

    async def waiting(self) -> int:
        """Commands received and not yet delivered (bounded by max_inbox)."""
        rows = await self._fetchall("SELECT count(*) FROM downlink_commands WHERE state = ?", (RECEIVED,))
        self._waiting_bound = int(rows[0][0])
        return self._waiting_bound

    async def waiting_at_most(self, exact_from: int) -> int:
        """`waiting()`, or while below `exact_from` a bound of it, with no query: only
        `store_polled` adds waiting commands (delivery and expiry take them away) and raises the bound."""
        if self._waiting_bound is None or self._waiting_bound >= exact_from:
            return await self.waiting()
        return self._waiting_bound

    @property
    def no_command_waits(self) -> bool:
        """Known without a query that no command waits: `nothing_due` found
        none and nothing of this process wrote since (only this process adds
        commands; the CLI marks configs)."""
        return self._quiet

    async def nothing_due(self) -> bool:
        """True when no command or config waits for delivery (none received,
        none to publish again), known from the last look while nothing wrote
        since: then the one statement is SQLite's ``data_version``, which
        changes when another connection commits (the CLI's `config
        republish` marks rows from its own process; the outbox's commits
        bump it too, and then the look runs again).  Each write of this
        process goes through `_transaction`, which ends what the look knew.
        (The idle deliverer ran five statements a second, one of them a
        write, issue 23.)"""
        if self._quiet:
            rows = await self._fetchall(_DATA_VERSION)
            if rows[0][0] == self._quiet_version:
                return True
            self._quiet = False
        writes = self._writes
        rows = await self._fetchall(_NOTHING_DUE, (RECEIVED, RECEIVED, REPUBLISH))
        version, due = rows[0]
        if due:
            return False
        # A write begun meanwhile may have queued for the lock after this
        # look: what it adds is not in the answer, so do not remember it.
        # (One begun before is ahead of the look in the lock's queue.)
        self._quiet = writes == self._writes
        self._quiet_version = version
        if self._quiet:
            self._waiting_bound = 0
        return True

    async def due_commands(self, limit: int) -> list[PendingCommand]:
        rows = await self._fetchall(
            "SELECT seq, id, device, payload, expires_at FROM downlink_commands WHERE state = ?"
            " ORDER BY seq LIMIT ?",
            (RECEIVED, limit),
        )
        return [PendingCommand(int(r[0]), r[1], r[2], bytes(r[3]), float(r[4])) for r in rows]

    async def due_configs(self, limit: int) -> list[PendingConfig]:
        rows = await self._fetchall(
            "SELECT device, id, payload FROM downlink_config WHERE state = ? ORDER BY received_at LIMIT ?",
            (RECEIVED, limit),
        )
        return [PendingConfig(r[0], r[1], bytes(r[2])) for r in rows]

    async def due_republish(self, limit: int) -> list[PendingConfig]:
        """Configs to restore, in device order."""
        rows = await self._fetchall(
            "SELECT device, id, payload FROM downlink_config WHERE state = ? ORDER BY device LIMIT ?",
            (REPUBLISH, limit),
        )
        return [PendingConfig(r[0], r[1], bytes(r[2]), REPUBLISH) for r in rows]

    async def mark_republish(
        self,
        device: str | None = None,
        *,
        since: float | None = None,
        before: float | None = None,
        now: float | None = None,
    ) -> int:
        """Restore: every delivered config (or only `device`'s; only those
        delivered at or after `since`; only those delivered before `before`,
        the time the deliverer reached the broker that lost them: one
        published to it already needs no restore) goes out again; returns how
        many rows were marked.  Rows still ``received`` are due anyway; ``failed`` ones
        (refused by the broker) stay so."""
        now = time.time() if now is None else now
        async with self._transaction():
            changes = self._conn.total_changes
            await self._conn.execute(*mark_sql(device, now, since, before))
            return self._conn.total_changes - changes

    async def finish(
        self, updates: Iterable[tuple[str, CommandState, str]], *, now: float | None = None
    ) -> list[tuple[str, CommandState]]:
        """Move `received` commands to delivered/expired/failed (id, state,
        detail); returns the transitions that happened."""
        return await self._transition(updates, (RECEIVED,), now)

    async def apply_acks(self, acks: Iterable[tuple[str, Ack]], *, now: float | None = None) -> AckResult:
        """Record device acks, each (the device it came from, the ack).  An
        ack counts only for a command addressed to that device; one naming
        another device's command changes nothing and is returned in
        `AckResult.wrong_device`.  Also from `received`: the device can
        answer before the broker's PUBACK reaches us, and an acked command
        must not be published again."""
        now = time.time() if now is None else now
        result = AckResult([], [])
        items = list(acks)
        if not items:
            return result
        async with self._transaction():
            for i, (device, ack) in enumerate(items):
                before = self._conn.total_changes
                detail = (
                    f"device: {ack.error}"
                    if ack.error is not None
                    else (f"result: {ack.result}" if ack.result is not None else "")
                )
                await self._conn.execute(
                    "UPDATE downlink_commands SET state = ?, detail = ?, updated_at = ?"
                    " WHERE id = ? AND device = ? AND state IN (?, ?)",
                    (ack.state.value, detail, now, ack.id, device, RECEIVED, CommandState.DELIVERED.value),
                )
                if self._conn.total_changes != before:
                    result.done.append((ack.id, ack.state))
                    continue
                async with self._conn.execute(
                    "SELECT device FROM downlink_commands WHERE id = ?", (ack.id,)
                ) as cur:
                    row = await cur.fetchone()
                if row is not None and row[0] != device:
                    result.wrong_device.append((i, str(row[0])))
        return result

    async def _transition(
        self,
        updates: Iterable[tuple[str, CommandState, str]],
        from_states: tuple[str, ...],
        now: float | None,
    ) -> list[tuple[str, CommandState]]:
        now = time.time() if now is None else now
        marks = ",".join("?" * len(from_states))
        done: list[tuple[str, CommandState]] = []
        items = list(updates)
        if not items:
            return done
        async with self._transaction():
            for cid, state, detail in items:
                before = self._conn.total_changes
                await self._conn.execute(
                    f"UPDATE downlink_commands SET state = ?, detail = ?, updated_at = ?"  # noqa: S608 - placeholders only
                    f" WHERE id = ? AND state IN ({marks})",
                    (state.value, detail, now, cid, *from_states),
                )
                if self._conn.total_changes != before:
                    done.append((cid, state))
        return done

    async def finish_configs(self, updates: Iterable[tuple[PendingConfig, str, str]]) -> None:
        """Mark configs delivered/failed -- only if no newer config replaced
        the row meanwhile (then the newer one is still due) and the row is
        still in the state it was read in."""
        now = time.time()
        async with self._transaction():
            for cfg, state, detail in updates:
                await self._conn.execute(
                    "UPDATE downlink_config SET state = ?, detail = ?, updated_at = ?"
                    " WHERE device = ? AND id = ? AND payload = ? AND state = ?",
                    (state, detail, now, cfg.device, cfg.id, cfg.payload, cfg.state),
                )

    async def expire_due(self, *, now: float | None = None) -> int:
        """Mark waiting commands whose expiry has passed as expired."""
        now = time.time() if now is None else now
        async with self._transaction():
            before = self._conn.total_changes
            await self._conn.execute(
                "UPDATE downlink_commands SET state = ?, detail = 'expired before delivery', updated_at = ?"
                " WHERE state = ? AND expires_at <= ?",
                (CommandState.EXPIRED.value, now, RECEIVED, now),
            )
            return self._conn.total_changes - before

    async def prune(self, *, now: float | None = None) -> int:
        """Forget finished commands older than history_s."""
        now = time.time() if now is None else now
        cutoff = now - self._settings.downlink.history_s
        marks = ",".join("?" * len(TERMINAL))
        async with self._transaction():
            before = self._conn.total_changes
            await self._conn.execute(
                f"DELETE FROM downlink_commands WHERE state IN ({marks}) AND updated_at < ?",  # noqa: S608
                (*TERMINAL, cutoff),
            )
            return self._conn.total_changes - before
