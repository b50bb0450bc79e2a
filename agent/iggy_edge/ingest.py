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
  PUBACK on its own; through the checked hooks in gmqtt_hooks.py we take over
  its PUBLISH handling, so a message costs no task and the acks of one group
  commit go out in one write, still only after that commit.  This took ingest
  from 0.05 to ~0.9 of a bare counting subscriber (bench/ingest_bench.py).
  An unexpected error while handling a PUBLISH is logged, counted
  (`iggy_edge_ingest_handler_errors_total`) and closes the session, which
  reconnects; the broker redelivers what was not acknowledged.
* Backpressure: QoS1/2 deliveries in flight are capped by the receive maximum
  we announce; while they wait for the commit the broker sends no more.  Work
  in flight (records and dead letters waiting for their commit) is also
  bounded by count and bytes: at READ_PAUSE_AT messages or READ_PAUSE_BYTES
  of payload (the outbox's `pending_bytes`) ingest stops reading the socket and TCP holds the rest in the
  broker (a receive maximum of 2,000 x 256 KiB would otherwise be 512 MB
  here).  QoS0 messages, dead letters included, beyond QOS0_PENDING_LIMIT /
  QOS0_PENDING_BYTES in flight are dropped and counted (QoS0 is best effort
  by definition).
* Dead letters join the outbox's dead-letter groups synchronously
  (`enqueue_dead_letter`): a flood of bad messages costs no task per message
  and one commit per group.
* Redelivery: a message the broker re-sends (DUP) that we had already
  committed (we died between commit and PUBACK) is recognised by (topic,
  device sequence, payload CRC) and acknowledged without a second record, so
  it keeps its original message id.  With receipts on (receipts.py) every
  message with a device sequence is checked, DUP or not: devices re-send
  what no receipt covered yet, as new publishes.  A recognised message goes
  to the `copy_observers` (its receipt may have been lost).  Messages
  without a device sequence are stored again (at-least-once); see
  docs/consumers.md.
* Lost session: CONNACK says whether the broker still had our session.  When
  it had forgotten one the agent had (in this process, or in an earlier one:
  the outbox's meta table remembers the client id), the messages it queued
  for us, and those published before we re-subscribed, are gone: logged as an
  error, counted (`iggy_edge_mqtt_session_lost_total`), shown in health and
  `status`.  docs/operations.md says when a broker loses sessions.
* Reconnect: our own loop with capped, full-jitter exponential backoff (gmqtt's
  built-in reconnect uses a fixed delay and is switched off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
import weakref
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Final

import gmqtt

from . import gmqtt_hooks as hooks
from . import heap
from . import mqtt_codec as codec
from .backoff import backoff_delay
from .config import Settings
from .logs import RateLimitedLog
from .metrics import Metrics
from .mqttconn import CONNECT_ERRORS, close, connect, set_credentials
from .routing import Rejected, Router
from .store import Incoming, Outbox, StoreError, device_seq_of, redelivery_key
from .timeouts import wait_for

log = logging.getLogger(__name__)

QOS0_PENDING_LIMIT: Final = 20_000
# Stop reading the broker's socket while this many records wait for commit.
# Mosquitto 2.0.11 enforces our receive maximum only for its first burst to a
# resumed session; after the first acknowledgements it sends the rest of a
# queued backlog at once (seen with 50k queued: 48k in one group, 177 MB RSS).
# Not reading lets TCP flow control hold the backlog in the broker instead.
READ_PAUSE_AT: Final = 10_000
# ... and while this many payload bytes wait (bench/flood_bench.py: a 256 KiB
# flood's peak RSS follows this bound plus the payloads the cached SQLite
# statements keep bound, see store/commit.py `_insert_rows`).
READ_PAUSE_BYTES: Final = 4 * 1024 * 1024
QOS0_PENDING_BYTES: Final = 2 * READ_PAUSE_BYTES
SESSION_META_KEY: Final = "mqtt_session_client_id"


# (connection or None for QoS0, PUBACK/PUBREC, packet id, topic, payload)
_Ack = tuple[hooks.Connection, int, int, "str | bytes", bytes]
_ACK_CMD: Final = (0, codec.PUBACK, codec.PUBREC)


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
        # Called (quick, must not raise) once per group commit, after its
        # acknowledgements, with its messages [(topic, payload)] in arrival
        # order (receipts: one call per group, not one per message).
        self.group_observers: list[Callable[[list[tuple[str, bytes]]], None]] = []
        # Recognise copies without the DUP flag too (devices re-send what no
        # receipt covered: receipts.py).
        self.recognise_resends = settings.receipts.enabled
        # Called (quick, must not raise) with (topic, payload) of each message
        # recognised as a copy of a committed one (acknowledged, not stored).
        self.copy_observers: list[Callable[[str, bytes], None]] = []
        # Called (quick, must not raise) when the broker had forgotten our
        # session: the return path restores the retained configs then.
        self.session_lost_observers: list[Callable[[], None]] = []
        # Fast path (see raw_publish): acknowledgements waiting for the
        # commit of the group they belong to.
        self._ack_future: asyncio.Future[Any] | None = None
        self._ack_list: list[_Ack] = []
        # Reads wait on _resume while READ_PAUSE_AT messages are in flight
        # (payload bytes in flight are the outbox's pending_bytes).
        self._resume = asyncio.Event()
        self._resume.set()
        self._trim_due = False  # a flood of bytes went through: trim the heap once it is over
        # The commit futures of dead-letter groups (observers skip those).
        self._dead_groups: weakref.WeakSet[asyncio.Future[None]] = weakref.WeakSet()
        self._session_present = False
        self._had_session = False
        self.sessions_lost = 0
        # The client of the current connection or connect attempt (closed
        # when run() is cancelled while holding it).
        self._attempt: gmqtt.Client | None = None
        hooks.check_gmqtt()  # at start-up: a changed gmqtt fails here, loudly
        heap.fix_mmap_threshold()  # large payloads give their memory back (heap.py)

    def use_router(self, router: Router) -> None:
        """Route from the next message on with `router` (a reload of the routes)."""
        self._router = router

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
        hooks.own_reconnect(client, self._lost.set)
        hooks.install_publish_hooks(client, self)
        client.on_message = self._on_message_qos0  # QoS0 with properties (gmqtt parsed it)
        client.on_disconnect = self._on_disconnect
        client.on_connect = self._on_connect
        set_credentials(client, self._mqtt)
        return client

    def _on_disconnect(self, client: Any, packet: Any, exc: Any = None) -> None:
        self._lost.set()

    def _on_connect(self, client: Any, flags: int, rc: int, properties: Any) -> None:
        self._session_present = bool(flags)

    async def _check_session(self) -> None:
        """Did the broker keep the session we had?  (See the module docstring.)"""
        cid = self._settings.mqtt_client_id
        try:
            had = self._had_session or await self._outbox.get_meta(SESSION_META_KEY) == cid
        except (sqlite3.Error, StoreError) as e:
            log.warning("cannot read the MQTT session flag from the outbox: %s", e)
            had = self._had_session
        if had and not self._session_present:
            self.sessions_lost += 1
            self._metrics.mqtt_sessions_lost.inc()
            log.error(
                "MQTT broker %s:%d had forgotten the agent's session %r: messages it held for the "
                "agent, and any published before the agent subscribed again, may be lost (a broker "
                "restart without persistence or before its autosave, or the agent offline longer "
                "than mqtt.session_expiry_s = %ds); see docs/operations.md",
                self._mqtt.host,
                self._mqtt.port,
                cid,
                self._mqtt.session_expiry_s,
            )
            for notify in list(self.session_lost_observers):
                notify()
        if not self._had_session:
            self._had_session = True
            try:
                await self._outbox.set_meta(SESSION_META_KEY, cid)
            except (sqlite3.Error, StoreError) as e:
                log.warning("cannot write the MQTT session flag to the outbox: %s", e)

    async def run(self) -> None:
        """Keep the session up until `stop()`; reconnect with backoff.  A
        cancelled run closes the connection it holds (the broker keeps the
        session either way)."""
        try:
            await self._run()
        except asyncio.CancelledError:
            if self._attempt is not None:
                await close(self._attempt)
            raise

    async def _run(self) -> None:
        attempt = 0
        # A restart by the supervisor after a failed commit tries the store
        # again: a full disk that was freed must not leave ingest stopped.
        self._store_broken.clear()
        while not self._stopping.is_set():
            client = self._attempt = self._make_client()
            self._lost.clear()
            try:
                self._session_present = False
                await connect(client, self._mqtt)
                # Before any await: a resumed session's queue flows from the
                # CONNACK on, and every read of it must already be gated and
                # go through the shortcut (an unhooked read loop during
                # _check_session's database round trip took 20,000 QoS0
                # messages in and dropped the rest of a queued flood).
                hooks.install_connection_hooks(client, self._read_gate)
                await self._check_session()
                for sub in self._mqtt.subscriptions:
                    # retain_handling=1: retained messages only when the
                    # subscription is new.  We re-subscribe on every connect
                    # of the persistent session; without this the broker would
                    # re-send every retained status each time, stored again
                    # under new ids.  no_local: the receipts this session
                    # publishes (receipts.py) do not come back to it.
                    client.subscribe(sub.filter, qos=sub.qos, no_local=True, retain_handling_options=1)
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
            except hooks.GmqttInternalsChanged:
                await self._close_client(client)
                raise
            attempt = 0
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

    def _read_gate(self) -> Awaitable[object] | None:
        """Before each socket read: wait while READ_PAUSE_AT messages or
        READ_PAUSE_BYTES payload bytes wait for their commit.

        Waiting inside gmqtt's `read` lets its buffer fill, the transport
        pause and TCP push back, so the backlog stays in the broker."""
        if self._handlers < READ_PAUSE_AT and self._outbox.pending_bytes < READ_PAUSE_BYTES:
            return None
        self._metrics.ingest_read_pauses.inc()
        return self._room()

    async def _room(self) -> None:
        if self._outbox.pending_bytes >= READ_PAUSE_BYTES:
            self._trim_due = True
        while self._handlers >= READ_PAUSE_AT:
            self._resume.clear()
            await self._resume.wait()
        await self._outbox.wait_pending_below(READ_PAUSE_AT, max_bytes=READ_PAUSE_BYTES)

    def hook_error(self, exc: Exception) -> None:
        """A PUBLISH could not be handled (a bug, not bad input: bad input is a
        dead letter).  Close the session: it reconnects and the broker
        redelivers everything not acknowledged."""
        self._metrics.ingest_handler_errors.inc()
        log.error("unexpected error handling an MQTT message; reconnecting the session", exc_info=exc)
        self._lost.set()

    @property
    def client(self) -> gmqtt.Client | None:
        """The live session's client (tests look at its connection)."""
        return self._client

    @property
    def in_flight(self) -> int:
        """Messages taken from the broker whose acknowledgement waits for a commit."""
        return self._handlers

    @property
    def store_broken(self) -> bool:
        """A commit failed and this session holds its acknowledgements."""
        return self._store_broken.is_set()

    async def stop(self, drain_timeout: float = 5.0) -> None:
        """Stop taking messages: let in-flight handlers finish their commit and
        acknowledgement, then disconnect (the broker keeps the session)."""
        self._stopping.set()
        with contextlib.suppress(TimeoutError):
            await wait_for(self._idle.wait(), drain_timeout)
        if self._client is not None:
            await self._close_client(self._client)
            self._client = None

    async def _close_client(self, client: gmqtt.Client) -> None:
        await close(client)
        if self._attempt is client:
            self._attempt = None

    async def _sleep_or_stop(self, delay: float) -> None:
        with contextlib.suppress(TimeoutError):
            await wait_for(self._stopping.wait(), delay)

    @staticmethod
    async def _wait_first(*events: asyncio.Event) -> None:
        waiters = [asyncio.create_task(e.wait()) for e in events]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waiters:
                w.cancel()

    # -- messages -------------------------------------------------------

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
        if qos == 0 and (
            self._handlers >= QOS0_PENDING_LIMIT or self._outbox.pending_bytes >= QOS0_PENDING_BYTES
        ):
            self._metrics.dropped.labels("qos0_queue_full").inc()
            self._flush_counts()
            self._limited.warning(
                "qos0-full",
                "QoS0 message dropped: %d messages (%d bytes) wait for commit",
                self._handlers,
                self._outbox.pending_bytes,
            )
            return None
        if not isinstance(route, Rejected):
            assert isinstance(topic, str)  # a bytes topic never routes
            route = self._outbox.admit(route, topic) or route  # per-device bounds (store/devices.py)
        if isinstance(route, Rejected):
            self._flush_counts()
            done = self._outbox.enqueue_dead_letter(
                mqtt_topic=topic,
                payload=payload,
                qos=qos,
                retain=retain,
                reason=route.reason.value,
                detail=route.detail,
                received_us=received_us,
            )
            self._dead_groups.add(done)
            return done
        assert isinstance(topic, str)  # a bytes topic never routes
        dseq = device_seq_of(payload)
        key = redelivery_key(topic, qos, dseq, payload)
        if key is None or not (self.recognise_resends or properties.get("dup")):
            return self._outbox.submit(Incoming(route, topic, qos, retain, received_us, payload, dseq, key))
        copy = self._outbox.copy_of(key)  # redelivery recognition: the store's
        if copy is False:
            return self._outbox.submit(Incoming(route, topic, qos, retain, received_us, payload, dseq, key))
        self._metrics.ingest_known_copies.inc()
        if copy is not True:
            # Its original still waits for its group commit (a device re-sent
            # faster than a slow commit): acknowledged with that commit.
            return copy
        self._flush_counts()
        log.log(
            logging.INFO if properties.get("dup") else logging.DEBUG,
            "message on %s (device seq %d) was already committed: not stored twice",
            topic,
            dseq,
        )
        for observe in self.copy_observers:
            observe(topic, payload)
        return None

    def _flush_counts(self) -> None:
        for qos, n in enumerate(self._rx):
            if n:
                self._count_qos[qos].inc(n)
                self._rx[qos] = 0
        if self._rx_bytes:
            self._metrics.ingest_bytes.inc(self._rx_bytes)
            self._rx_bytes = 0

    # -- fast path: no task per message, one write per group of acks ------
    #
    # `_accept` places the record in the pending group synchronously (arrival
    # order is outbox order) and the acks of the group are written, on the
    # connection that delivered them, only when the group's commit has
    # succeeded.  A failed commit acknowledges nothing (the broker redelivers).

    def raw_publish(self, conn: hooks.Connection, cmd: int, body: bytes, v5: bool) -> bool:
        """A PUBLISH off the wire; False hands it to gmqtt's general parser
        (properties: topic alias, expiry, user properties)."""
        try:
            qos, mid, topic_b, payload, props = codec.parse_publish(cmd, body, v5)
        except codec.MalformedPacket:
            return False  # gmqtt's parser logs it and skips it
        if props or not topic_b:  # an empty topic is a topic alias: gmqtt resolves it
            return False
        try:
            topic: str | bytes = topic_b.decode()
        except UnicodeDecodeError:
            topic = topic_b
        properties = {"dup": (cmd >> 3) & 1, "retain": cmd & 1}
        if qos == 0:
            self._on_message_qos0(None, topic, payload, 0, properties)
        else:
            self.parsed_publish(conn, qos, mid, topic, payload, properties)
        return True

    def parsed_publish(
        self,
        conn: hooks.Connection,
        qos: int,
        mid: int,
        topic: str | bytes,
        payload: bytes,
        props: dict[str, Any],
    ) -> None:
        done = self._accept(topic, payload, qos, props)
        if done is None:
            hooks.write(conn, codec.ack(_ACK_CMD[qos], mid))
            return
        self._ack_after(done, (conn, _ACK_CMD[qos], mid, topic, payload))

    def _on_message_qos0(
        self, client: Any, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> None:
        done = self._accept(topic, payload, qos, properties)
        if done is not None:
            self._ack_after(done, (None, 0, 0, topic, payload))

    def _ack_after(self, done: asyncio.Future[Any], ack: _Ack) -> None:
        if not self._handlers:
            self._idle.clear()
        self._handlers += 1
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
            if self._trim_due:
                self._trim_due = False
                heap.trim()
        if self._handlers < READ_PAUSE_AT:
            self._resume.set()
        if done.cancelled() or done.exception() is not None:
            # Commit failed: acknowledge nothing, so the broker keeps the
            # messages and redelivers them on the next session.
            self._store_broken.set()
            return
        msgs: list[tuple[str, bytes]] = []
        if (self.observers or self.group_observers) and done not in self._dead_groups:
            msgs = [(t, p) for _, _, _, t, p in acks if isinstance(t, str)]
            for observe in self.observers:
                for topic, payload in msgs:
                    observe(topic, payload)
        conn: hooks.Connection = None
        out: list[bytes] = []
        ack = codec.ack
        for c, cmd, mid, _, _ in acks:
            if c is None:  # QoS0: nothing to acknowledge
                continue
            if c is not conn:
                hooks.write(conn, b"".join(out))
                conn, out = c, []
            out.append(ack(cmd, mid))
        hooks.write(conn, b"".join(out))
        if msgs:
            for observe_group in self.group_observers:
                observe_group(msgs)
