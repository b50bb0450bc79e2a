"""Ingest: the MQTT session (gmqtt) -> outbox, acknowledging only after commit.

* Persistent session: a fixed client id, clean start off and a session expiry
  above zero, so the broker keeps our subscriptions and queues QoS1/2 messages
  while the agent restarts (the shipped Mosquitto config raises
  `max_queued_messages` so that queue is deep enough).
* Acknowledge after commit: gmqtt runs with `optimistic_acknowledgement=False`
  and sends PUBACK/PUBREC when `on_message` returns; `on_message` returns only
  after the record's group commit.  A process killed before that gets the
  message again on reconnect.
* Order: gmqtt runs every message handler as its own task; the record is
  handed to the outbox synchronously, before the handler's first `await`, so
  arrival order is the outbox order.
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
import random
import ssl
import time
import zlib
from collections.abc import Callable
from typing import Any, Final

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError

from .config import Settings
from .logs import RateLimitedLog
from .metrics import Metrics
from .routing import Rejected, Router
from .store import Incoming, Outbox, StoreError, device_seq_of

log = logging.getLogger(__name__)

QOS0_PENDING_LIMIT: Final = 20_000
CONNECT_TIMEOUT_S: Final = 15.0
PUBACK_SUCCESS: Final = 0


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Capped exponential backoff with full jitter (AWS architecture blog)."""
    return random.uniform(0, min(cap, base * (2 ** min(attempt, 30))))  # noqa: S311 - jitter, not crypto


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
        self.connected = asyncio.Event()
        # Called with (topic, payload) for every message once its record is
        # committed, before the acknowledgement; the return path watches
        # device acks here.  Observers must be quick and must not raise.
        self.observers: list[Callable[[str, bytes], None]] = []

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
        client.on_message = self._on_message
        client.on_disconnect = self._on_disconnect
        if self._mqtt.username:
            password = self._mqtt.password.get_secret_value() if self._mqtt.password else None
            client.set_auth_credentials(self._mqtt.username, password)
        return client

    async def _on_lost(self, delay: bool = False) -> None:
        self._lost.set()

    def _on_disconnect(self, client: Any, packet: Any, exc: Any = None) -> None:
        self._lost.set()

    def _ssl_context(self) -> ssl.SSLContext | bool:
        if not self._mqtt.tls:
            return False
        return ssl.create_default_context(
            cafile=str(self._mqtt.tls_ca_file) if self._mqtt.tls_ca_file else None
        )

    async def run(self) -> None:
        """Keep the session up until `stop()`; reconnect with backoff."""
        attempt = 0
        while not self._stopping.is_set():
            client = self._make_client()
            self._lost.clear()
            try:
                await asyncio.wait_for(
                    client.connect(
                        self._mqtt.host,
                        self._mqtt.port,
                        ssl=self._ssl_context(),
                        keepalive=self._mqtt.keepalive_s,
                        version=MQTTv50,
                    ),
                    CONNECT_TIMEOUT_S,
                )
                for sub in self._mqtt.subscriptions:
                    client.subscribe(sub.filter, qos=sub.qos)
            except (OSError, TimeoutError, MQTTConnectError) as e:
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
        received_us = time.time_ns() // 1000
        retain = bool(properties.get("retain"))
        self._count_qos[qos].inc()
        self._metrics.ingest_bytes.inc(len(payload))
        route = self._router.route(topic, len(payload))
        if isinstance(route, Rejected):
            return await self._dead_letter(topic, payload, qos, retain, route, received_us)
        assert isinstance(topic, str)  # a bytes topic never routes
        if qos == 0 and self._outbox.pending_count >= QOS0_PENDING_LIMIT:
            self._metrics.dropped.labels("qos0_queue_full").inc()
            self._limited.warning(
                "qos0-full", "QoS0 message dropped: %d records wait for commit", QOS0_PENDING_LIMIT
            )
            return PUBACK_SUCCESS
        dseq = device_seq_of(payload)
        if properties.get("dup") and dseq is not None and self._outbox.seen(topic, dseq, zlib.crc32(payload)):
            log.info(
                "redelivered message on %s (device seq %d) was already committed: not stored twice",
                topic,
                dseq,
            )
            return PUBACK_SUCCESS
        done = self._outbox.submit(Incoming(route, topic, qos, retain, received_us, payload, dseq))
        try:
            await done
        except StoreError:
            # Do not acknowledge: hold the delivery until the session closes,
            # so the broker keeps the message and redelivers it later.
            self._store_broken.set()
            await self._stopping.wait()
            raise
        for observe in self.observers:
            observe(topic, payload)
        return PUBACK_SUCCESS

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
