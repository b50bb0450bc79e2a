"""Telling a failing disk from a damaged file: SQLite's error code, and
``PRAGMA integrity_check`` before anything is moved (see the package
docstring)."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from ..db import StoreError

CORRUPT: Final = frozenset({sqlite3.SQLITE_CORRUPT, sqlite3.SQLITE_NOTADB})
LOCKED: Final = frozenset({sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED})
# The disk or the system, not the file: wait and try again.
TRANSIENT: Final = frozenset(
    {
        sqlite3.SQLITE_FULL,
        sqlite3.SQLITE_IOERR,
        sqlite3.SQLITE_CANTOPEN,
        sqlite3.SQLITE_NOMEM,
        sqlite3.SQLITE_READONLY,  # e.g. the kernel remounted a failing SD card read-only
        sqlite3.SQLITE_PROTOCOL,
        sqlite3.SQLITE_INTERRUPT,
    }
)


class StoreUnavailable(StoreError):
    """The disk or the system failed (full, I/O error, cannot open): the
    buffer file is intact as far as we know and stays in place; try again."""


def primary_code(e: BaseException) -> int | None:
    code = getattr(e, "sqlite_errorcode", None)
    return None if code is None else int(code) & 0xFF


def is_corruption(e: BaseException) -> bool:
    return primary_code(e) in CORRUPT


def as_store_error(path: Path, e: BaseException) -> StoreError:
    """The StoreError for a failure that is not a confirmed corruption."""
    code = primary_code(e)
    name = getattr(e, "sqlite_errorname", type(e).__name__)
    if code in LOCKED:
        return StoreError(f"{path}: database is locked by another process ({name})")
    if isinstance(e, OSError) or code in TRANSIENT:
        return StoreUnavailable(f"{path}: {e} ({name}); the file is left in place")
    # anything else (a schema this version does not know, a misuse): retrying will not help
    return StoreError(f"{path}: {e} ({name}); the file is left in place")


def integrity_problem(path: Path) -> str | None:
    """None when `PRAGMA integrity_check` says ok; otherwise what it said (or
    the corruption error it raised).  Raises the error when it is not a
    corruption (a full or failing disk says nothing about the file)."""
    try:
        conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=5)
        try:
            rows = conn.execute("PRAGMA integrity_check(20)").fetchall()
        finally:
            conn.close()
    except sqlite3.DatabaseError as e:
        if is_corruption(e):
            return str(e)
        raise
    lines = [str(r[0]) for r in rows]
    return None if lines == ["ok"] else "; ".join(lines)
