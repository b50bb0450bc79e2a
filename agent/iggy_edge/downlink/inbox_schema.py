"""The inbox's tables and the state names both its users write: the agent
(inbox.py, its own connection) and the CLI (inbox_admin.py, another process:
listing, `config republish`)."""

from __future__ import annotations

from typing import Any, Final

from .commands import CommandState

RECEIVED: Final = CommandState.RECEIVED.value
REPUBLISH: Final = "republish"  # delivered once; the broker lost it: publish again (a restore)
DELIVERED: Final = CommandState.DELIVERED.value

SCHEMA: Final = """
CREATE TABLE IF NOT EXISTS downlink_offsets (
    stream TEXT NOT NULL,
    topic TEXT NOT NULL,
    partition_id INTEGER NOT NULL,
    last_offset INTEGER NOT NULL,       -- last consumed; polling resumes at +1
    mirrored_offset INTEGER,            -- last offset the Iggy server accepted
    updated_at REAL NOT NULL,
    PRIMARY KEY (stream, topic, partition_id)
);
CREATE TABLE IF NOT EXISTS downlink_meta (
    key TEXT PRIMARY KEY,               -- e.g. "legacy_drained": the two-topic scheme was read out
    value TEXT NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS downlink_commands (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,   -- arrival order = delivery order
    id TEXT NOT NULL UNIQUE,
    device TEXT NOT NULL,
    name TEXT NOT NULL,
    payload BLOB NOT NULL,              -- what the device receives
    created_at REAL NOT NULL,
    expires_at REAL NOT NULL,
    received_at REAL NOT NULL,
    state TEXT NOT NULL,
    updated_at REAL NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    source TEXT NOT NULL                -- topic/partition@offset in Iggy
);
CREATE INDEX IF NOT EXISTS downlink_commands_state ON downlink_commands(state, seq);
CREATE TABLE IF NOT EXISTS downlink_config (
    device TEXT PRIMARY KEY,
    id TEXT NOT NULL,
    payload BLOB NOT NULL,              -- retained on down/config
    created_at REAL NOT NULL,
    received_at REAL NOT NULL,
    state TEXT NOT NULL,                -- received | delivered | failed | republish
    updated_at REAL NOT NULL,
    detail TEXT NOT NULL DEFAULT '',
    source TEXT NOT NULL
);
"""


def mark_sql(
    device: str | None, now: float, since: float | None = None, before: float | None = None
) -> tuple[str, tuple[Any, ...]]:
    sql = "UPDATE downlink_config SET state = ?, detail = 'restore requested', updated_at = ? WHERE state = ?"
    params: tuple[Any, ...] = (REPUBLISH, now, DELIVERED)
    if device is not None:
        sql += " AND device = ?"
        params += (device,)
    if since is not None:
        sql += " AND updated_at >= ?"
        params += (since,)
    if before is not None:
        sql += " AND updated_at < ?"
        params += (before,)
    return sql, params
