"""The gateway's update records (``ota.db`` in the state directory) and the
requests written into them.

The CLI (`iggy-edge device update`) and the cloud path (cloud.py) *request*
updates here; the agent's updater (updater.py) is the only one that talks to
the boards, picks requests up within a second and keeps each update's state
and progress here, so a restarted agent resumes.  Plain `sqlite3` (WAL, busy
timeout): the CLI is another process, and the agent calls these in a thread.

Tables: ``ota_artifacts`` / ``ota_files`` (the artifacts, by the sha256 of
their bundle, artifact.py), ``ota_rollouts`` (a set of boards with its
failure bound) and ``ota_updates`` (one row per board and update; a partial
unique index keeps **one active update per board**).  Bounded: at most
`MAX_ARTIFACTS` artifacts are kept (the oldest no active update uses go
first) and `MAX_FINISHED` finished updates.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .artifact import Artifact

DB_NAME: Final = "ota.db"
MAX_ARTIFACTS: Final = 16
MAX_FINISHED: Final = 2000
MAX_DEVICES_PER_REQUEST: Final = 1000
TERMINAL: Final = ("done", "rolled_back", "failed", "cancelled")
# queued -> probing -> offered -> downloading -> switching -> trial -> done
STATES: Final = ("queued", "probing", "offered", "downloading", "switching", "trial", *TERMINAL)
_ACTIVE: Final = "state NOT IN ('done', 'rolled_back', 'failed', 'cancelled')"

SCHEMA: Final = f"""
CREATE TABLE IF NOT EXISTS ota_artifacts (
    id TEXT PRIMARY KEY, version TEXT NOT NULL, mpy INTEGER, total INTEGER NOT NULL,
    files TEXT NOT NULL, source TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ota_files (
    artifact TEXT NOT NULL, idx INTEGER NOT NULL, path TEXT NOT NULL, data BLOB NOT NULL,
    PRIMARY KEY (artifact, idx));
CREATE TABLE IF NOT EXISTS ota_rollouts (
    id TEXT PRIMARY KEY, artifact TEXT NOT NULL, max_failures INTEGER NOT NULL,
    state TEXT NOT NULL, reason TEXT NOT NULL DEFAULT '', source TEXT NOT NULL,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS ota_updates (
    id TEXT PRIMARY KEY, device TEXT NOT NULL, artifact TEXT NOT NULL, rollout TEXT NOT NULL,
    wave INTEGER NOT NULL, state TEXT NOT NULL, done_bytes INTEGER NOT NULL DEFAULT 0,
    board_version TEXT, reason TEXT NOT NULL DEFAULT '', cancel INTEGER NOT NULL DEFAULT 0,
    created_at REAL NOT NULL, updated_at REAL NOT NULL);
CREATE UNIQUE INDEX IF NOT EXISTS ota_one_per_board ON ota_updates (device) WHERE {_ACTIVE};
CREATE INDEX IF NOT EXISTS ota_by_rollout ON ota_updates (rollout, wave);
"""


def db_path(state_dir: Path) -> Path:
    return state_dir / DB_NAME


def connect(path: Path) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    conn = sqlite3.connect(path, timeout=10, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.executescript(SCHEMA)
    return conn


def connect_ro(path: Path) -> sqlite3.Connection:
    """A read-only connection (status views): FileNotFoundError before the
    first update was requested."""
    if not path.exists():
        raise FileNotFoundError(f"no {DB_NAME} at {path}: no update was requested on this gateway yet")
    return sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=10)


def _new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(6)


# -- artifacts --------------------------------------------------------------------


def put_artifact(conn: sqlite3.Connection, art: Artifact) -> str:
    """Keep `art` (once: its id is its digest); returns its id.  Drops the
    oldest artifacts no active update uses beyond MAX_ARTIFACTS."""
    now = time.time()
    conn.execute("BEGIN IMMEDIATE")
    try:
        known = conn.execute("SELECT 1 FROM ota_artifacts WHERE id = ?", (art.id,)).fetchone()
        if known is None:
            conn.execute(
                "INSERT INTO ota_artifacts VALUES (?, ?, ?, ?, ?, ?, ?)",
                (art.id, art.version, art.mpy, art.total, json.dumps(art.entries), art.source, now),
            )
            conn.executemany(
                "INSERT INTO ota_files VALUES (?, ?, ?, ?)",
                [(art.id, i, p, d) for i, (p, d) in enumerate(art.files)],
            )
        else:
            conn.execute("UPDATE ota_artifacts SET created_at = ? WHERE id = ?", (now, art.id))
        old = conn.execute(
            f"SELECT id FROM ota_artifacts WHERE id NOT IN (SELECT artifact FROM ota_updates WHERE {_ACTIVE})"  # noqa: S608
            " ORDER BY created_at DESC LIMIT -1 OFFSET ?",
            (MAX_ARTIFACTS,),
        ).fetchall()
        for (aid,) in old:
            conn.execute("DELETE FROM ota_files WHERE artifact = ?", (aid,))
            conn.execute("DELETE FROM ota_artifacts WHERE id = ?", (aid,))
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return art.id


def load_artifact(conn: sqlite3.Connection, aid: str) -> Artifact | None:
    row = conn.execute("SELECT version, mpy, source FROM ota_artifacts WHERE id = ?", (aid,)).fetchone()
    if row is None:
        return None
    files = conn.execute(
        "SELECT path, data FROM ota_files WHERE artifact = ? ORDER BY idx", (aid,)
    ).fetchall()
    return Artifact(row[0], tuple((p, bytes(d)) for p, d in files), row[1], row[2])


# -- requests ---------------------------------------------------------------------


class BoardBusy(Exception):
    """Some boards already have an update in progress (one at a time per board)."""

    def __init__(self, busy: dict[str, tuple[str, str]]) -> None:
        self.busy = busy  # device -> (update id, state)
        listed = ", ".join(f"{d} ({u}: {s})" for d, (u, s) in sorted(busy.items()))
        super().__init__(f"an update is already in progress on {listed}: wait for it, or cancel it first")


@dataclass(frozen=True)
class Requested:
    rollout: str
    updates: dict[str, str]  # device -> update id


def request(
    conn: sqlite3.Connection,
    artifact_id: str,
    waves: list[list[str]],
    *,
    max_failures: int = 0,
    source: str = "cli",
) -> Requested:
    """Queue one update per board, wave by wave (wave 0 is the canary: the
    next wave starts only once every board of the earlier ones finished and
    at most `max_failures` failed).  All or nothing: BoardBusy when any board
    has an active update."""
    devices = [d for w in waves for d in w]
    if len(set(devices)) != len(devices):
        raise ValueError("a device is named twice")
    if not devices or len(devices) > MAX_DEVICES_PER_REQUEST:
        raise ValueError(f"between 1 and {MAX_DEVICES_PER_REQUEST} devices per request")
    now = time.time()
    rollout = _new_id("r")
    conn.execute("BEGIN IMMEDIATE")
    try:
        if conn.execute("SELECT 1 FROM ota_artifacts WHERE id = ?", (artifact_id,)).fetchone() is None:
            raise ValueError(f"no artifact {artifact_id}")  # noqa: TRY301
        marks = ",".join("?" * len(devices))
        busy = conn.execute(
            f"SELECT device, id, state FROM ota_updates WHERE {_ACTIVE} AND device IN ({marks})",  # noqa: S608
            devices,
        ).fetchall()
        if busy:
            raise BoardBusy({d: (u, s) for d, u, s in busy})  # noqa: TRY301
        conn.execute(
            "INSERT INTO ota_rollouts VALUES (?, ?, ?, 'running', '', ?, ?, ?)",
            (rollout, artifact_id, max_failures, source, now, now),
        )
        ids: dict[str, str] = {}
        for wave, members in enumerate(waves):
            for dev in members:
                ids[dev] = uid = _new_id("u")
                conn.execute(
                    "INSERT INTO ota_updates (id, device, artifact, rollout, wave, state, created_at,"
                    " updated_at) VALUES (?, ?, ?, ?, ?, 'queued', ?, ?)",
                    (uid, dev, artifact_id, rollout, wave, now, now),
                )
        _prune(conn)
        conn.execute("COMMIT")
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    return Requested(rollout, ids)


def _prune(conn: sqlite3.Connection) -> None:
    conn.execute(
        f"DELETE FROM ota_updates WHERE id IN (SELECT id FROM ota_updates WHERE NOT ({_ACTIVE})"  # noqa: S608
        " ORDER BY updated_at DESC LIMIT -1 OFFSET ?)",
        (MAX_FINISHED,),
    )
    conn.execute("DELETE FROM ota_rollouts WHERE id NOT IN (SELECT rollout FROM ota_updates)")


def cancel(conn: sqlite3.Connection, devices: list[str] | None) -> int:
    """Ask the agent to abort the active updates of `devices` (all when None):
    a queued one is cancelled at once, a running one when the agent next
    looks (it sends the board an abort)."""
    now = time.time()
    where, params = (
        (_ACTIVE, [])
        if devices is None
        else (
            f"{_ACTIVE} AND device IN ({','.join('?' * len(devices))})",
            list(devices),
        )
    )
    n = conn.execute(
        f"UPDATE ota_updates SET state = 'cancelled', reason = 'cancelled before it started', updated_at = ?"  # noqa: S608
        f" WHERE state = 'queued' AND {where}",
        [now, *params],
    ).rowcount
    n += conn.execute(
        f"UPDATE ota_updates SET cancel = 1 WHERE state != 'queued' AND {where}",  # noqa: S608
        params,
    ).rowcount
    return n


def rows(conn: sqlite3.Connection, *, active_only: bool = False, limit: int = 200) -> list[dict[str, Any]]:
    """Updates, newest first, with their artifact's version and size."""
    sql = (
        "SELECT u.id, u.device, u.state, u.done_bytes, a.total, a.version, u.board_version, u.reason,"
        " u.rollout, u.wave, u.created_at, u.updated_at FROM ota_updates u"
        " LEFT JOIN ota_artifacts a ON a.id = u.artifact"
    )
    if active_only:
        sql += f" WHERE u.{_ACTIVE}"
    keys: tuple[str, ...] = ("id", "device", "state", "done_bytes", "total", "version", "board_version")
    keys += ("reason", "rollout", "wave", "created_at", "updated_at")
    return [
        dict(zip(keys, r, strict=True))
        for r in conn.execute(sql + " ORDER BY u.created_at DESC LIMIT ?", (limit,))
    ]


def rollouts(conn: sqlite3.Connection, ids: list[str]) -> dict[str, tuple[str, str]]:
    marks = ",".join("?" * len(ids))
    found = conn.execute(f"SELECT id, state, reason FROM ota_rollouts WHERE id IN ({marks})", ids)  # noqa: S608
    return {r[0]: (r[1], r[2]) for r in found}
