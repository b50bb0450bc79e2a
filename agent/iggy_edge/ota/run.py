"""One update in progress (`Run`) and the updater's bounds (`Limits`, the
defaults docs/ota.md lists)."""

from __future__ import annotations

from dataclasses import dataclass

from .artifact import MAX_ARTIFACT_BYTES, Artifact
from .protocol import CHUNK_BYTES
from .state import Row


@dataclass(frozen=True)
class Limits:
    max_concurrent: int = 4
    resend_s: float = 5.0
    resend_max_s: float = 60.0
    stall_s: float = 900.0
    switch_s: float = 900.0
    max_bad_chunks: int = 50
    max_offers: int = 30
    reply_queue: int = 1000
    tick_s: float = 0.25
    max_artifact_bytes: int = MAX_ARTIFACT_BYTES


@dataclass
class Run:
    row: Row
    art: Artifact
    state: str
    done_bytes: int
    now: float
    pending: bytes | None = None  # what goes out again on a timeout
    sent_at: float = 0.0  # monotonic; 0: due now
    resends: int = 0
    heard_at: float = 0.0
    phase_since: float = 0.0
    offers: int = 0
    bad: int = 0
    board_version: str | None = None
    saved_at: float = 0.0  # monotonic time progress was last committed
    in_flight: tuple[int, int, int] | None = None  # the chunk sent last: (f, o, bytes)
    chunk_bytes: int = CHUNK_BYTES  # what the board takes in one chunk (its need's "n")

    def __post_init__(self) -> None:
        self.heard_at = self.phase_since = self.now

    @property
    def uid(self) -> str:
        return self.row.id
