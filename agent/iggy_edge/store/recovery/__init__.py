"""What to do when the buffer file cannot be opened or read.

The package, by job: `errors` (a failing disk or a damaged file, by
SQLite's error code and integrity_check), `wal` (the WAL header check),
`salvage` (copying what is readable into a fresh file), `events` (what
happened, kept in meta until acknowledged) and `opening` (the one place
that decides, at open and at load, which of them applies).

* **Classify by SQLite's error code** (``sqlite_errorcode``, primary code in
  the low byte), not by message: ``SQLITE_CORRUPT`` / ``SQLITE_NOTADB`` may be
  a damaged file; ``SQLITE_FULL``, ``SQLITE_IOERR``, ``SQLITE_CANTOPEN``,
  ``SQLITE_READONLY``, ``SQLITE_NOMEM`` and any ``OSError`` are the disk or the
  system, not the file: the file stays where it is (`StoreUnavailable`), the
  agent reports ``store=failed``, acknowledges nothing (the broker keeps the
  messages) and tries again.  ``SQLITE_BUSY`` / ``SQLITE_LOCKED``: another
  process holds the file (`StoreError` "locked").  Anything else (a schema
  this version does not know): `StoreError`, the file stays, the agent exits
  non-zero.
* **Only a confirmed corruption moves a file aside**: a corruption code AND
  ``PRAGMA integrity_check`` not "ok" on a separate connection.  The file (and
  its -wal / -shm) is renamed ``<name>.corrupt-<time>``, a fresh buffer is
  created and everything readable is **salvaged** into it: outbox rows by seq
  ranges, bisected down to single rows around damaged pages, inserted with
  their seq and the old epoch, so the message ids (gateway, epoch, seq) and
  the order stay; the sequence continues after the old one so no id is
  reused.  Rows whose route cannot be read become dead letters (reason
  ``salvaged``; `buffer dead-letters replay` routes them again).
  "Unreadable" counts the seqs inside the old outbox's range that could not
  be read (an upper bound: a seq deleted before the damage is counted too).
* **WAL header check** before SQLite opens the file: magic, format version,
  page size and the header checksum (which covers the salts), per the SQLite
  file format.  SQLite silently ignores a WAL whose header is invalid -- and
  with it every commit not yet checkpointed -- so a damaged header is copied
  aside (``<name>-wal.damaged-<time>``) and logged with the number of frames
  that may be lost.
* Every such event is kept in the meta table (key ``recovery``, a JSON list)
  and counted in metrics; health shows it until an operator runs
  ``iggy-edge buffer ack-salvage``.
"""

from __future__ import annotations

from .errors import StoreUnavailable, as_store_error, is_corruption
from .events import Event, acknowledge, events_from_json, read_events
from .opening import open_database, open_loaded

__all__ = [
    "Event",
    "StoreUnavailable",
    "acknowledge",
    "as_store_error",
    "events_from_json",
    "is_corruption",
    "open_database",
    "open_loaded",
    "read_events",
]
