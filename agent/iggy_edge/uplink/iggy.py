"""Uplink, command source and command sink over the apache-iggy SDK (0.9).

Facts about SDK 0.9.0 / server 0.9.0-edge.5 this module is built on.  They
were read from the sources first and then checked against a real server:
tests/test_uplink_iggy.py holds the real-server tests (marked ``iggy``; they
skip when `iggy-server` is not on PATH).

Connection
    We build a `TcpConfig` rather than a connection string: the string form
    (``iggy+tcp://user:pass@host:port?tls=true&tls_domain=..&tls_ca_file=..``)
    is split on ``@``, ``:`` and ``&`` with no percent-decoding, so a password
    containing one of them cannot be expressed.  `TcpConfig` takes
    ``tls_enabled``, ``tls_domain`` (None or empty = taken from the address)
    and ``tls_ca_file``; the certificate is validated by default (no CA file
    means the system roots).  A failed TLS handshake (unknown CA, wrong name)
    and plain TCP against a TLS port look like a down server ("Cannot
    establish connection" / "Disconnected"); a missing CA file is "Invalid
    TLS certificate path".

Bounded calls
    By default the SDK reconnects forever, and with auto-login it *replays the
    request* after reconnecting, under a new session -- a send could be stored
    twice without us knowing.  We therefore turn auto-login off (we log in
    ourselves), turn SDK reconnection off entirely, and wrap every call in
    `asyncio.wait_for`.  ``max_retries=0`` is not enough: the SDK still makes
    one redial inside the awaited request, after the ``reestablish_after``
    cooldown (5 s), so a send to a stopped server hung for 5 s and then said
    "Cannot establish connection" although it may have been written.  With
    reconnection off it fails at once with "Disconnected".  After any
    failure other than a server answer the client is dropped and the next
    call builds a fresh one.  One client per direction (uplink, command
    source, sink): the server handles one request at a time per connection.
    A connected client still referenced at interpreter exit can abort the
    process (SIGABRT, SDK 0.9.0), so `close()` logs out and lets go of it.

Errors
    Every SDK error is a `RuntimeError` whose text is the server's or the
    client's `IggyError` message; over the binary protocol only the error
    *code* comes back, so names inside the text are empty ("Stream with name:
    already exists.", "Resource with key:  was not found." for a send to a
    missing stream, topic or partition).  `classify` maps those texts to
    UplinkUnavailable (nothing was stored: cannot connect, unauthenticated,
    invalid credentials, not accepted), UplinkAmbiguous (the request may have
    been written: ``Disconnected`` -- what a lost connection gives --,
    ``Connection closed``, a timeout, "transiently not committed") and
    UplinkRejected (the server answered with an error a retry will not fix).
    "already exists" and "not found" are recognised by their text.  A
    `ValueError` comes from SendMessage itself (empty payload, empty header
    value) and never reaches the server.

Topic creation
    SDK 0.9.0's `create_topic` always sends the ``durability`` and
    ``consumer_offset_durability`` option keys, which server 0.9.0-edge.5 does
    not know: it refuses every create with "Unsupported option key".  We ask
    for ``Durability.PERSISTED`` first (a server that knows the keys gets
    them) and on that refusal send CREATE_TOPIC ourselves with the edge.5
    options that mean the same: ``enforce_fsync=true`` and
    ``messages_required_to_save=1``.  The server answers a send after
    committing it, and a commit writes the partition's in-memory journal to
    its segment only once that many messages are waiting (default 1024,
    without fsync): with the defaults, 50 confirmed messages were gone after a
    SIGKILL; with ours, every confirmed message survived.

Timestamps
    `SendMessage(...)` stamps the message's origin timestamp with the current
    time when it is constructed, and a batch stores each message as a u32
    microsecond delta from the batch's first origin timestamp (~71 minutes).
    We build the `SendMessage` objects immediately before the request, so a
    request spans milliseconds regardless of how old the records are.  The
    real event time travels in the ``received-at-us`` header.  On poll,
    ``timestamp()`` is the server's append time (what `PolledMessage` carries).

Offsets
    The Python SDK has no ``store_consumer_offset`` / ``get_consumer_offset``,
    and the consumer-group route does not work on edge.5: the server fences
    a group offset commit to a member that currently owns the partition, so a
    group consumer that never joins gets "Resource with key:  was not found."
    We send STORE_CONSUMER_OFFSET (121) and GET_CONSUMER_OFFSET (120) raw,
    for the single consumer ``consumer_name`` (``iggy-edge-<gateway>``) --
    the same consumer our polls name.  The server hashes a named consumer to
    a stable id, keeps one offset per partition, lets it move backwards (our
    SQLite offset is the truth) and refuses one beyond the partition's last
    offset ("Invalid offset").  A ``PollingStrategy.Next`` poll by that
    consumer resumes at the stored offset + 1, which is what the cloud side
    sees.  Our own polls use explicit offsets and no auto-commit, so polling
    stores nothing.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import struct
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final, TypeVar

from apache_iggy import (
    AutoLogin,
    Consumer,
    Durability,
    IggyClient,
    PollingStrategy,
    ReceiveMessage,
    SendMessage,
    TcpConfig,
    TcpReconnectionConfig,
    TopicDetails,
)

from ..config import IggySettings
from ..records import OutboundRecord
from .partition import KeyPartitioner, by_topic, record_problem, wire_headers
from .protocol import (
    PolledMessage,
    UplinkAmbiguous,
    UplinkError,
    UplinkRejected,
    UplinkUnavailable,
)

log = logging.getLogger(__name__)

# An apache-iggy 0.9 client left in a reference cycle is freed only during
# interpreter finalization, and freeing it then aborts the process (SIGABRT,
# about 1 run in 10 of a one-shot CLI command here, after its work was done).
# Collecting before finalization frees it while the runtime is still whole:
# 0 aborts in 60 runs (see the commit that added this).
atexit.register(gc.collect)

T = TypeVar("T")

# Builds the SDK client from its config; tests substitute a fake.
ClientFactory = Callable[[TcpConfig], IggyClient]

GET_CONSUMER_OFFSET_CODE: Final = 120
STORE_CONSUMER_OFFSET_CODE: Final = 121
CREATE_TOPIC_CODE: Final = 302
_HEADER_STRING_KIND: Final = 2
# Topic options (server 0.9.0-edge.5 catalog, `describe_options("topic")`)
# that make a send's confirmation mean "on disk": the server answers a send
# after committing it, and a commit flushes the partition's in-memory journal
# to its segment only once `messages_required_to_save` messages are waiting
# (default 1024) and fsyncs only with `enforce_fsync` (default false).
_PERSIST_OPTIONS: Final = (("enforce_fsync", "true"), ("messages_required_to_save", "1"))
_CONSUMER_KIND: Final = 1  # a single consumer (2 would be a consumer group)
_ACK_QUORUM: Final = 1
_IDENTIFIER_STRING_KIND: Final = 2

# Texts of IggyError variants (core/common/src/error/iggy_error.rs), lower case.
# Checked in this order; the first list wins.
_NOTHING_LEFT: Final = (
    "not connected",
    "cannot establish connection",
    "client shutdown",
    "unauthenticated",
    "invalid credentials",
    "stale client",
    "transiently not accepted",
)
_MAYBE_LEFT: Final = (
    "disconnected",
    "connection closed",
    "tcp error",
    "empty response",
    "transiently not committed",
    "timeout",
)


def classify(error: BaseException) -> type[UplinkError]:
    """Which UplinkError an SDK failure amounts to (by its message text)."""
    if isinstance(error, TimeoutError):
        return UplinkAmbiguous
    if isinstance(error, OSError):
        return UplinkUnavailable
    text = str(error).lower()
    if any(t in text for t in _NOTHING_LEFT):
        return UplinkUnavailable
    if any(t in text for t in _MAYBE_LEFT):
        return UplinkAmbiguous
    return UplinkRejected


def is_already_exists(error: BaseException) -> bool:
    return "already exists" in str(error).lower()


def is_not_found(error: BaseException) -> bool:
    return "not found" in str(error).lower()


def is_unsupported_option(error: BaseException) -> bool:
    return "unsupported option key" in str(error).lower()


class _Connection:
    """One logged-in SDK client, rebuilt after any failure.

    Every call goes through `call`, bounded by `request_timeout_s`; `client`
    connects and logs in within `connect_timeout_s`.
    """

    def __init__(
        self, settings: IggySettings, role: str, client_factory: ClientFactory | None = None
    ) -> None:
        self.settings = settings
        self.role = role
        self._factory: ClientFactory = client_factory or IggyClient
        self._client: IggyClient | None = None
        self._lock = asyncio.Lock()
        # Bumped whenever a client is dropped, so objects built on the old
        # client (consumer-group consumers) know to rebuild.
        self.generation = 0

    def _tcp_config(self) -> TcpConfig:
        s = self.settings
        return TcpConfig(
            server_address=s.address,
            auto_login=AutoLogin.disabled(),
            # No SDK reconnection at all: a lost connection fails the request
            # at once ("Disconnected") and we build a fresh client on the next
            # call.  Checked against server 0.9.0-edge.5: even with
            # max_retries=0 the SDK first waits out `reestablish_after` (5 s)
            # inside the awaited request, then redials and would re-send the
            # request on a new, unauthenticated session.
            reconnection=TcpReconnectionConfig(enabled=False),
            tls_enabled=s.tls,
            tls_domain=s.tls_domain,
            tls_ca_file=str(s.tls_ca_file) if s.tls_ca_file is not None else None,
            nodelay=True,
        )

    async def client(self) -> IggyClient:
        if self._client is not None:
            return self._client
        async with self._lock:
            if self._client is not None:
                return self._client
            s = self.settings
            password = s.password.get_secret_value() if s.password is not None else ""
            try:
                client = self._factory(self._tcp_config())
            except (ValueError, RuntimeError) as e:
                raise UplinkRejected(f"iggy {self.role}: bad connection settings: {e}") from e
            deadline = time.monotonic() + s.connect_timeout_s
            try:
                await asyncio.wait_for(client.connect(), s.connect_timeout_s)
                remaining = max(0.001, deadline - time.monotonic())
                await asyncio.wait_for(client.login_user(s.username, password), remaining)
            except TimeoutError as e:
                raise UplinkUnavailable(
                    f"iggy {self.role}: no connection to {s.address} within {s.connect_timeout_s}s"
                ) from e
            except (RuntimeError, OSError) as e:
                raise UplinkUnavailable(
                    f"iggy {self.role}: cannot connect/log in to {s.address} as {s.username!r}: {e}"
                ) from e
            log.info("iggy %s connected to %s as %s", self.role, s.address, s.username)
            self._client = client
            return client

    def drop(self) -> None:
        """Forget the client; its connection closes when the object is freed
        (dropping it also stops its heartbeat task)."""
        if self._client is not None:
            self._client = None
            self.generation += 1

    async def call(
        self,
        what: str,
        awaitable: Awaitable[T],
        *,
        confirmed: frozenset[int] = frozenset(),
        timeout: float | None = None,
    ) -> T:
        """Await one SDK call, bounded; map failures to UplinkError and drop
        the client so the next call reconnects."""
        timeout = self.settings.request_timeout_s if timeout is None else timeout
        try:
            return await asyncio.wait_for(awaitable, timeout)
        except TimeoutError as e:
            self.drop()
            raise UplinkAmbiguous(
                f"iggy {self.role}: {what}: no answer within {timeout}s", confirmed=confirmed
            ) from e
        except (RuntimeError, OSError) as e:
            kind = classify(e)
            if kind is not UplinkRejected:
                self.drop()
            raise kind(f"iggy {self.role}: {what}: {e}", confirmed=confirmed) from e

    async def close(self) -> None:
        client, self._client = self._client, None
        self.generation += 1
        if client is not None:
            try:
                await asyncio.wait_for(client.logout_user(), 1.0)
            except (RuntimeError, OSError, TimeoutError) as e:
                log.debug("iggy %s logout on close failed: %s", self.role, e)


class _Topics:
    """Partition counts of known topics; creates missing ones when allowed."""

    def __init__(self, conn: _Connection) -> None:
        self._conn = conn
        self._counts: dict[tuple[str, str], int] = {}

    def forget(self, stream: str, topic: str) -> None:
        self._counts.pop((stream, topic), None)

    def clear(self) -> None:
        self._counts.clear()

    async def partitions(self, stream: str, topic: str, *, confirmed: frozenset[int] = frozenset()) -> int:
        count = self._counts.get((stream, topic))
        if count is not None:
            return count
        conn = self._conn
        client = await conn.client()
        details = await self._get(client, stream, topic, confirmed)
        if details is None:
            if not conn.settings.create_missing:
                raise UplinkRejected(
                    f"iggy: topic {stream}/{topic} does not exist and create_missing is off",
                    confirmed=confirmed,
                )
            await self._create(client, stream, topic, confirmed)
            details = await self._get(client, stream, topic, confirmed)
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

    async def _get(
        self, client: IggyClient, stream: str, topic: str, confirmed: frozenset[int]
    ) -> TopicDetails | None:
        try:
            return await self._conn.call(
                f"get topic {stream}/{topic}", client.get_topic(stream, topic), confirmed=confirmed
            )
        except UplinkRejected as e:
            if is_not_found(e):  # the stream is missing: same as no topic
                return None
            raise

    async def _create(self, client: IggyClient, stream: str, topic: str, confirmed: frozenset[int]) -> None:
        """Create the stream (if needed) and the topic.

        Topics get ``settings.partitions`` partitions and
        ``Durability.PERSISTED``: the forwarder deletes a record from the
        outbox as soon as Iggy confirms it, so a confirmation must mean the
        message is on stable storage, not only in the server's memory (the
        0.9 default, REPLICATED, confirms after an in-memory quorum commit and
        a server crash can lose it).  The cost is an fsync per request, which
        batching amortises.  Message expiry, maximum size and compression are
        left to the server defaults -- retention is the cloud side's decision.
        Consumer offsets keep the default durability: our offsets live in
        SQLite, the server copy is a best-effort mirror.
        """
        conn = self._conn
        try:
            await conn.call(f"create stream {stream}", client.create_stream(stream), confirmed=confirmed)
            log.info("iggy: created stream %s", stream)
        except UplinkRejected as e:
            if not is_already_exists(e):
                raise
        what = f"create topic {stream}/{topic}"
        partitions = conn.settings.partitions
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
                        CREATE_TOPIC_CODE, encode_create_topic(stream, topic, partitions, _PERSIST_OPTIONS)
                    ),
                    confirmed=confirmed,
                )
                how = "enforce_fsync, messages_required_to_save=1"
            log.info("iggy: created topic %s/%s with %d partitions (%s)", stream, topic, partitions, how)
        except UplinkRejected as e:
            if not is_already_exists(e):
                raise


def _to_send_message(record: OutboundRecord) -> SendMessage:
    return SendMessage(record.payload, wire_headers(record.headers), record.message_id)


class IggyUplink:
    """`Uplink` over a real Iggy server.

    `send` groups the batch by (stream, topic, partition) in order of first
    appearance, the partition being `partition_for(key, partition count)`
    (see partition.py), and sends each group as one request with an explicit
    partition id.  A group is all-or-nothing, and all records of one key are
    in one group, so a key is never split.  Groups are sent one after the
    other; the first failure stops the batch and is raised with `confirmed`
    holding the seqs of the groups sent before it.
    """

    def __init__(
        self,
        settings: IggySettings,
        gateway_id: str,
        *,
        topics: Iterable[tuple[str, str]] = (),
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self._conn = _Connection(settings, "uplink", client_factory)
        self._topics = _Topics(self._conn)
        self._wanted = tuple(dict.fromkeys(topics))
        self._partitioner = KeyPartitioner()

    async def start(self) -> None:
        """Connect and log in (within connect_timeout_s) and make sure the
        configured topics exist (creating them if create_missing)."""
        await self._conn.client()
        for stream, topic in self._wanted:
            await self._topics.partitions(stream, topic)

    async def send(self, batch: Sequence[OutboundRecord]) -> None:
        if not batch:
            return
        confirmed: list[int] = []
        for (stream, topic), records in by_topic(batch).items():
            done = frozenset(confirmed)
            count = await self._topics.partitions(stream, topic, confirmed=done)
            for partition, group in self._partitioner.split(stream, topic, count, records):
                await self._send_group(stream, topic, partition, group, frozenset(confirmed))
                confirmed.extend(r.seq for r in group)

    async def _send_group(
        self,
        stream: str,
        topic: str,
        partition: int,
        group: list[OutboundRecord],
        confirmed: frozenset[int],
    ) -> None:
        try:
            messages = [_to_send_message(r) for r in group]
        except ValueError as e:
            bad = [(r.seq, p) for r in group if (p := record_problem(r)) is not None]
            raise UplinkRejected(
                f"iggy: records Iggy cannot carry in {stream}/{topic}: {bad or e}",
                confirmed=confirmed,
            ) from e
        client = await self._conn.client()
        what = f"send {len(group)} to {stream}/{topic}/{partition}"
        try:
            await self._conn.call(
                what,
                client.send_messages(stream, topic, partition, messages),
                confirmed=confirmed,
            )
        except UplinkRejected as e:
            if is_not_found(e) and self.settings.create_missing:
                # The topic (or partition) went away under us: look it up
                # again, and create it, on the next attempt.
                self._topics.forget(stream, topic)
                raise UplinkUnavailable(str(e), confirmed=confirmed) from e
            raise

    async def close(self) -> None:
        await self._conn.close()


def _headers_of(message: ReceiveMessage) -> dict[str, str]:
    raw = message.user_headers()
    if not raw:
        return {}
    out: dict[str, str] = {}
    for k, v in raw.to_scalar_dict().items():
        key = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
        if isinstance(v, bytes):
            out[key] = v.decode(errors="replace")
        else:
            out[key] = str(v)
    return out


def _encode_identifier(name: str) -> bytes:
    raw = name.encode()
    if not 1 <= len(raw) <= 255:
        raise ValueError(f"identifier must be 1-255 bytes: {name!r}")
    return bytes((_IDENTIFIER_STRING_KIND, len(raw))) + raw


def _encode_option(key: str, value: str) -> bytes:
    k, v = key.encode(), value.encode()
    return (
        bytes((_HEADER_STRING_KIND,))
        + struct.pack("<I", len(k))
        + k
        + bytes((_HEADER_STRING_KIND,))
        + struct.pack("<I", len(v))
        + v
    )


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
        _encode_identifier(stream)
        + struct.pack("<I", partitions)
        + bytes((len(name),))
        + name
        + b"".join(_encode_option(k, v) for k, v in options)
    )


def encode_get_consumer_offset(consumer: str, stream: str, topic: str, partition_id: int) -> bytes:
    """Payload of GET_CONSUMER_OFFSET (binary protocol 0.9): consumer kind u8
    (1 = single consumer) and identifier, stream and topic identifiers (kind
    u8, length u8, bytes), then a partition flag u8 and the partition id u32
    little-endian."""
    return (
        bytes((_CONSUMER_KIND,))
        + _encode_identifier(consumer)
        + _encode_identifier(stream)
        + _encode_identifier(topic)
        + struct.pack("<BI", 1, partition_id)
    )


def encode_store_consumer_offset(
    consumer: str, stream: str, topic: str, partition_id: int, offset: int
) -> bytes:
    """Payload of STORE_CONSUMER_OFFSET: the GET_CONSUMER_OFFSET payload, then
    the offset u64 and the ack level u8 (1 = quorum) little-endian."""
    return encode_get_consumer_offset(consumer, stream, topic, partition_id) + struct.pack(
        "<QB", offset, _ACK_QUORUM
    )


def decode_consumer_offset(payload: bytes) -> int | None:
    """GET_CONSUMER_OFFSET reply: partition u32, current offset u64, stored
    offset u64 (little-endian); an empty reply means no stored offset."""
    if not payload:
        return None
    if len(payload) < 20:
        raise ValueError(f"consumer offset reply of {len(payload)} bytes, expected 20")
    _partition, _current, stored = struct.unpack_from("<IQQ", payload)
    return int(stored)


class IggyCommandSource:
    """`CommandSource` over a real Iggy server (its own connection).

    `poll` reads with a plain consumer (``Consumer.Single(consumer_name)``),
    ``PollingStrategy.Offset`` and no auto-commit: the server stores nothing
    when we poll.  `mirror_offset` stores the offset of that same consumer
    with a raw STORE_CONSUMER_OFFSET, see the module docstring.
    """

    def __init__(
        self,
        settings: IggySettings,
        gateway_id: str,
        consumer_name: str,
        *,
        client_factory: ClientFactory | None = None,
    ) -> None:
        self.settings = settings
        self.gateway_id = gateway_id
        self.consumer_name = consumer_name
        self._conn = _Connection(settings, "command source", client_factory)
        self._topics = _Topics(self._conn)

    async def start(self) -> None:
        await self._conn.client()

    async def poll(
        self, stream: str, topic: str, partition_id: int, offset: int, count: int
    ) -> list[PolledMessage]:
        client = await self._conn.client()
        await self._topics.partitions(stream, topic)
        try:
            messages = await self._conn.call(
                f"poll {stream}/{topic}/{partition_id} at {offset}",
                client.poll_messages(
                    stream,
                    topic,
                    consumer=Consumer.Single(self.consumer_name),
                    polling_strategy=PollingStrategy.Offset(offset),
                    count=count,
                    auto_commit=False,
                    partition_id=partition_id,
                ),
            )
        except UplinkRejected as e:
            if is_not_found(e):
                self._topics.forget(stream, topic)
            raise
        return [
            PolledMessage(
                offset=m.offset(),
                message_id=m.id(),
                payload=m.payload(),
                headers=_headers_of(m),
                timestamp_us=m.timestamp(),
            )
            for m in messages
        ]

    async def mirror_offset(self, stream: str, topic: str, partition_id: int, offset: int) -> None:
        client = await self._conn.client()
        payload = encode_store_consumer_offset(self.consumer_name, stream, topic, partition_id, offset)
        await self._conn.call(
            f"store offset {offset} of {stream}/{topic}/{partition_id}",
            client.send_binary_request(STORE_CONSUMER_OFFSET_CODE, payload),
        )

    async def read_mirrored_offset(self, stream: str, topic: str, partition_id: int) -> int | None:
        """The offset the server holds for our group on this partition (what
        the cloud side sees), or None when none was stored."""
        client = await self._conn.client()
        payload = encode_get_consumer_offset(self.consumer_name, stream, topic, partition_id)
        reply = await self._conn.call(
            f"get offset of {stream}/{topic}/{partition_id}",
            client.send_binary_request(GET_CONSUMER_OFFSET_CODE, payload),
        )
        return decode_consumer_offset(reply)

    async def close(self) -> None:
        await self._conn.close()


class IggyCommandSink:
    """Publishes messages the way the cloud side would (for `command send`
    and tests): one message, explicit partition, our headers as strings."""

    def __init__(self, settings: IggySettings, *, client_factory: ClientFactory | None = None) -> None:
        self.settings = settings
        self._conn = _Connection(settings, "command sink", client_factory)
        self._topics = _Topics(self._conn)

    async def start(self) -> None:
        await self._conn.client()

    async def publish(
        self,
        stream: str,
        topic: str,
        partition_id: int,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        message_id: int | None = None,
    ) -> int | None:
        """Send one message; returns its offset when the server reports it."""
        count = await self._topics.partitions(stream, topic)
        if not 0 <= partition_id < count:
            raise UplinkRejected(f"iggy: partition {partition_id} outside 0..{count - 1} of {stream}/{topic}")
        try:
            message = SendMessage(payload, wire_headers(headers or {}), message_id)
        except ValueError as e:
            raise UplinkRejected(f"iggy: message Iggy cannot carry: {e}") from e
        client = await self._conn.client()
        response = await self._conn.call(
            f"publish to {stream}/{topic}/{partition_id}",
            client.send_messages(stream, topic, partition_id, [message]),
        )
        for c in response.confirmations:
            if c.partition_id == partition_id:
                return c.base_offset
        return None

    async def close(self) -> None:
        await self._conn.close()


async def send_command(
    settings: IggySettings,
    stream: str,
    topic: str,
    partition_id: int,
    payload: bytes,
    headers: dict[str, str] | None = None,
    *,
    message_id: int | None = None,
) -> int | None:
    """One-shot publish for the CLI: connect, send one message, close."""
    sink = IggyCommandSink(settings)
    try:
        return await sink.publish(stream, topic, partition_id, payload, headers, message_id=message_id)
    finally:
        await sink.close()
