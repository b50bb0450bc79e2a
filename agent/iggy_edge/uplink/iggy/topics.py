"""Partition counts of known topics, and creating the missing ones.

Topic creation has two wire paths.  SDK 0.9.0's `create_topic` always sends
the ``durability`` and ``consumer_offset_durability`` option keys, which
server 0.9.0-edge.5 does not know: it refuses every create with "Unsupported
option key".  We ask for ``Durability.PERSISTED`` first (a server that knows
the keys gets them) and on that refusal send CREATE_TOPIC ourselves
(`encode_create_topic`) with the edge.5 options that mean the same:
``enforce_fsync=true`` and ``messages_required_to_save=1``.  The server
answers a send after committing it, and a commit writes the partition's
in-memory journal to its segment only once that many messages are waiting
(default 1024, without fsync): with the defaults, 50 confirmed messages were
gone after a SIGKILL; with ours, every confirmed message survived.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterable
from typing import Final

from apache_iggy import Durability, IggyClient, TopicDetails

from ..protocol import UplinkRejected
from .connection import Connection
from .errors import is_already_exists, is_not_found, is_unauthorized, is_unsupported_option
from .wire import encode_identifier, encode_string_entry

log = logging.getLogger(__name__)

CREATE_TOPIC_CODE: Final = 302
# Topic options (server 0.9.0-edge.5 catalog, `describe_options("topic")`)
# that make a send's confirmation mean "on disk": the server answers a send
# after committing it, and a commit flushes the partition's in-memory journal
# to its segment only once `messages_required_to_save` messages are waiting
# (default 1024) and fsyncs only with `enforce_fsync` (default false).
PERSIST_OPTIONS: Final = (("enforce_fsync", "true"), ("messages_required_to_save", "1"))


def encode_create_topic(
    stream: str, topic: str, partitions: int, options: Iterable[tuple[str, str]] = ()
) -> bytes:
    """Payload of CREATE_TOPIC (binary protocol 0.9): stream identifier,
    partitions count u32 LE, name (length u8 + bytes), then the options block:
    entries of key kind u8, key length u32 LE, key, value kind u8, value
    length u32 LE, value (the user-header codec), string-typed here -- the
    server parses string values of every catalog key."""
    name = topic.encode()
    if not 1 <= len(name) <= 255:
        raise ValueError(f"topic name must be 1-255 bytes: {topic!r}")
    return (
        encode_identifier(stream)
        + struct.pack("<I", partitions)
        + bytes((len(name),))
        + name
        + b"".join(encode_string_entry(k, v) for k, v in options)
    )


async def get_topic(
    conn: Connection, client: IggyClient, stream: str, topic: str, confirmed: frozenset[int] = frozenset()
) -> TopicDetails | None:
    """The topic's details, or None when it (or its stream) does not exist."""
    try:
        return await conn.call(
            f"get topic {stream}/{topic}", client.get_topic(stream, topic), confirmed=confirmed
        )
    except UplinkRejected as e:
        if is_not_found(e):  # the stream is missing: same as no topic
            return None
        raise


class Topics:
    """Partition counts of known topics; creates missing ones when allowed.

    A user allowed to send to a topic but not to read its details (what
    `iggy-edge cloud provision-gateway` gives a gateway for the shared
    telemetry topics, so a leaked gateway credential cannot read the fleet's
    telemetry) gets "Unauthorized" for the look: the count is then
    ``iggy.partitions``, the contract `partition_for` already relies on, and a
    send to a partition the topic lacks is refused by the server."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._counts: dict[tuple[str, str], int] = {}

    def forget(self, stream: str, topic: str) -> None:
        self._counts.pop((stream, topic), None)

    async def partitions(self, stream: str, topic: str, *, confirmed: frozenset[int] = frozenset()) -> int:
        count = self._counts.get((stream, topic))
        if count is not None:
            return count
        conn = self._conn
        client = await conn.client()
        try:
            details = await get_topic(conn, client, stream, topic, confirmed)
        except UplinkRejected as e:
            if not is_unauthorized(e):
                raise
            count = conn.settings.partitions
            log.info(
                "iggy: %s may send to %s/%s but not read its details (%s): taking iggy.partitions = %d",
                conn.settings.username,
                stream,
                topic,
                e,
                count,
            )
            self._counts[(stream, topic)] = count
            return count
        if details is None:
            if not conn.settings.create_missing:
                raise UplinkRejected(
                    f"iggy: topic {stream}/{topic} does not exist and create_missing is off",
                    confirmed=confirmed,
                )
            await create_topic(conn, client, stream, topic, conn.settings.partitions, confirmed)
            details = await get_topic(conn, client, stream, topic, confirmed)
            if details is None:
                raise UplinkRejected(
                    f"iggy: topic {stream}/{topic} still missing after creating it",
                    confirmed=confirmed,
                )
        self._counts[(stream, topic)] = details.partitions_count
        if details.partitions_count != conn.settings.partitions:
            log.info(
                "iggy topic %s/%s has %d partitions (settings say %d); using the server's",
                stream,
                topic,
                details.partitions_count,
                conn.settings.partitions,
            )
        return details.partitions_count


async def create_stream(conn: Connection, client: IggyClient, stream: str, confirmed: frozenset[int]) -> bool:
    """Create `stream` unless it exists; whether it was created."""
    try:
        await conn.call(f"create stream {stream}", client.create_stream(stream), confirmed=confirmed)
    except UplinkRejected as e:
        if not is_already_exists(e):
            raise
        return False
    log.info("iggy: created stream %s", stream)
    return True


async def create_topic(
    conn: Connection,
    client: IggyClient,
    stream: str,
    topic: str,
    partitions: int,
    confirmed: frozenset[int] = frozenset(),
) -> bool:
    """Create the stream (if needed) and the topic; whether the topic was created.

    Topics get `partitions` partitions and ``Durability.PERSISTED``: the
    forwarder deletes a record from the outbox as soon as Iggy confirms it,
    so a confirmation must mean the message is on stable storage, not only in
    the server's memory (the 0.9 default, REPLICATED, confirms after an
    in-memory quorum commit and a server crash can lose it); the return path
    consumes a command's offset once it is in SQLite, so the same holds for
    it.  The cost is an fsync per request, which batching amortises.  Message
    expiry, maximum size and compression are left to the server defaults --
    retention is the cloud side's decision.  Consumer offsets keep the
    default durability: our offsets live in SQLite, the server copy is a
    best-effort mirror.
    """
    await create_stream(conn, client, stream, confirmed)
    what = f"create topic {stream}/{topic}"
    try:
        try:
            await conn.call(
                what,
                client.create_topic(stream, topic, partitions, durability=Durability.PERSISTED),
                confirmed=confirmed,
            )
            how = "durability persisted"
        except UplinkRejected as e:
            if not is_unsupported_option(e):
                raise
            # Server 0.9.0-edge.5 predates the durability keys SDK 0.9.0
            # always sends (it answers "Unsupported option key").  Ask it
            # for the same guarantee in its own terms, by a raw request.
            await conn.call(
                what,
                client.send_binary_request(
                    CREATE_TOPIC_CODE, encode_create_topic(stream, topic, partitions, PERSIST_OPTIONS)
                ),
                confirmed=confirmed,
            )
            how = "enforce_fsync, messages_required_to_save=1"
    except UplinkRejected as e:
        if not is_already_exists(e):
            raise
        return False
    log.info("iggy: created topic %s/%s with %d partitions (%s)", stream, topic, partitions, how)
    return True
