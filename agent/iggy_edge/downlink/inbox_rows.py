"""What the inbox (inbox.py) hands out and raises: the rows the deliverer
publishes, what one poll's transaction stored, what an ack batch did, and
the errors that name one bad item of a poll (the cloud side's input is
untrusted: one item SQLite cannot take is refused by name, and nothing of
its batch is stored)."""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from typing import Final

from .commands import CommandState
from .inbox_schema import RECEIVED


@dataclass(frozen=True, slots=True)
class PendingCommand:
    seq: int
    id: str
    device: str
    payload: bytes
    expires_at: float


@dataclass(frozen=True, slots=True)
class PendingConfig:
    device: str
    id: str
    payload: bytes
    state: str = RECEIVED  # RECEIVED (new) or REPUBLISH (a restore)


# What the insert of one row can raise because of the row itself (a value
# SQLite cannot take: an unencodable string, an integer beyond 64 bits, a
# constraint).  Anything else -- OperationalError (disk full, I/O, locked),
# DatabaseError (a damaged file) -- is the environment's fault and propagates.
# (Not ValueError at the execute: aiosqlite raises it for a closed connection.)
ROW_ERRORS: Final = (
    sqlite3.InterfaceError,
    sqlite3.ProgrammingError,
    sqlite3.IntegrityError,
    sqlite3.DataError,
    OverflowError,
    UnicodeError,
)
# What encoding one item's device payload can raise because of its values.
ENCODE_ERRORS: Final = (ValueError, TypeError, RecursionError, OverflowError, UnicodeError)


class RowRefused(Exception):
    """One item of a `store_polled` call could not be inserted; the whole
    transaction was rolled back (nothing stored, the offset not advanced)."""

    def __init__(self, kind: str, index: int, error: BaseException) -> None:
        super().__init__(f"{kind} {index}: {type(error).__name__}: {error}")
        self.kind = kind  # "command" or "config"
        self.index = index  # its position in the list given
        self.error = error


@dataclass(frozen=True, slots=True)
class AckResult:
    done: list[tuple[str, CommandState]]  # (command id, new state)
    wrong_device: list[tuple[int, str]]  # (index of the ack, the device the command is for)


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """What one `store_polled` transaction did."""

    new: int  # commands inserted
    expired: int  # of those, already expired on arrival
    duplicates: int  # ids already in the inbox (not delivered again)
    configs: int  # config rows replaced
