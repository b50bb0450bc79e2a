"""Return poll: this gateway's return-path topic in Iggy -> inbox.

* Reads ``{return_topic}.{gateway}`` in stream ``{stream_prefix}-{n}``
  (commands.py, "Addressing") through `CommandSource`: one partition, from
  the offset after the last one stored in SQLite.  Each message's ``kind``
  header says command, config or board update (`message_kind`, untrusted: a
  missing or unknown kind is a dead letter, ``invalid_command``).  An ``ota``
  message goes to the `OtaSink` (ota/cloud.py): stored durably before the
  offset is committed, or refused with a reason (a dead letter).  After an
  upgrade, what is pending in the two-topic scheme is read first (legacy.py).
* Each poll's messages and the new offset are committed in one transaction
  (inbox.py); only then is the offset mirrored to the server (mirror.py:
  bounded by `mirror_timeout_s`, best effort, retried after a backoff:
  SQLite, not the server, says where to resume).
* Every payload goes through `read_command` / `read_config` (commands.py,
  the trust boundary, never raising): an invalid one is dead-lettered
  (reason ``invalid_command``) and its offset consumed like any other, so
  one bad message cannot block the partition.  So is one the inbox insert refuses (`RowRefused`; the rest of
  the batch is stored), and a config for a device beyond
  ``max_config_devices`` (reason ``too_many_config_devices``).  A dead letter
  is committed first (the outbox's `DeadLetterSink`); a crash before the
  offset commit re-reads it and may dead-letter it twice (never loses it).
* Backpressure: when `max_inbox` commands wait for delivery, the poll
  consumes no further command: it stops at the first one (configs before it
  are taken); it and everything after it stay in Iggy, in order, and the
  pause is counted (``iggy_edge_downlink_inbox_full``).
* The agent never creates the topic (cloud/provision.py); a missing one, seen
  at start, is an error naming the provisioning command, retried.
* Iggy down: polls fail (bounded), are counted and retried with backoff spent
  probing (`probe.py`: what the probes saw carries from one wait to the
  next, and the backoff starts afresh when they find Iggy back); delivery
  from the inbox goes on.

Cadence: a poll of one partition is the cheapest look there is, so it just
polls (board updates ride along: no request of their own).  Quiet, every
``poll_interval_s`` (1.0 s: one request/s), measured start to start.
Commands come in bursts: for ``HOT_INTERVALS`` intervals after a round that
got a message it polls ``HOT_POLLS_PER_INTERVAL`` times per interval; while
messages come in, a round follows at once (bench/command_latency_bench.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, Final, Protocol

from ..backoff import backoff_delay
from ..config import Settings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..probe import Link, backoff_wait
from ..stages import DeadLetterSink
from ..uplink.protocol import CommandSource, PolledMessage, UplinkError, UplinkRejected
from .commands import (
    INVALID_COMMAND,
    KIND_COMMAND,
    KIND_OTA,
    Command,
    CommandState,
    DesiredConfig,
    Refused,
    message_kind,
    printable,
    read_command,
    read_config,
    return_topic,
)
from .inbox import Inbox
from .inbox_rows import RowRefused, StoredBatch
from .legacy import DRAINED_NOTE, Partition, find_legacy
from .mirror import OffsetMirror

log = logging.getLogger(__name__)

TOO_MANY_CONFIG_DEVICES: Final = "too_many_config_devices"
BACKOFF_MAX_S: Final = 30.0
HOT_POLLS_PER_INTERVAL: Final = 20  # polls per poll_interval_s while messages come in
HOT_INTERVALS: Final = 3  # poll intervals after the last message that count as "coming in"


class ReturnTopicMissing(UplinkRejected):
    """The gateway's return-path topic is not on the server (not provisioned)."""


class OtaSink(Protocol):
    """Takes a ``kind = ota`` message: stored durably (None) or refused."""

    async def take(self, payload: bytes, stream: str, topic: str, offset: int) -> Refused | None: ...


class ReturnPoll:
    def __init__(
        self,
        settings: Settings,
        source: CommandSource,
        inbox: Inbox,
        dead_letters: DeadLetterSink,
        metrics: Metrics,
        *,
        on_stored: Callable[[], None] = lambda: None,
        ota: OtaSink | None = None,
    ) -> None:
        self.reconfigure(settings)
        self._source = source
        self._inbox = inbox
        self._dead_letters = dead_letters
        self._metrics = metrics
        self._on_stored = on_stored
        self._ota = ota
        self._limited = RateLimitedLog(log)
        rt = return_topic(settings)
        self.main = Partition(rt.stream, rt.topic, rt.partition, None)
        self.legacy: list[Partition] = []  # the old topics' partitions still to read out (legacy.py)
        self._stored: dict[tuple[str, str, int], tuple[int, int | None]] = {}
        self._last: dict[Partition, int] = {}
        self._mirror = OffsetMirror(source, inbox, metrics, self._limited)
        self._last_message = -float("inf")  # monotonic: when a round last got a message
        self._round_started = 0.0

    def reconfigure(self, settings: Settings) -> None:
        """Polling cadence, batch, inbox bound and TTL from `settings` (a reload)."""
        self._settings = settings
        self._dl = settings.downlink

    @property
    def partitions(self) -> list[Partition]:
        """What the next round polls: the old topics while they are read out, then the new one."""
        return self.legacy or [self.main]

    def _track(self, part: Partition) -> None:
        last, mirrored = self._stored.get((part.stream, part.topic, part.partition_id), (-1, None))
        self._last[part] = last
        self._mirror.mirrored[part] = mirrored

    async def run(self) -> None:
        self._stored = await self._inbox.offsets()
        self._track(self.main)
        migrate = self._dl.migrate_legacy and await self._inbox.note(DRAINED_NOTE) is None
        log.info(
            "return poll: resuming %s/%s at %d", self.main.stream, self.main.topic, self._last[self.main] + 1
        )
        failures = 0  # since the last good round or since a probe found Iggy back
        link = Link()
        started = False
        while True:
            try:
                if not started:
                    await self._source.start()
                    await self._check_topic()
                    if migrate:
                        await self._find_legacy()
                    started = True
                self._round_started = time.monotonic()
                got = await self._round()
            except UplinkError as e:
                self._metrics.downlink_errors.labels("poll").inc()
                delay = backoff_delay(failures, self._dl.poll_interval_s, BACKOFF_MAX_S)
                failures += 1
                if isinstance(e, UplinkRejected):  # the server answered: no probing
                    self._limited.error("rejected", "return poll: %s; retrying in %.1fs", e, delay)
                    await asyncio.sleep(delay)
                    continue
                self._limited.warning(
                    "poll",
                    "return poll: Iggy not reachable (%s); retrying in %.1fs; delivery goes on",
                    e,
                    delay,
                )
                if await backoff_wait(self._source, delay, link=link):
                    failures = 0
                    log.info("return poll: the probe reaches Iggy again; polling now")
                continue
            failures = 0
            link.down = False
            await self._mirror.mirror(self._last, self._dl.mirror_timeout_s)
            if not got:
                await asyncio.sleep(max(0.0, self._round_started + self._pause() - time.monotonic()))

    def _pause(self) -> float:
        """Seconds from one round's start to the next (module docstring: cadence)."""
        interval = self._dl.poll_interval_s
        if time.monotonic() - self._last_message < HOT_INTERVALS * interval:
            return interval / HOT_POLLS_PER_INTERVAL
        return interval

    async def _check_topic(self) -> None:
        """One look at the return-path topic at start: there, one partition."""
        part = self.main
        try:
            newest = await self._source.last_offsets(part.stream, part.topic)
        except UplinkRejected as e:
            log.warning("return poll: the server refuses a look at %s/%s (%s); polling on", *part.names, e)
            return
        if newest is None:
            raise ReturnTopicMissing(
                f"the return-path topic {part.stream}/{part.topic} does not exist: the agent does not create"
                f" it; provision the gateway from the cloud side with admin credentials:"
                f" iggy-edge cloud provision-gateway --gateway {self._settings.gateway_id}"
            )
        if len(newest) > 1:
            log.warning(
                "return poll: %s/%s has %d partitions; only partition %d is read (commands and configs"
                " must go to it: a device's order is kept by the single partition)",
                part.stream,
                part.topic,
                len(newest),
                part.partition_id,
            )

    async def _find_legacy(self) -> None:
        found = await find_legacy(self._settings, self._source)
        if found is None:
            return  # logged; tried again at the next start
        for part in found:
            self._track(part)
        self.legacy = found
        if found:
            log.info(
                "return poll: reading what is pending in the two-topic scheme's %s first (%d partitions)",
                ", ".join(sorted({f"{p.stream}/{p.topic}" for p in found})),
                len(found),
            )
        else:
            await self._legacy_done()

    async def _legacy_done(self) -> None:
        await self._inbox.set_note(DRAINED_NOTE, f"{time.time():.0f}")
        log.info("return poll: nothing (more) pending in the two-topic scheme's topics: no longer polled")

    async def _round(self) -> int:
        """Poll the partitions due; the number of messages consumed."""
        # Exact only when the room could hold this round back: an idle round is the poll alone.
        dl = self._dl
        room = dl.max_inbox - await self._inbox.waiting_at_most(dl.max_inbox - dl.poll_batch)
        total = 0
        empty: list[Partition] = []
        for part in self.partitions:
            if part.kind == KIND_COMMAND and room <= 0:
                self._inbox_full()
                continue
            polled = await self._poll_or_skip(part, room)
            if polled is None:
                if part in self.legacy:
                    self._abandon_legacy()
                    break
                continue
            got, commands = polled
            room -= commands
            total += got
            if got == 0:
                empty.append(part)
        if total:
            self._last_message = time.monotonic()
            self._metrics.inbox_records.set(await self._inbox.waiting())
        if self.legacy and len(empty) == len(self.legacy):
            self.legacy = []  # every old partition answered with nothing new
            await self._legacy_done()
        return total

    def _abandon_legacy(self) -> None:
        log.error(
            "return poll: the server refuses a poll of the two-topic scheme's topics (above): what is"
            " pending there is NOT delivered; polling the return-path topic now, the old topics again at"
            " the next start"
        )
        self.legacy = []

    def _inbox_full(self) -> None:
        self._metrics.downlink_inbox_full.inc()
        self._limited.warning(
            "inbox-full",
            "return poll: inbox full (%d commands wait for delivery): paused, commands stay in Iggy",
            self._dl.max_inbox,
        )

    async def _poll_or_skip(self, part: Partition, room: int) -> tuple[int, int] | None:
        """A partition the server refuses (missing, no permission) is logged
        and skipped (None); Iggy being unreachable raises and the round is
        retried with backoff."""
        try:
            return await self._poll(part, room)
        except UplinkRejected as e:
            self._metrics.downlink_errors.labels("poll").inc()
            self._limited.error(f"rejected:{part.topic}/{part.partition_id}", "return poll: %s", e)
            return None

    async def _poll(self, part: Partition, room: int) -> tuple[int, int]:
        """(messages consumed, commands among them).  With no `room` left, it
        stops before the first command (which stays in Iggy)."""
        start = self._last[part] + 1
        count = self._dl.poll_batch if part.kind is None else min(self._dl.poll_batch, max(room, 1))
        messages = await self._source.poll(part.stream, part.topic, part.partition_id, start, count)
        if not messages:
            return 0, 0
        if messages[0].offset > start:
            log.warning(
                "return poll: %s: offsets %d..%d are gone from Iggy (retention?); resuming at %d",
                part.source(start),
                start,
                messages[0].offset - 1,
                messages[0].offset,
            )
        now = time.time()
        commands: list[tuple[Command, str]] = []
        configs: list[tuple[DesiredConfig, str]] = []
        origin: dict[str, PolledMessage] = {}  # source -> message, for a dead letter later
        last, consumed = start - 1, 0
        for m in messages:
            kind = part.kind or message_kind(m.headers)
            if kind == KIND_COMMAND and len(commands) >= room:
                self._inbox_full()
                break
            last, consumed = m.offset, consumed + 1
            source = part.source(m.offset)
            got: Command | DesiredConfig | Refused
            if isinstance(kind, Refused):
                got = kind
            elif kind == KIND_OTA:
                taken = await self._take_ota(part, m)
                if taken is not None:
                    await self._dead_letter(part, m, taken.reason, taken.detail)
                continue
            elif kind == KIND_COMMAND:
                got = read_command(m.payload, now=now, default_ttl_s=self._dl.default_ttl_s)
            else:
                got = read_config(m.payload, now=now, fallback_id=f"offset-{m.offset}")
            if isinstance(got, Refused):
                await self._dead_letter(part, m, got.reason, got.detail)
            elif isinstance(got, Command):
                commands.append((got, source))
                origin[source] = m
            else:
                configs.append((got, source))
                origin[source] = m
        if not consumed:
            return 0, 0
        if configs:
            configs = await self._bound_configs(part, configs, origin)
        result = await self._store(part, last, commands, configs, origin, now)
        self._last[part] = last
        self._metrics.commands.labels(CommandState.RECEIVED.value).inc(result.new)
        self._metrics.commands.labels(CommandState.EXPIRED.value).inc(result.expired)
        if result.duplicates:
            log.info(
                "return poll: %d commands from %s were already in the inbox (same id): not delivered again",
                result.duplicates,
                part.source(last),
            )
        if result.new or result.configs:
            self._on_stored()
        return consumed, len(commands)

    async def _take_ota(self, part: Partition, m: PolledMessage) -> Refused | None:
        if self._ota is None:
            return Refused(INVALID_COMMAND, "a board update ('ota'), and this agent runs no updater")
        return await self._ota.take(m.payload, part.stream, part.topic, m.offset)

    async def _store(
        self,
        part: Partition,
        last: int,
        commands: list[tuple[Command, str]],
        configs: list[tuple[DesiredConfig, str]],
        origin: dict[str, PolledMessage],
        now: float,
    ) -> StoredBatch:
        """One transaction for the rest of the batch and the offset.  An item
        SQLite refuses for its own values (a parser gap) is dead-lettered and
        the others stored; a fault of the disk or file propagates (StoreError,
        sqlite3.OperationalError): the supervisor restarts the return path."""
        while True:
            try:
                return await self._inbox.store_polled(
                    part.stream, part.topic, part.partition_id, last, commands, configs, now=now
                )
            except RowRefused as e:
                items: list[Any] = commands if e.kind == "command" else configs
                _, source = items.pop(e.index)
                detail = printable(f"the inbox cannot store it: {type(e.error).__name__}: {e.error}")
                self._metrics.downlink_errors.labels("unstorable").inc()
                self._limited.error("unstorable", "return poll: %s: %s; dead-lettered", source, detail)
                await self._dead_letter(part, origin[source], INVALID_COMMAND, detail)

    async def _bound_configs(
        self,
        part: Partition,
        configs: list[tuple[DesiredConfig, str]],
        origin: dict[str, PolledMessage],
    ) -> list[tuple[DesiredConfig, str]]:
        """At most `max_config_devices` devices have a desired config (each one
        a retained message in the broker): a config for a device beyond them
        is dead-lettered (docs/return-path.md, "Bounds").  The poll is the
        only writer of new config rows, so the count cannot change meanwhile."""
        count, known = await self._inbox.config_devices(c.device for c, _ in configs)
        limit = self._dl.max_config_devices
        kept: list[tuple[DesiredConfig, str]] = []
        for cfg, source in configs:
            if cfg.device not in known:
                if count >= limit:
                    self._limited.warning(
                        "config-devices",
                        "return poll: %d devices have a desired config (downlink.max_config_devices):"
                        " the config for new device %s is dead-lettered",
                        limit,
                        cfg.device,
                    )
                    await self._dead_letter(
                        part,
                        origin[source],
                        TOO_MANY_CONFIG_DEVICES,
                        f"{limit} devices have a desired config already (downlink.max_config_devices);"
                        f" {cfg.device!r} is not one of them",
                    )
                    continue
                known.add(cfg.device)
                count += 1
            kept.append((cfg, source))
        return kept

    async def _dead_letter(self, part: Partition, m: PolledMessage, reason: str, detail: str) -> None:
        # A StoreError here propagates: the offset is not advanced and the
        # supervisor restarts the return path.
        await self._dead_letters.dead_letter(
            mqtt_topic=f"iggy:{part.stream}/{part.source(m.offset)}",
            payload=m.payload,
            qos=1,
            retain=False,
            reason=reason,
            detail=detail,
        )
