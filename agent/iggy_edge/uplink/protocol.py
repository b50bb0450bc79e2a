"""Interfaces at the Iggy boundary.

Two directions on separate connections (Iggy handles one request at a time
per connection):

* `Uplink` carries outbox batches to Iggy; a `LanedUplink` sends to several
  partitions side by side, one connection per lane (issue 14).
* `CommandSource` polls the command/config topics for the return path and
  mirrors the agent's read offsets to the server.

Every call is bounded in time by the implementation; a call that cannot
complete raises an `UplinkError` subclass, never hangs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from ..records import OutboundRecord


class UplinkError(Exception):
    """A send or poll did not (wholly) succeed.

    `confirmed` lists the outbox seqs that Iggy did confirm before the failure
    (a batch spanning several partitions is sent as several requests); the
    forwarder deletes those and retries the rest.
    """

    def __init__(self, message: str, *, confirmed: frozenset[int] = frozenset()) -> None:
        super().__init__(message)
        self.confirmed = confirmed


class UplinkUnavailable(UplinkError):
    """Nothing left the agent (not connected, login failed, refused): a retry
    cannot create a duplicate."""


class UplinkAmbiguous(UplinkError):
    """The request left but no answer came in time: Iggy may or may not have
    stored it.  A retry can store a second copy (with the same message ids)."""


class UplinkRejected(UplinkError):
    """The server answered with an error that a retry will not fix (for
    example a missing stream when creation is disabled, or no permission)."""


class Uplink(Protocol):
    async def start(self) -> None:
        """Connect, log in and make sure configured streams/topics exist.
        Raises UplinkError when the server cannot be reached in time."""

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        """Send records in order.  Returns only when Iggy confirmed all of
        them; otherwise raises UplinkError with `confirmed` set to what was
        confirmed.  Records with the same (stream, topic, key) are never
        split so that a later one is confirmed while an earlier one is not."""

    async def close(self) -> None: ...


# A lane of a `LanedUplink`: one partition of one topic, (stream, topic, partition).
Lane = tuple[str, str, int]


@runtime_checkable
class LanedUplink(Uplink, Protocol):
    """An `Uplink` whose requests can run side by side, one lane each.

    A lane is one partition: per lane the forwarder keeps one request in
    flight and sends in outbox order, so per key (a key maps to one
    partition) records reach Iggy in ingest order; different lanes run in
    parallel (each on its own connection, where the server answers one
    request at a time per connection) and confirm in any order.
    """

    async def lanes(self, batch: Sequence[OutboundRecord]) -> list[tuple[Lane, list[OutboundRecord]]]:
        """`batch` split by lane, each part in batch order, lanes in order of
        first appearance.  May look up (or create) topics: raises
        UplinkError when that fails."""

    async def send_lane(self, lane: Lane, records: Sequence[OutboundRecord]) -> None:
        """Send `records` (all of one lane, in order) as one request, all or
        nothing: returns once Iggy confirmed them, else raises UplinkError
        (with nothing `confirmed`)."""


@dataclass(frozen=True, slots=True)
class PolledMessage:
    """One message read from an Iggy partition by the return path."""

    offset: int
    message_id: int
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)
    timestamp_us: int = 0


class CommandSource(Protocol):
    async def start(self) -> None: ...

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        """Messages at `offset` and after (at most `count`), in offset order."""

    async def last_offsets(self, stream: str, topic: str) -> dict[int, int] | None:
        """Per partition id, the offset of its newest message (-1 when it has
        none), all partitions in one request; None when the topic is not
        there (polling it says why).  The return poll asks this between
        polls so that it polls only partitions with something new."""

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        """Tell the server the agent's consumer has consumed up to and
        including `offset` (so the cloud side can see progress).  SQLite stays
        the source of truth; this is best effort."""

    async def close(self) -> None: ...
