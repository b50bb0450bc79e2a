"""Ingest: the MQTT session (gmqtt) -> outbox, acknowledging only after commit.

* Persistent session: a fixed client id, clean start off and a session expiry
  above zero, so the broker keeps our subscriptions and queues QoS1/2 messages
  while the agent restarts (the shipped Mosquitto config raises
  `max_queued_messages` so that queue is deep enough).
* Acknowledge after commit, fast: through the checked hooks in gmqtt_hooks.py
  we take over gmqtt's PUBLISH handling (it would run every message as a task
  and write every PUBACK alone): the record goes to the outbox synchronously,
  as the packet is parsed (arrival order is outbox order), and the
  PUBACKs/PUBRECs of one group commit go out in one write once that commit
  succeeded.  A process killed before that gets the messages again.  This
  took ingest from 0.05 to ~0.9 of a bare counting subscriber
  (bench/ingest_bench.py).  An unexpected error while handling a PUBLISH is logged, counted
  (`iggy_edge_ingest_handler_errors_total`) and closes the session, which
  reconnects; the broker redelivers what was not acknowledged.
* Backpressure: QoS1/2 deliveries in flight are capped by the receive maximum
  we announce; while they wait for the commit the broker sends no more.  Work
  in flight (records and dead letters waiting for their commit) is also
  bounded by count and bytes: at READ_PAUSE_AT messages or READ_PAUSE_BYTES
  of payload (ingest_acks.py, with the acknowledgements waiting for their
  commit) ingest stops reading the socket and TCP holds the rest in the
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
* Board updates: a message on a board's ``up/ota`` (topics.py) is not
  telemetry: it goes to the `ota_observers` (the updater, ota/) and is
  acknowledged at once, never stored.
* Lost session: mqtt_session.py tells when the broker forgot our session.
* Reconnect: the session loop deliver uses too (mqttconn.keep_session),
  capped full-jitter exponential backoff (gmqtt's built-in reconnect uses a
  fixed delay and is switched off).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any, Final

import gmqtt

from . import gmqtt_hooks as hooks
from . import heap
from . import mqtt_codec as codec
from .config import Settings
from .ingest_acks import ACK_CMD, READ_PAUSE_BYTES, InFlight
from .logs import RateLimitedLog
from .metrics import Metrics
from .mqtt_session import SessionMemory
from .mqttconn import close, connect, keep_session, set_credentials, wait_first
from .records import Route
from .routing import Rejected, Router
from .store import Outbox, StoreError, device_seq_of
from .timeouts import wait_for

log = logging.getLogger(__name__)

QOS0_PENDING_LIMIT: Final = 20_000
QOS0_PENDING_BYTES: Final = 2 * READ_PAUSE_BYTES


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
        self._work = InFlight(outbox, metrics, self._flush_counts)
        self._store_broken = self._work.store_broken
        self._idle = self._work.idle
        self._count_qos = [metrics.ingest_messages.labels(str(q)) for q in range(3)]
        # Received messages and bytes are counted here and added to the
        # Prometheus counters once per group (two locked counter updates per
        # message were 13% of ingest CPU); see _flush_counts.
        self._rx = [0, 0, 0]
        self._rx_bytes = 0
        self.connected = asyncio.Event()
        # What sees the committed messages (ingest_acks.InFlight)
        self.observers = self._work.observers
        self.group_observers = self._work.group_observers
        # Recognise copies without the DUP flag too (devices re-send what no
        # receipt covered: receipts.py).
        self.recognise_resends = settings.receipts.enabled
        # Called (quick, must not raise) with (topic, payload) of each message
        # recognised as a copy of a committed one (acknowledged, not stored).
        self.copy_observers: list[Callable[[str, bytes], None]] = []
        # Called (quick, must not raise) with (device, payload) of each update
        # reply on ``up/ota``: the updater's (ota/), never stored as a reading.
        self.ota_observers: list[Callable[[str, bytes], None]] = []
        self._topics = settings.topics
        self._session_present = False
        self._memory = SessionMemory(settings, outbox, metrics)
        self._drained = asyncio.Event()  # stop(): in-flight handlers are done
        self._ended = asyncio.Event()  # run() is not running (closed its client)
        self._ended.set()
        hooks.check_gmqtt()  # at start-up: a changed gmqtt fails here, loudly
        heap.fix_mmap_threshold()  # large payloads give their memory back (heap.py)
        heap.spare_full_collections()  # what the groups in flight cost the collector (heap.py)

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
        await self._memory.check(self._session_present)

    @property
    def sessions_lost(self) -> int:
        return self._memory.lost

    @property
    def session_lost_observers(self) -> list[Callable[[], None]]:
        """Called (quick, must not raise) when the broker had forgotten our
        session: the return path restores the retained configs then."""
        return self._memory.observers

    async def run(self) -> None:
        """Keep the session up until `stop()`; reconnect with backoff
        (mqttconn.keep_session).  A cancelled run closes the connection it
        holds (the broker keeps the session either way)."""
        # A restart by the supervisor after a failed commit tries the store
        # again: a full disk that was freed must not leave ingest stopped.
        self._store_broken.clear()
        self._ended.clear()
        try:
            await keep_session(
                self._mqtt,
                name="ingest",
                open_session=self._open,
                serve=self._serve,
                close_session=self._close_client,
                pause=self._sleep_or_stop,
                limited=self._limited,
                on_retry=self._metrics.mqtt_reconnects.inc,
                stopped=self._stopping.is_set,
            )
        finally:
            self._ended.set()

    async def _open(self) -> gmqtt.Client:
        client = self._make_client()
        self._lost.clear()
        self._session_present = False
        await connect(client, self._mqtt)  # closes the client when it fails
        try:
            # Before any await: a resumed session's queue flows from the
            # CONNACK on, and every read of it must already be gated and go
            # through the shortcut (an unhooked read loop during
            # _check_session's database round trip took 20,000 QoS0 messages
            # in and dropped the rest of a queued flood).
            hooks.install_connection_hooks(client, self._work.read_gate)
            await self._check_session()
            for sub in self._mqtt.subscriptions:
                # retain_handling=1: retained messages only when the
                # subscription is new.  We re-subscribe on every connect of
                # the persistent session; without this the broker would
                # re-send every retained status each time, stored again under
                # new ids.  no_local: the receipts this session publishes
                # (receipts.py) do not come back to it.
                client.subscribe(sub.filter, qos=sub.qos, no_local=True, retain_handling_options=1)
        except BaseException:
            await close(client)
            raise
        return client

    async def _serve(self, client: gmqtt.Client) -> bool:
        """While the session is up: True to reconnect, False once stopped."""
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
        try:
            await wait_first(self._lost, self._stopping, self._store_broken)
        finally:
            self.connected.clear()
            self._metrics.mqtt_connected.set(0)
        if self._stopping.is_set():
            await self._drained.wait()  # in-flight handlers acknowledge first (stop())
            return False
        if self._store_broken.is_set():
            log.error("outbox cannot commit: closing the MQTT session so the broker keeps the messages")
            raise StoreError("outbox cannot commit; ingest stopped until the supervisor restarts it")
        self._metrics.mqtt_reconnects.inc()
        log.warning("MQTT session lost; reconnecting")
        return True

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

    def publish(self, topic: str, payload: bytes, retain: bool) -> bool:
        """QoS0 on this session (stages.Publish: receipts.py says why); False
        while there is no session."""
        client = self._client
        if client is None or not self.connected.is_set():
            return False
        try:
            client.publish(topic, payload, qos=0, retain=retain)
        except (OSError, RuntimeError, AttributeError) as e:  # the connection went away under us
            log.debug("not published on %s: %s", topic, e)
            return False
        return True

    @property
    def in_flight(self) -> int:
        """Messages taken from the broker whose acknowledgement waits for a commit."""
        return self._work.handlers

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
        self._drained.set()
        with contextlib.suppress(TimeoutError):
            await wait_for(self._ended.wait(), drain_timeout)  # run() closes its client

    async def _close_client(self, client: gmqtt.Client) -> None:
        if self._client is client:
            self._client = None
        await close(client)

    async def _sleep_or_stop(self, delay: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await wait_for(self._stopping.wait(), delay)
        return self._stopping.is_set()

    # -- messages -------------------------------------------------------

    def _accept(
        self, topic: str | bytes, payload: bytes, qos: int, dup: object, retain: int
    ) -> asyncio.Future[Any] | None:
        """Route a message and hand it to the outbox, synchronously, so arrival
        order is outbox order.  Returns what must complete before the message
        is acknowledged (its group commit, or a dead-letter task), or None when
        it may be acknowledged at once (a QoS0 drop, a known redelivery).
        `retain` is 0 or 1."""
        received_us = time.time_ns() // 1000
        n = len(payload)
        self._rx[qos] += 1
        self._rx_bytes += n
        if isinstance(topic, str) and (ota := self._topics.device_of_ota_reply(topic)) is not None:
            for observe in self.ota_observers:  # acknowledged at once, not telemetry
                observe(ota, payload)
            return None
        router = self._router
        route: Route | Rejected | None = router.routes.get(topic)  # the topics that route (routing.py)
        if route is None or not 0 < n <= router.max_payload:
            route = router.route(topic, n)
        if qos == 0 and (
            self._work.handlers >= QOS0_PENDING_LIMIT or self._outbox.pending_bytes >= QOS0_PENDING_BYTES
        ):
            self._metrics.dropped.labels("qos0_queue_full").inc()
            self._flush_counts()
            self._limited.warning(
                "qos0-full",
                "QoS0 message dropped: %d messages (%d bytes) wait for commit",
                self._work.handlers,
                self._outbox.pending_bytes,
            )
            return None
        if isinstance(route, Route):
            assert isinstance(topic, str)  # a bytes topic never routes
            # Admission (per-device bounds), redelivery recognition (the
            # store's: by topic, device seq, payload CRC) and the open group,
            # in one call.
            dseq = device_seq_of(payload)
            done = self._outbox.take(
                route, topic, qos, retain, received_us, payload, dseq, self.recognise_resends or bool(dup)
            )
            if done is True:
                self._copy(topic, payload, dseq, dup)
                return None
            if not isinstance(done, Rejected):
                return done
            route = done
        self._flush_counts()
        dead = self._outbox.enqueue_dead_letter(
            mqtt_topic=topic,
            payload=payload,
            qos=qos,
            retain=bool(retain),
            reason=route.reason.value,
            detail=route.detail,
            received_us=received_us,
        )
        self._work.dead_groups.add(dead)
        return dead

    def _copy(self, topic: str, payload: bytes, dseq: int | None, dup: object) -> None:
        """A copy of a committed message: acknowledged, not stored again."""
        self._flush_counts()
        log.log(
            logging.INFO if dup else logging.DEBUG,
            "message on %s (device seq %s) was already committed: not stored twice",
            topic,
            dseq,
        )
        for observe in self.copy_observers:
            observe(topic, payload)

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
        done = self._accept(topic, payload, qos, cmd & 8, cmd & 1)  # the DUP and RETAIN bits
        ack = codec.ack(ACK_CMD[qos], mid) if qos else b""
        if done is None:
            hooks.write(conn, ack)
        else:
            self._work.after(done, conn, ack, (topic, payload))
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
        done = self._accept(topic, payload, qos, props.get("dup"), int(bool(props.get("retain"))))
        ack = codec.ack(ACK_CMD[qos], mid)
        if done is None:
            hooks.write(conn, ack)
            return
        self._work.after(done, conn, ack, (topic, payload))

    def _on_message_qos0(
        self, client: Any, topic: str | bytes, payload: bytes, qos: int, properties: dict[str, Any]
    ) -> None:
        done = self._accept(topic, payload, qos, properties.get("dup"), int(bool(properties.get("retain"))))
        if done is not None:
            self._work.after(done, None, b"", (topic, payload))
