"""Tools on the inbox for the CLI, beside buffer_admin.py: read-only views
(commands, configs, offsets) and the marks `config republish` writes (another
process; WAL lets it read and write beside the running agent).  Tables:
downlink/inbox_schema.py; the agent's side: downlink/inbox.py."""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .downlink.inbox_schema import mark_sql
from .store.db import ro_connect


@dataclass(frozen=True, slots=True)
class CommandRow:
    seq: int
    id: str
    device: str
    name: str
    state: str
    created_at: float
    expires_at: float
    received_at: float
    updated_at: float
    detail: str
    source: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "device": self.device,
            "name": self.name,
            "state": self.state,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
            "received_at": self.received_at,
            "updated_at": self.updated_at,
            "detail": self.detail,
            "source": self.source,
        }


def request_republish(path: Path, device: str | None = None) -> int:
    """From another process (the CLI): mark delivered configs for the
    running agent's deliverer to publish again; returns how many.  Writes
    only rows (WAL, busy timeout): the agent's one deliver connection stays
    the only publisher of down/config, so a restore cannot race a newer
    config on another connection."""
    if not path.exists():
        raise FileNotFoundError(f"no buffer database at {path} (has the agent run yet?)")
    conn = sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=10, isolation_level=None)
    try:
        if not _has_table(conn, "downlink_config"):
            return 0
        return conn.execute(*mark_sql(device, time.time())).rowcount
    finally:
        conn.close()


def read_configs(path: Path) -> list[tuple[str, str, str, str]]:
    """(device, id, state, source) of every device's newest config."""
    conn = ro_connect(path)
    try:
        if not _has_table(conn, "downlink_config"):
            return []
        rows = conn.execute(
            "SELECT device, id, state, source FROM downlink_config ORDER BY device"
        ).fetchall()
    finally:
        conn.close()
    return [(r[0], r[1], r[2], r[3]) for r in rows]


# -- read-only views for the CLI (another process; WAL lets it read) --------------


def _has_table(conn: sqlite3.Connection, name: str) -> bool:
    row = conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?", (name,)).fetchone()
    return row is not None


def read_commands(path: Path, *, limit: int = 50, device: str | None = None) -> list[CommandRow]:
    """The most recent commands (newest first)."""
    conn = ro_connect(path)
    try:
        if not _has_table(conn, "downlink_commands"):
            return []
        sql = (
            "SELECT seq, id, device, name, state, created_at, expires_at, received_at, updated_at, detail,"
            " source FROM downlink_commands"
        )
        params: tuple[Any, ...] = ()
        if device is not None:
            sql += " WHERE device = ?"
            params = (device,)
        rows = conn.execute(sql + " ORDER BY seq DESC LIMIT ?", (*params, limit)).fetchall()
    finally:
        conn.close()
    return [CommandRow(*r) for r in rows]


def read_offsets(path: Path) -> list[tuple[str, str, int, int, int | None]]:
    """(stream, topic, partition, last consumed, last mirrored)."""
    conn = ro_connect(path)
    try:
        if not _has_table(conn, "downlink_offsets"):
            return []
        rows = conn.execute(
            "SELECT stream, topic, partition_id, last_offset, mirrored_offset FROM downlink_offsets"
            " ORDER BY stream, topic, partition_id"
        ).fetchall()
    finally:
        conn.close()
    return [(r[0], r[1], int(r[2]), int(r[3]), r[4]) for r in rows]
