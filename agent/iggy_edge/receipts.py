"""Delivery receipts: tell each device which of its readings the gateway holds
durably, so the device keeps a reading in its flash ring until then (not only
until the broker's PUBACK).  See docs/receipts.md.

* What: after a group commit, for each device that had records in it, the
  newest record now durable, named by its device ``seq`` and the CRC-32 of
  its payload: ``{"seq": n, "crc": c}``.  The CRC is what tells sequences
  apart: a device that reset its sequence (a new board, a damaged seq file)
  holds no record with that seq *and* CRC, so an old receipt releases
  nothing there (device/iggy_device/receipts.py).
* When: at most one per device per ``min_interval_ms`` (200 ms); a reading
  that arrives inside the window is covered by one trailing receipt at the
  window's end, so the last reading of a burst always gets its receipt.
* Where and how: the layout's receipt topic (topics.py,
  ``edge/{device}/down/receipt``, inside the
  device's own down/ tree, which the packaged ACL lets it read and the agent
  write), QoS0, retained, on ingest's MQTT session.  Retained: a device that
  (re)connects gets its current receipt with its SUBSCRIBE, without a request
  protocol; the broker keeps one small message per device (about 100 bytes
  with the topic: ~100 kB for 1,000 devices) and writes it at autosave.
  QoS0: a lost receipt is superseded by the next one or by the retained copy
  at the next connect, while QoS1 would make the broker queue every receipt
  for each offline persistent device session (up to max_queued_messages per
  device) and add a PUBACK per receipt.
* Mode ``committed`` (default): the receipt follows the SQLite commit.  Mode
  ``iggy``: it follows Iggy's confirmation (`confirm_tap` wraps the outbox
  the forwarder confirms through), for devices whose rings can hold an
  uplink outage.
* A record the device sends again (it keeps held readings across a
  reconnect) is recognised by ingest by (topic, seq, CRC) -- not only when
  the broker marks it DUP -- stored once, keeps its id, and gets its receipt
  again (`observe_copy`).
* Cost on ingest: one call per group commit (a dict update per message in
  it); per device and group commit one topic split, seq parse and CRC-32; the
  publishes are throttled (bench/ingest_bench.py, scenario
  ``qos1-full-receipts-off``).  Recognising re-sent readings (above) costs
  ingest one lookup per message in the store's redelivery window.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Final

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from .config import ReceiptSettings
from .logs import RateLimitedLog
from .metrics import Metrics
from .records import HEADER_DEVICE_SEQ, HEADER_MQTT_TOPIC, OutboundRecord
from .stages import OutboxReader, Publish
from .store import device_seq_of
from .topics import DEFAULT, TopicLayout

log = logging.getLogger(__name__)

# Device states kept at most (one small object each); beyond, the idlest
# fully receipted ones are forgotten first (their receipt stays retained in
# the broker).
MAX_DEVICES: Final = 100_000
IDLE_FORGET_S: Final = 600.0
HOUSEKEEPING_S: Final = 5.0

NOTHING: Final = b'{"seq":-1}'  # "listening, nothing of yours is durable here" (never retained)
_OnConfirmed = Callable[[Sequence[OutboundRecord]], None]


@dataclass(slots=True)
class _Device:
    topic: str  # where its receipts go
    seq: int = -1  # the newest durable record, not yet receipted (-1: none)
    crc: int = 0
    since: float = 0.0  # monotonic: when the oldest record it covers became durable
    sent_at: float = -1e9  # monotonic: the last receipt published
    committed_at: float = 0.0  # monotonic: the last record committed (iggy mode: not yet confirmed)
    timer: asyncio.TimerHandle | None = None
    unconfirmed: int = 0  # iggy mode: records committed and not yet confirmed
    last: bytes = NOTHING  # the last receipt published

    @property
    def pending(self) -> bool:
        return self.seq >= 0


class Receipts:
    """Receipt state per device and its publishing; ingest calls
    `observe_group` once per group commit."""

    def __init__(
        self, settings: ReceiptSettings, metrics: Metrics, publish: Publish, topics: TopicLayout = DEFAULT
    ) -> None:
        self._settings = settings
        self._metrics = metrics
        self._publish = publish
        self._interval = settings.min_interval_ms / 1000
        self._iggy = settings.mode == "iggy"
        self._topics = topics  # readings on .up(D, ...), receipts to .receipt(D)
        self._devices: dict[str, _Device] = {}
        self._limited = RateLimitedLog(log)
        metrics.registry.register(_Collector(self))

    def reconfigure(self, settings: ReceiptSettings) -> None:
        """A reload (reload.py) changes only the interval; the rest needs a restart."""
        self._settings = settings
        self._interval = settings.min_interval_ms / 1000

    # -- what ingest and the forwarder tell us -----------------------------

    def observe_group(self, messages: Sequence[tuple[str, bytes]]) -> None:
        """The messages of a group commit, now durable in the outbox, in
        arrival order.  Quick and never raising: it runs in ingest's
        acknowledgement, once per group.  Only the newest message per topic
        matters for the receipt: one parse, one CRC and one receipt decision
        per device and group instead of per message."""
        if self._iggy:
            for topic, payload in messages:
                self._observe(topic, payload)  # every record counts until Iggy confirms it
            return
        newest: dict[str, bytes] = {}
        for topic, payload in reversed(messages):
            if topic not in newest:
                newest[topic] = payload
        for topic, payload in reversed(newest.items()):  # oldest first: a device's newest wins
            self._observe(topic, payload)

    def observe(self, topic: str, payload: bytes) -> None:
        """One message is durable in the outbox (or was, and came again)."""
        self.observe_group(((topic, payload),))

    def _observe(self, topic: str, payload: bytes) -> None:
        dev_id = self._device_of(topic)
        if dev_id is None:
            if payload == b"online":
                self._online(topic)
            return
        seq = device_seq_of(payload)
        if seq is None:
            return
        dev = self._device(dev_id)
        now = time.monotonic()
        if self._iggy:
            dev.committed_at = now
            dev.unconfirmed += 1
            return
        self._covered(dev, seq, zlib.crc32(payload), now)

    def observe_copy(self, topic: str, payload: bytes) -> None:
        """A device sent a reading again that is already durable (its
        receipt may have been lost): receipt it again.  In mode iggy only
        when nothing of the device waits for Iggy and a receipt was sent in
        this run (it is still true); otherwise the next confirmed reading
        brings one, or the device falls back after its receipt_timeout_ms."""
        if not self._iggy:
            self.observe(topic, payload)
            return
        dev_id = self._device_of(topic)
        dev = None if dev_id is None else self._devices.get(dev_id)
        if dev is None or dev.unconfirmed or dev.pending or dev.last is NOTHING:
            return
        if self._publish(dev.topic, dev.last, True):
            self._metrics.receipts_sent.inc()

    def confirmed(self, records: Sequence[OutboundRecord]) -> None:
        """Iggy confirmed these records (mode iggy; per device they are
        confirmed in the order they were committed)."""
        now = time.monotonic()
        for r in records:
            topic = r.headers.get(HEADER_MQTT_TOPIC)
            raw_seq = r.headers.get(HEADER_DEVICE_SEQ)
            if topic is None or raw_seq is None:
                continue
            dev_id = self._device_of(topic)
            if dev_id is None:
                continue
            dev = self._device(dev_id)
            dev.unconfirmed = max(0, dev.unconfirmed - 1)
            self._covered(dev, int(raw_seq), zlib.crc32(r.payload), now)

    def confirm_tap(self, outbox: OutboxReader) -> OutboxReader:
        """The outbox as the forwarder sees it, telling us what Iggy confirmed."""
        return _ConfirmTap(outbox, self.confirmed)

    # -- state ---------------------------------------------------------------

    def _device_of(self, topic: str) -> str | None:
        return self._topics.device_of_up(topic)

    def _online(self, topic: str) -> None:
        """A device (re)connected: it sends nothing until a receipt shows the
        gateway listens (device/iggy_device/receipts.py), so send it one now."""
        dev_id = self._topics.device_of_status(topic)
        if dev_id is None:
            return
        dev = self._device(dev_id)
        if dev.pending:
            self._send(dev, time.monotonic())
        elif self._publish(dev.topic, dev.last, dev.last is not NOTHING):
            self._metrics.receipts_sent.inc()

    def _device(self, dev_id: str) -> _Device:
        dev = self._devices.get(dev_id)
        if dev is None:
            if len(self._devices) >= MAX_DEVICES:
                self._forget(time.monotonic(), keep=MAX_DEVICES - 1)
            dev = self._devices[dev_id] = _Device(self._topics.receipt(dev_id))
        return dev

    def _covered(self, dev: _Device, seq: int, crc: int, now: float) -> None:
        if not dev.pending:
            dev.since = now
        dev.seq, dev.crc = seq, crc
        wait = dev.sent_at + self._interval - now
        if wait <= 0:
            self._send(dev, now)
        elif dev.timer is None:
            dev.timer = asyncio.get_running_loop().call_later(wait, self._trailing, dev)

    def _trailing(self, dev: _Device) -> None:
        dev.timer = None
        if dev.pending:
            self._send(dev, time.monotonic())

    def _send(self, dev: _Device, now: float) -> None:
        payload = b'{"seq":%d,"crc":%d}' % (dev.seq, dev.crc)
        if not self._publish(dev.topic, payload, True):
            # no MQTT session now: try again after the interval
            if dev.timer is None:
                dev.timer = asyncio.get_running_loop().call_later(
                    max(self._interval, 0.05), self._trailing, dev
                )
            return
        self._metrics.receipts_sent.inc()
        self._metrics.receipts_lag.observe(now - dev.since)
        dev.sent_at = now
        dev.last = payload
        dev.seq = -1

    def _forget(self, now: float, keep: int = MAX_DEVICES) -> None:
        idle = [
            (d.sent_at, k)
            for k, d in self._devices.items()
            if not d.pending and d.unconfirmed == 0 and d.timer is None and now - d.sent_at > IDLE_FORGET_S
        ]
        if len(self._devices) > keep:
            idle.sort()
            idle = idle[: len(self._devices) - keep] if len(idle) > len(self._devices) - keep else idle
        for _, k in idle:
            del self._devices[k]

    # -- figures -------------------------------------------------------------

    def unreceipted(self, now: float | None = None) -> dict[str, float]:
        """Devices holding readings the gateway has not receipted yet, with
        the age in seconds of the oldest such reading the gateway knows of."""
        now = time.monotonic() if now is None else now
        out: dict[str, float] = {}
        for k, d in self._devices.items():
            if d.pending:
                out[k] = now - d.since
            elif d.unconfirmed:
                out[k] = now - d.committed_at
        return out

    async def run(self) -> None:
        """Housekeeping: forget long-idle devices; cancel timers on exit."""
        try:
            while True:
                await asyncio.sleep(HOUSEKEEPING_S)
                self._forget(time.monotonic())
        finally:
            for d in self._devices.values():
                if d.timer is not None:
                    d.timer.cancel()
                    d.timer = None


class _Collector(Collector):
    def __init__(self, receipts: Receipts) -> None:
        self._r = receipts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        held = self._r.unreceipted()
        yield GaugeMetricFamily(
            "iggy_edge_receipts_devices_unreceipted",
            "Devices holding readings that are durable here but not receipted yet",
            value=len(held),
        )
        per = GaugeMetricFamily(
            "iggy_edge_receipts_unreceipted_age_seconds",
            "Per device holding unreceipted readings: age of the oldest one the gateway knows of",
            labels=["device"],
        )
        for dev, age in sorted(held.items()):
            per.add_metric([dev], age)
        yield per

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())


class _ConfirmTap:
    """An `OutboxReader` that passes everything to the outbox and tells
    receipts which records Iggy confirmed."""

    def __init__(self, outbox: OutboxReader, on_confirmed: _OnConfirmed) -> None:
        self._outbox = outbox
        self._on_confirmed = on_confirmed

    @property
    def records(self) -> int:
        return self._outbox.records

    @property
    def bytes(self) -> int:
        return self._outbox.bytes

    async def wait_for_data(self, timeout: float | None = None) -> bool:
        return await self._outbox.wait_for_data(timeout)

    async def wait_for_more(self, timeout: float | None = None) -> bool:
        return await self._outbox.wait_for_more(timeout)

    async def read_batch(self, max_records: int, max_bytes: int, after: int = 0) -> list[OutboundRecord]:
        return await self._outbox.read_batch(max_records, max_bytes, after)

    async def confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        n = await self._outbox.confirm(batch, confirmed)
        self._on_confirmed(batch if confirmed is None else [r for r in batch if r.seq in confirmed])
        return n
