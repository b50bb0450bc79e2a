"""Deliver: inbox -> MQTT, QoS1, marked delivered only after the broker's PUBACK.

* A separate gmqtt client (``iggy-edge-{gateway}-deliver``): ingest's session
  has its own client id, subscriptions and in-flight window, and a publish
  waiting for PUBACK must not hold up acknowledging device messages.  Clean
  start: the inbox, not the broker session, is what remembers undelivered
  commands, so a fresh connection simply publishes them again.
* PUBACK.  gmqtt's ``publish`` returns nothing; it stores each QoS1 packet in
  its ``persistent_storage`` (a constructor argument) under the packet id and
  removes it when the PUBACK arrives.  `PubackTracker` is that storage: it
  learns the packet id at ``push_message`` and resolves a future at
  ``remove_message_by_mid``.  gmqtt 0.8 does not parse the MQTT 5 PUBACK
  reason code, so the tracker reads it through a checked hook
  (`gmqtt_hooks.on_puback`, next to ingest's): a code of 0x80 or above
  (for example 0x87, not authorized) marks the command failed instead of
  delivered.  tests/test_downlink_deliver.py checks both
  against Mosquitto.
* Order: commands go out oldest first (inbox seq), up to `deliver_window`
  in flight on one connection; MQTT keeps one connection's QoS1 messages on a
  topic in order.  If a PUBACK does not come within `publish_timeout_s` the
  connection is dropped and everything unacknowledged is published again,
  in order, on the next one (at-least-once; the device drops repeats by
  command id).
* Poison: a publish the broker answers by dropping the connection (a
  PUBLISH it cannot take, e.g. over its ``max_packet_size``) must not block
  the queue, since everything unacknowledged goes out again oldest first.
  So after a lost connection the publishes that were unacknowledged become
  suspects (inflight.py), and each suspect is published alone, with nothing
  else in flight.  A suspect in flight alone when the connection is lost
  again gets a strike; at `POISON_STRIKES` it is marked ``failed`` (its
  reason in the detail, counted) and the others go on; an acknowledged
  suspect is cleared.  A row whose device is not a device id (device_ids.py;
  the poll lets none in, the inbox is only written by us) is failed without
  publishing it.
* Expiry: a command whose `expires_at` has passed is not published; it is
  marked expired and counted, also while the broker is unreachable.
* Config: the newest desired config per device is published retained on
  ``down/config``; the broker keeps only the last retained message per
  topic, so a device that subscribes later gets exactly that one.
* Restore: a config row marked ``republish`` (the broker lost its retained
  messages, or ``iggy-edge config republish``) is published again, in
  device order, at most ``republish_rate`` per second, after new configs
  and commands of the same round (a restore never holds them up), counted
  in ``iggy_edge_config_republished_total``.  Every config publish carries
  its id as the MQTT 5 user property ``config_id`` (devices on MQTT 3.1.1
  do not see it; the broker retains it with the message).
* Recent configs after a lost connection: a broker that crashed after an
  autosave comes back with the sessions (so ingest sees nothing amiss) but
  without what changed since.  So when this connection was lost (the broker
  went away, or stopped acknowledging), the configs delivered within
  ``republish_recent_s`` before the loss are marked for a restore on the
  next connection.  Usually the broker still has them: publishing the same
  retained payload again changes nothing, and the device library drops an
  identical config.
* Unknown devices: the agent does not keep a device registry; every command
  is published.  Without a subscriber (and no persistent session of the
  device) the broker drops it after the PUBACK: the command stays
  ``delivered`` and never becomes ``acked``, which is what the cloud side
  sees.  See docs/return-path.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Final

import gmqtt

from .. import gmqtt_hooks as hooks
from ..config import Settings
from ..device_ids import device_id_problem
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..mqtt_codec import REFUSED
from ..mqttconn import close, connect, keep_session, set_credentials, wait_first
from ..timeouts import wait_for
from .commands import CommandState, deliver_client_id
from .inbox import Inbox
from .inbox_rows import PendingCommand, PendingConfig
from .inbox_schema import REPUBLISH
from .inflight import POISON_STRIKES, BrokerLost, PubackTracker, Suspects

log = logging.getLogger(__name__)

SWEEP_INTERVAL_S: Final = 1.0
REPUBLISH_TICK_S: Final = 0.1  # a restore publishes in chunks of rate * this
CONFIG_ID_PROPERTY: Final = "config_id"


def _config_key(c: PendingConfig) -> str:
    return f"cfg:{c.device}:{c.id}"


class Deliverer:
    def __init__(self, settings: Settings, inbox: Inbox, metrics: Metrics) -> None:
        self.reconfigure(settings)
        self._mqtt = settings.mqtt
        self._inbox = inbox
        self._metrics = metrics
        self._limited = RateLimitedLog(log)
        self._wakeup = asyncio.Event()
        self._lost = asyncio.Event()
        self._republish_at = 0.0  # monotonic time the next restore chunk may go
        self._lost_at: float | None = None  # wall time the last connection was lost
        # Wall time the current connection was made (None while disconnected):
        # a config delivered since then is already at this broker.
        self.connected_since: float | None = None
        self.connected = asyncio.Event()
        self._suspects = Suspects()

    def reconfigure(self, settings: Settings) -> None:
        """Timeouts and republish pacing from `settings` (a reload)."""
        self._settings = settings
        self._dl = settings.downlink

    def wake(self) -> None:
        """Something new is in the inbox."""
        self._wakeup.set()

    # -- connection -----------------------------------------------------------

    async def run(self) -> None:
        """Deliver until cancelled; reconnect with backoff (mqttconn.keep_session);
        expire meanwhile."""
        await keep_session(
            self._mqtt,
            name="deliver",
            open_session=self._connect,
            serve=self._serve,
            close_session=self._close,
            pause=self._idle,
            limited=self._limited,
            meanwhile="; commands wait",
        )

    async def _connect(self) -> tuple[gmqtt.Client, PubackTracker]:
        await self._sweep_expired()
        tracker = PubackTracker()
        client = gmqtt.Client(
            deliver_client_id(self._settings), clean_session=True, persistent_storage=tracker
        )
        tracker.hook_reason_codes(client)
        hooks.own_reconnect(client, self._lost.set)  # we reconnect ourselves, with backoff
        client.on_disconnect = lambda *_: self._lost.set()
        set_credentials(client, self._mqtt)
        self._lost.clear()
        try:
            await connect(client, self._mqtt)  # closes the client when it fails
        except BaseException:
            tracker.fail_all()
            raise
        return client, tracker

    async def _close(self, session: tuple[gmqtt.Client, PubackTracker]) -> None:
        client, tracker = session
        tracker.fail_all()
        await close(client)

    async def _serve(self, session: tuple[gmqtt.Client, PubackTracker]) -> bool:
        self.connected_since = time.time()
        self.connected.set()
        log.info("deliver: connected to %s:%d", self._mqtt.host, self._mqtt.port)
        try:
            await self._restore_recent()
            await self._deliver_while_connected(*session)
        except BrokerLost as e:
            self._limited.warning("deliver-lost", "deliver: %s; unacknowledged commands go out again", e)
        finally:
            self.connected.clear()
            self.connected_since = None
            self._lost_at = time.time()
        return True

    async def _restore_recent(self) -> None:
        """After a lost connection: mark the configs delivered shortly before
        the loss for publishing again (see the module docstring)."""
        lost_at, self._lost_at = self._lost_at, None
        window = self._dl.republish_recent_s
        if lost_at is None or window <= 0:
            return
        marked = await self._inbox.mark_republish(since=lost_at - window, before=self.connected_since)
        if marked:
            log.info(
                "deliver: publishing again %d configs delivered in the %ds before the connection was lost"
                " (a crashed broker keeps only its last autosave)",
                marked,
                window,
            )

    async def _idle(self, delay: float) -> bool:
        """Wait `delay`, still expiring commands every second (never stopping:
        a cancellation ends the deliverer)."""
        deadline = time.monotonic() + delay
        while (left := deadline - time.monotonic()) > 0:
            await asyncio.sleep(min(left, SWEEP_INTERVAL_S))
            await self._sweep_expired()
        return False

    # -- delivery -----------------------------------------------------------------

    async def _deliver_while_connected(self, client: gmqtt.Client, tracker: PubackTracker) -> None:
        window = self._dl.deliver_window
        while True:
            if self._lost.is_set():
                raise BrokerLost("connection lost")
            self._wakeup.clear()
            if await self._inbox.nothing_due():  # at rest: one cheap look a second
                self._metrics.inbox_records.set(0)
                with contextlib.suppress(TimeoutError):  # the poll's store wakes it at once
                    await wait_for(wait_first(self._wakeup, self._lost), SWEEP_INTERVAL_S)
                continue
            configs = await self._inbox.due_configs(window)
            if configs:
                await self._publish_configs(client, tracker, configs)
            commands = await self._inbox.due_commands(window)
            if commands:
                await self._publish_commands(client, tracker, commands)
            pause = await self._republish_some(client, tracker)
            if not commands and not configs and pause != 0.0:
                await self._refresh_gauge()
                timeout = SWEEP_INTERVAL_S if pause is None else min(pause, SWEEP_INTERVAL_S)
                with contextlib.suppress(TimeoutError):
                    await wait_for(wait_first(self._wakeup, self._lost), timeout)
                await self._sweep_expired()

    async def _republish_some(self, client: gmqtt.Client, tracker: PubackTracker) -> float | None:
        """Publish the next chunk of a restore when the rate allows: None when
        no config waits for it, 0 after publishing, else the seconds until the
        rate allows the next chunk.  The budget does not pile up while idle:
        at most one chunk goes out at once."""
        now = time.monotonic()
        if now < self._republish_at:
            return self._republish_at - now
        rate = self._dl.republish_rate
        chunk = max(1, min(self._dl.deliver_window, int(rate * REPUBLISH_TICK_S)))
        due = await self._inbox.due_republish(chunk)
        if not due:
            return None
        self._republish_at = now + len(due) / rate
        await self._publish_configs(client, tracker, due)
        return 0.0

    def _publish(
        self,
        client: gmqtt.Client,
        tracker: PubackTracker,
        topic: str,
        payload: bytes,
        *,
        retain: bool,
        config_id: str | None = None,
    ) -> asyncio.Future[int]:
        tracker.last_mid = None
        props = {} if config_id is None else {"user_property": [(CONFIG_ID_PROPERTY, config_id)]}
        try:
            client.publish(topic, payload, qos=1, retain=retain, **props)
        except (OSError, RuntimeError, AttributeError) as e:
            raise BrokerLost(f"publish failed: {e}") from e
        mid = tracker.last_mid
        if mid is None:
            raise BrokerLost("publish was not queued")
        return tracker.wait_for(mid)

    async def _await_pubacks(self, futures: list[asyncio.Future[int]]) -> list[str]:
        """Outcome per publish, in order, up to the first that was not
        acknowledged in time: "" when the broker took it, else why it refused
        it.  Those after a missing PUBACK are left out, to keep per-device
        order: they go out again after reconnecting."""
        if futures:
            # Until every PUBACK is in, the connection is lost, or the timeout.
            lost = asyncio.ensure_future(self._lost.wait())
            acked = asyncio.ensure_future(asyncio.wait(futures))
            try:
                await asyncio.wait(
                    [acked, lost], timeout=self._dl.publish_timeout_s, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                lost.cancel()
                acked.cancel()
        out: list[str] = []
        for f in futures:
            if not (f.done() and not f.cancelled() and f.exception() is None):
                f.cancel()
                break
            code = f.result()
            out.append(f"broker refused the publish: reason 0x{code:02x}" if code >= REFUSED else "")
        for f in futures[len(out) :]:
            f.cancel()
        return out

    async def _publish_commands(
        self, client: gmqtt.Client, tracker: PubackTracker, commands: list[PendingCommand]
    ) -> None:
        now = time.time()
        done: list[tuple[str, CommandState, str]] = [
            (c.id, CommandState.EXPIRED, "expired before delivery") for c in commands if now >= c.expires_at
        ]
        live: list[PendingCommand] = []
        for c in commands:
            if now >= c.expires_at:
                continue
            refused = self._refuse(f"cmd:{c.id}", c.device)
            if refused:
                done.append((c.id, CommandState.FAILED, refused))
                log.warning("deliver: command %s for %r failed: %s", c.id, c.device, refused)
            else:
                live.append(c)
        if done:
            await self._finish(done)
        live = live[: self._suspects.careful([f"cmd:{c.id}" for c in live])]
        outcomes = await self._publish_all(
            client,
            tracker,
            [(f"cmd:{c.id}", self._settings.topics.command(c.device), c.payload, None) for c in live],
        )
        updates: list[tuple[str, CommandState, str]] = []
        delivered = 0
        for c, refused in zip(live, outcomes, strict=False):
            if refused:
                updates.append((c.id, CommandState.FAILED, refused))
                log.warning("deliver: command %s for %s: %s", c.id, c.device, refused)
            else:
                updates.append((c.id, CommandState.DELIVERED, ""))
                delivered += 1
        # Counted when the broker acknowledged, even if the device's ack got
        # recorded first (then the row is already `acked`).
        self._metrics.commands.labels(CommandState.DELIVERED.value).inc(delivered)
        await self._finish(updates, count_delivered=False)
        if len(updates) < len(live):
            raise BrokerLost(f"no PUBACK within {self._dl.publish_timeout_s}s")

    def _refuse(self, key: str, device: str) -> str:
        """Why this publish is not made (failed instead): a device that is
        not a device id, or `POISON_STRIKES` lost connections; else ""."""
        problem = device_id_problem(device)
        if problem is not None:
            return f"not published: {problem}"
        strikes = self._suspects.strikes(key)
        if strikes >= POISON_STRIKES:
            self._suspects.done(key)
            return (
                f"the broker dropped the connection each of the {strikes} times it was published alone"
                " (a PUBLISH the broker cannot take, e.g. over its max_packet_size)"
            )
        return ""

    async def _publish_all(
        self,
        client: gmqtt.Client,
        tracker: PubackTracker,
        items: list[tuple[str, str, bytes, str | None]],
    ) -> list[str]:
        """Publish (key, topic, payload, config id or None for a command) and
        wait for the PUBACKs: `_await_pubacks`'s outcomes.  On a lost
        connection the unacknowledged ones become suspects (inflight.py)."""
        futures: list[asyncio.Future[int]] = []
        try:
            for _, topic, payload, config_id in items:
                futures.append(
                    self._publish(
                        client, tracker, topic, payload, retain=config_id is not None, config_id=config_id
                    )
                )
        except BrokerLost:
            self._lost_with([k for k, *_ in items[: len(futures) + 1]])
            raise
        outcomes = await self._await_pubacks(futures)
        for key, *_ in items[: len(outcomes)]:
            self._suspects.done(key)
        if len(outcomes) < len(items):
            self._lost_with([k for k, *_ in items[len(outcomes) :]])
        return outcomes

    def _lost_with(self, keys: list[str]) -> None:
        struck = self._suspects.lost(keys)
        if struck is not None:
            self._metrics.downlink_errors.labels("publish_dropped").inc()
            self._limited.warning(
                "deliver-poison",
                "deliver: the connection was lost with only %s in flight (%d of %d times: then it fails)",
                struck,
                self._suspects.strikes(struck),
                POISON_STRIKES,
            )

    async def _publish_configs(
        self, client: gmqtt.Client, tracker: PubackTracker, configs: list[PendingConfig]
    ) -> None:
        failed: list[tuple[PendingConfig, str, str]] = []
        live: list[PendingConfig] = []
        for c in configs:
            refused = self._refuse(_config_key(c), c.device)
            if refused:
                failed.append((c, "failed", refused))
                log.warning("deliver: config %s for %r failed: %s", c.id, c.device, refused)
            else:
                live.append(c)
        if failed:
            await self._inbox.finish_configs(failed)
        live = live[: self._suspects.careful([_config_key(c) for c in live])]
        outcomes = await self._publish_all(
            client,
            tracker,
            [
                (
                    f"cfg:{c.device}:{c.id}",
                    self._settings.topics.config(c.device),
                    c.payload,
                    c.id,
                )
                for c in live
            ],
        )
        updates = [
            (c, "failed" if refused else "delivered", refused)
            for c, refused in zip(live, outcomes, strict=False)
        ]
        await self._inbox.finish_configs(updates)
        restored = sum(1 for c, state, _ in updates if c.state == REPUBLISH and state == "delivered")
        if restored:
            self._metrics.config_republished.inc(restored)
            log.debug("deliver: %d configs published again (restore)", restored)
        if len(updates) < len(live):
            raise BrokerLost(f"no PUBACK within {self._dl.publish_timeout_s}s")

    async def _finish(
        self, updates: list[tuple[str, CommandState, str]], *, count_delivered: bool = True
    ) -> None:
        done = await self._inbox.finish(updates)
        for _, state in done:
            if state is not CommandState.DELIVERED or count_delivered:
                self._metrics.commands.labels(state.value).inc()
        await self._refresh_gauge()

    async def _sweep_expired(self) -> None:
        """Expire waiting commands whose time is up (also while disconnected);
        no statement when none can wait, no write when none waits."""
        if self._inbox.no_command_waits or await self._inbox.nothing_due():
            return
        expired = await self._inbox.expire_due()
        if expired:
            self._metrics.commands.labels(CommandState.EXPIRED.value).inc(expired)
            await self._refresh_gauge()
            log.info("deliver: %d commands expired in the inbox before delivery", expired)

    async def _refresh_gauge(self) -> None:
        self._metrics.inbox_records.set(await self._inbox.waiting())
