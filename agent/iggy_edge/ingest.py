"""Ingest: the MQTT session (gmqtt) -> outbox, acknowledging only after commit.

* Persistent session: a fixed client id, clean start off and a session expiry
  above zero, so the broker keeps our subscriptions and queues QoS1/2 messages
  while the agent restarts (the shipped Mosquitto config raises
  `max_queued_messages` so that queue is deep enough).
* Acknowledge after commit: gmqtt runs with `optimistic_acknowledgement=False`
  and sends PUBACK/PUBREC when `on_message` returns; `on_message` returns only
  after the record's group commit.  A process killed before that gets the
  message again on reconnect.
* Order: the record is handed to the outbox synchronously, as the packet is
  parsed, so arrival order is the outbox order.
* Fast path: gmqtt would run every message as its own task and write every
  PUBACK on its own; we take over its QoS1/QoS2 publish handling
  (`_install_fast_path`) so a message costs no task and the acks of one group
  commit go out in one write, still only after that commit.  This took ingest
  from 0.05 to ~0.9 of a bare counting subscriber (bench/ingest_bench.py).
* Backpressure: QoS1/2 deliveries in flight are capped by the receive maximum
  we announce; while they wait for the commit the broker sends no more.  QoS0
  has no such window, so QoS0 messages beyond `QOS0_PENDING_LIMIT` pending
  records are dropped and counted (QoS0 is best effort by definition).
* Redelivery: a message the broker re-sends (DUP) that we had already
  committed (we died between commit and PUBACK) is recognised by (topic,
  device sequence, payload CRC) and acknowledged without a second record, so
  it keeps its original message id.  Messages without a device sequence are
  stored again (at-least-once); see docs/consumers.md.
* Reconnect: our own loop with capped, full-jitter exponential backoff (gmqtt's
  built-in reconnect uses a fixed delay and is switched off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
import zlib
from collections.abc import Callable
from functools import partial
from typing import Any, Final

import gmqtt
from gmqtt.mqtt.constants import MQTTCommands, MQTTv50

from .backoff import backoff_delay
from .config import Settings
from .logs import RateLimitedLog
from .metrics import Metrics
from .mqttconn import CONNECT_ERRORS, connect, set_credentials
from .routing import Rejected, Router
from .store import Incoming, Outbox, StoreError, device_seq_of

log = logging.getLogger(__name__)

QOS0_PENDING_LIMIT: Final = 20_000
# Stop reading the broker's socket while this many records wait for commit.
# Mosquitto 2.0.11 enforces our receive maximum only for its first burst to a
# resumed session; after the first acknowledgements it sends the rest of a
# queued backlog at once (seen with 50k queued: 48k in one group, 177 MB RSS).
# Not reading lets TCP flow control hold the backlog in the broker instead.
READ_PAUSE_AT: Final = 10_000
PUBACK_SUCCESS: Final = 0


# (connection or None for QoS0, PUBACK/PUBREC, packet id, topic, payload)
_Ack = tuple[Any, int, int, "str | bytes", bytes]


_ACK: Final = struct.Struct("!BBH")


def _write(conn: Any, packets: list[bytes]) -> None:
    """One socket write for many acknowledgements (skipped, with gmqtt's own
    warning, when that connection has closed: the broker redelivers)."""
    if conn is not None and packets:
        conn._protocol.write_data(b"".join(packets))


class Ingest:
    def __init__(self, settings: Settings, outbox: Outbox, router: Router, metrics: Metrics) -> None:
        self._settings = settings
        self._mqtt = settings.mqtt
        self._outbox = outbox
        self._router = router
        self._metrics = metrics
        self._limited = RateLimitedLog(log)
        self._client: gmqtt.Client | None = None
        self._lost = asyncio.Event()
        self._stopping = asyncio.Event()
        self._store_broken = asyncio.Event()
        self._handlers = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._count_qos = [metrics.ingest_messages.labels(str(q)) for q in range(3)]
        # Received messages and bytes are counted here and added to the
        # Prometheus counters once per group (two locked counter updates per
        # message were 13% of ingest CPU); see _flush_counts.
        self._rx = [0, 0, 0]
        self._rx_bytes = 0
        self.connected = asyncio.Event()
        # Called with (topic, payload) for every message once its record is
        # committed, before the acknowledgement; the return path watches
        # device acks here.  Observers must be quick and must not raise.
        self.observers: list[Callable[[str, bytes], None]] = []
        # Fast path (see _install_fast_path): acknowledgements waiting for the
        # commit of the group they belong to.
        self._ack_future: asyncio.Future[Any] | None = None
        self._ack_list: list[_Ack] = []

    # -- session --------------------------------------------------------

    def _make_client(self) -> gmqtt.Client:
        client = gmqtt.Client(
            self._settings.mqtt_client_id,
            clean_session=False,
            optimistic_acknowledgement=False,
            session_expiry_interval=self._mqtt.session_expiry_s,
            receive_maximum=self._mqtt.receive_maximum,
        )
        # We own reconnection (backoff with jitter, fresh client per attempt):
        # gmqtt's handler would otherwise reconnect on its own with a fixed
        # delay, racing our loop with the same client id.
        client._package_handler._reconnect_callback = self._on_lost
        if not self._install_fast_path(client):
            client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        set_credentials(client, self._mqtt)
        return client

    async def _on_lost(self, delay: bool = False) -> None:
        self._lost.set()

    def _on_disconnect(self, client: Any, packet: Any, exc: Any = None) -> None:
        self._lost.set()

    async def run(self) -> None:
        """Keep the session up until `stop()`; reconnect with backoff."""
        attempt = 0
        # A restart by the supervisor after a failed commit tries the store
        # again: a full disk that was freed must not leave ingest stopped.
        self._store_broken.clear()
        while not self._stopping.is_set():
            client = self._make_client()
            self._lost.clear()
            try:
                await connect(client, self._mqtt)
                for sub in self._mqtt.subscriptions:
                    # retain_handling=1: retained messages only when the
                    # subscription is new.  We re-subscribe on every connect
                    # of the persistent session; without this the broker would
                    # re-send every retained status each time, stored again
                    # under new ids.
                    client.subscribe(sub.filter, qos=sub.qos, retain_handling_options=1)
            except CONNECT_ERRORS as e:
                self._metrics.mqtt_reconnects.inc()
                delay = backoff_delay(attempt, self._mqtt.reconnect_min_s, self._mqtt.reconnect_max_s)
                attempt += 1
                self._limited.warning(
                    "mqtt-connect",
                    "MQTT broker %s:%d not reachable (%s); retrying in %.1fs",
                    self._mqtt.host,
                    self._mqtt.port,
                    e or type(e).__name__,
                    delay,
                )
                await self._close_client(client)
                await self._sleep_or_stop(delay)
                continue
            attempt = 0
            self._throttle_reads(client)
            self._client = client
            self._metrics.mqtt_connected.set(1)
            self.connected.set()
            log.info(
                "MQTT session up: %s:%d as %r, session expiry %ds, receive maximum %d",
                self._mqtt.host,
                self._mqtt.port,
                self._settings.mqtt_client_id,
                client.session_expiry_interval,
                self._mqtt.receive_maximum,
            )
            await self._wait_first(self._lost, self._stopping, self._store_broken)
            self.connected.clear()
            self._metrics.mqtt_connected.set(0)
            if self._stopping.is_set():
                break
            if self._store_broken.is_set():
                log.error("outbox cannot commit: closing the MQTT session so the broker keeps the messages")
                await self._close_client(client)
                self._client = None
                raise StoreError("outbox cannot commit; ingest stopped until the supervisor restarts it")
            self._metrics.mqtt_reconnects.inc()
            log.warning("MQTT session lost; reconnecting")
            await self._close_client(client)
            self._client = None
            await self._sleep_or_stop(
                backoff_delay(0, self._mqtt.reconnect_min_s, self._mqtt.reconnect_max_s)
            )

    def _throttle_reads(self, client: gmqtt.Client) -> None:
        """Make gmqtt's read loop wait while READ_PAUSE_AT records are pending.

        gmqtt reads with a StreamReader that resumes the transport on its own,
        so pausing the transport does not hold; waiting inside `read` does:
        the reader's buffer fills, the transport pauses, TCP pushes back."""
        protocol = getattr(getattr(client, "_connection", None), "_protocol", None)
        original = getattr(protocol, "read", None)
        if protocol is None or original is None:
            log.warning("gmqtt internals changed: reads are not throttled under overload")
            return
        outbox = self._outbox

        async def read(n: int = -1) -> bytes:
            if outbox.pending_count >= READ_PAUSE_AT:
                self._metrics.ingest_read_pauses.inc()
                await outbox.wait_pending_below(READ_PAUSE_AT)
            data: bytes = await original(n)
            return data

        protocol.read = read
        self._shortcut_publish(client)

    def _shortcut_publish(self, client: gmqtt.Client) -> None:
        """Hand PUBLISH packets from gmqtt's packet splitter straight to the
        lean parser, past gmqtt's generic dispatch (a debug log, a handler
        lookup and two clock reads per packet).  Other packets, and any
        connection gmqtt no longer considers current, go the usual way."""
        handler: Any = getattr(client, "_package_handler", None)
        conn = getattr(client, "_connection", None)
        lean = getattr(handler, "_handle_publish_packet", None)
        if conn is None or not isinstance(lean, partial) or not hasattr(conn, "put_package"):
            return  # the fast path is not installed: keep gmqtt's dispatch
        usual = conn.put_package

        def put_package(pkg: Any) -> None:
            if pkg.cmd & 0xF0 == MQTTCommands.PUBLISH and handler.current_connection is conn:
                conn._last_data_in = time.monotonic()  # keepalive bookkeeping, as gmqtt does
                lean(pkg.cmd, pkg.data)
            else:
                usual(pkg)

        conn.put_package = put_package

    @property
    def store_broken(self) -> bool:
        """A commit failed and this session holds its acknowledgements."""
        return self._store_broken.is_set()

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop taking messages: let in-flight handlers finish their commit and
        acknowledgement, then disconnect (the broker keeps the session)."""
        self._stopping.set()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), drain_timeout)
        if self._client is not None:
            await self._close_client(self._client)
            self._client = None

    async def _close_client(self, client: gmqtt.Client) -> None:
        with contextlib.suppress(OSError, RuntimeError, AttributeError, TimeoutError):
            await asyncio.wait_for(client.disconnect(), 5)

    async def _sleep_or_stop(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), delay)

    @staticmethod
    async def _wait_first(*events: asyncio.Event) -> None:
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- messages -------------------------------------------------------

    async def _on_message(
        self, client: Any, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> int:
        self._handlers += 1
        self._idle.clear()
        try:
            return await self._handle(topic, payload, qos, properties)
        finally:
            self._handlers -= 1
            if self._handlers == 0:
                self._idle.set()

    async def _handle(self, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]) -> int:
        done = self._accept(topic, payload, qos, properties)
        if done is None:
            return PUBACK_SUCCESS
        try:
            await done
        except StoreError:
            # Do not acknowledge: hold the delivery until the session closes,
            # so the broker keeps the message and redelivers it later.
            self._store_broken.set()
            await self._stopping.wait()
            raise
        finally:
            self._flush_counts()
        if isinstance(topic, str) and not isinstance(done, asyncio.Task):  # not a dead letter
            for observe in self.observers:
                observe(topic, payload)
        return PUBACK_SUCCESS

    def _accept(
        self, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> asyncio.Future[Any] | None:
        """Route a message and hand it to the outbox, synchronously, so arrival
        order is outbox order.  Returns what must complete before the message
        is acknowledged (its group commit, or a dead-letter task), or None when
        it may be acknowledged at once (a QoS0 drop, a known redelivery)."""
        received_us = time.time_ns() // 1000
        retain = bool(properties.get("retain"))
        self._rx[qos] += 1
        self._rx_bytes += len(payload)
        route = self._router.route(topic, len(payload))
        if isinstance(route, Rejected):
            self._flush_counts()
            return asyncio.ensure_future(self._dead_letter(topic, payload, qos, retain, route, received_us))
        assert isinstance(topic, str)  # a bytes topic never routes
        if qos == 0 and self._outbox.pending_count >= QOS0_PENDING_LIMIT:
            self._metrics.dropped.labels("qos0_queue_full").inc()
            self._flush_counts()
            self._limited.warning(
                "qos0-full", "QoS0 message dropped: %d records wait for commit", QOS0_PENDING_LIMIT
            )
            return None
        dseq = device_seq_of(payload)
        if properties.get("dup") and dseq is not None and self._outbox.seen(topic, dseq, zlib.crc32(payload)):
            self._flush_counts()
            log.info(
                "redelivered message on %s (device seq %d) was already committed: not stored twice",
                topic,
                dseq,
            )
            return None
        return self._outbox.submit(Incoming(route, topic, qos, retain, received_us, payload, dseq))

    def _flush_counts(self) -> None:
        for qos, n in enumerate(self._rx):
            if n:
                self._count_qos[qos].inc(n)
                self._rx[qos] = 0
        if self._rx_bytes:
            self._metrics.ingest_bytes.inc(self._rx_bytes)
            self._rx_bytes = 0

    # -- fast path: no task per message, one write per group of acks ------

    def _install_fast_path(self, client: gmqtt.Client) -> bool:
        """Take over gmqtt's QoS1/QoS2 publish handling so that a message costs
        no task of its own and the acknowledgements of a whole group commit go
        out in one socket write.

        gmqtt's non-optimistic path runs every message as a task and sends each
        PUBACK with its own write; at 20k+ msg/s that was most of the agent's
        CPU (bench/ingest_bench.py).  Here `_accept` places the record in the
        pending group synchronously (same order guarantee) and the acks of the
        group are written, on the connection that delivered them, only when the
        group's commit has succeeded -- the same "acknowledge after commit"
        contract.  A failed commit acknowledges nothing (the broker redelivers).

        Relies on gmqtt 0.8 internals (`_handle_qos_{1,2}_publish_packet`);
        when they are missing, returns False and the coroutine path is used.
        """
        handler = getattr(client, "_package_handler", None)
        needed = ("_handle_qos_1_publish_packet", "_handle_qos_2_publish_packet", "_connection")
        if handler is None or not all(hasattr(handler, a) for a in needed):
            log.warning("gmqtt internals changed: using the slower one-task-per-message ingest path")
            return False
        handler._handle_qos_1_publish_packet = partial(self._fast_publish, handler, MQTTCommands.PUBACK, 1)
        handler._handle_qos_2_publish_packet = partial(self._fast_publish, handler, MQTTCommands.PUBREC, 2)
        if hasattr(handler, "_handle_publish_packet") and hasattr(handler, "_connection_state"):
            handler._handle_publish_packet = partial(
                self._lean_publish, handler, handler._handle_publish_packet
            )
        client.on_message = self._on_message_qos0  # only QoS0 reaches on_message now
        return True

    def _lean_publish(
        self, handler: Any, general: Callable[[int, bytes], None], cmd: int, raw: bytes
    ) -> None:
        """Parse the common PUBLISH ourselves: topic, packet id (QoS1/2), an
        empty MQTT 5 property block, payload.  gmqtt's general parser (which
        the bare subscriber pays too) built a property dict and logged twice per
        message; it still handles any PUBLISH that carries properties (topic
        alias, expiry, user properties) or looks unusual."""
        qos = (cmd >> 1) & 3
        slen = (raw[0] << 8 | raw[1]) if len(raw) > 1 else 0
        pos = 2 + slen
        if not slen or len(raw) < pos + (3 if qos else 1):
            general(cmd, raw)
            return
        mid = 0
        if qos:
            mid = raw[pos] << 8 | raw[pos + 1]
            pos += 2
        if handler._connection_state.protocol_version >= MQTTv50:
            if raw[pos]:  # properties present: let gmqtt parse them
                general(cmd, raw)
                return
            pos += 1
        topic_b = raw[2 : 2 + slen]
        try:
            topic: str | bytes = topic_b.decode()
        except UnicodeDecodeError:
            topic = topic_b
        properties = {"dup": (cmd >> 3) & 1, "retain": cmd & 1}
        if qos == 0:
            self._on_message_qos0(None, topic, raw[pos:], 0, properties)
            return
        self._fast_publish(
            handler,
            MQTTCommands.PUBACK if qos == 1 else MQTTCommands.PUBREC,
            qos,
            mid,
            raw[pos:],
            topic,
            properties,
        )

    def _fast_publish(
        self, handler: Any, cmd: int, qos: int, mid: int, payload: bytes, topic: str | bytes, properties: Any
    ) -> None:
        conn = handler._connection
        done = self._accept(topic, payload, qos, properties)
        if done is None:
            conn.send_command_with_mid(cmd, mid, False)
            return
        self._ack_after(done, (conn, cmd, mid, topic, payload))

    def _on_message_qos0(
        self, client: Any, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> None:
        done = self._accept(topic, payload, qos, properties)
        if done is not None:
            self._ack_after(done, (None, 0, 0, topic, payload))

    def _ack_after(self, done: asyncio.Future[Any], ack: _Ack) -> None:
        self._handlers += 1
        self._idle.clear()
        if done is self._ack_future and not done.done():
            self._ack_list.append(ack)
            return
        self._ack_future = done
        self._ack_list = acks = [ack]
        done.add_done_callback(partial(self._acknowledge, acks))

    def _acknowledge(self, acks: list[_Ack], done: asyncio.Future[Any]) -> None:
        self._flush_counts()
        self._handlers -= len(acks)
        if self._handlers == 0:
            self._idle.set()
        if done.cancelled() or done.exception() is not None:
            # Commit failed: acknowledge nothing, so the broker keeps the
            # messages and redelivers them on the next session.
            self._store_broken.set()
            return
        if self.observers and not isinstance(done, asyncio.Task):  # a Task is a dead letter
            for _, _, _, topic, payload in acks:
                if isinstance(topic, str):
                    for observe in self.observers:
                        observe(topic, payload)
        conn: Any = None
        out: list[bytes] = []
        for c, cmd, mid, _, _ in acks:
            if c is None:  # QoS0: nothing to acknowledge
                continue
            if c is not conn:
                _write(conn, out)
                conn, out = c, []
            # PUBACK/PUBREC with remaining length 2: success in MQTT 3.1.1 and 5
            # alike (MQTT 5 allows leaving out a reason code of 0).
            out.append(_ACK.pack(cmd, 2, mid))
        _write(conn, out)

    async def _dead_letter(
        self, topic: str | bytes, payload: bytes, qos: int, retain: bool, why: Rejected, received_us: int
    ) -> int:
        try:
            await self._outbox.dead_letter(
                mqtt_topic=topic,
                payload=payload,
                qos=qos,
                retain=retain,
                reason=why.reason.value,
                detail=why.detail,
                received_us=received_us,
            )
        except StoreError:
            self._store_broken.set()
            await self._stopping.wait()
            raise
        return PUBACK_SUCCESS
