"""Return poll: this gateway's command and config topics in Iggy -> inbox.

* Reads ``commands.<gateway>`` and ``config.<gateway>`` (commands.py) through
  `CommandSource`, partition by partition (``iggy.partitions`` of them), from
  the offset after the last one stored in SQLite.
* Each poll's messages and the new offset are committed in one transaction
  (inbox.py); only then is the offset mirrored to the Iggy server, bounded by
  `mirror_timeout_s` and best effort: a failed mirror is retried on the next
  round, and a mirror that lags never loses or repeats a command because
  SQLite, not the server, says where to resume.
* Every payload goes through the trust-boundary functions `read_command` /
  `read_config` (commands.py), which never raise: a payload that is not a
  valid command/config -- not JSON, a bad field, unencodable, too deep, a
  number too big -- is dead-lettered (reason ``invalid_command``) and its
  offset is consumed like any other, so one bad message cannot block a
  partition.  So is one the inbox insert refuses for its own values
  (`RowRefused`; the rest of the batch is stored), and a config for a device
  beyond ``max_config_devices`` (reason ``too_many_config_devices``).  A
  dead letter is committed first, on the outbox's connection (the
  `DeadLetterSink` it is given); a crash before the offset commit re-reads
  the message and may dead-letter it a second time (never loses it).
* Backpressure: when `max_inbox` commands wait for delivery, command
  partitions are not polled; the commands stay in Iggy and the pause is
  counted (``iggy_edge_downlink_inbox_full``).  A poll never takes more than
  the room left.
* Iggy down: polls fail (bounded by the adapter), are counted and retried
  with backoff; delivery of what is already in the inbox goes on.  A long
  backoff is spent probing the nodes (`probe.py`, a TCP connect every
  0.5-1 s), so polling resumes within about a second of the link returning.

Cadence (what it costs the Iggy server): a poll of an empty partition and a
look at a topic's partitions (`CommandSource.last_offsets`, one GET_TOPIC for
all of them) cost the server about the same, so the return poll looks before
it polls and polls only the partitions with something new.  The commands
topic is looked at every ``poll_interval_s / PROBES_PER_INTERVAL`` (0.2 s at
the default 1 s), the config topic every ``poll_interval_s``, and every
``FULL_ROUND_EVERY`` intervals every partition is polled regardless, in case
the server's figures ever lag.  A server that refuses the look (the user may
poll but not read topic details) gets the plain cadence: every partition
every ``poll_interval_s``.  Idle, that is 5 + 1 + 2n/20 requests per second
with n = ``iggy.partitions`` (6.3 at the default 3; polling every partition
each second was 2n = 6), and a command waits at most 0.2 s for its first
look instead of 1 s.  While messages come in, a round follows the previous
one at once, as before.  Commands come in bursts (an operator, a rule firing
for a group of devices), so for ``HOT_INTERVALS`` poll intervals after a
round that got a command the commands topic is looked at
``HOT_LOOKS_PER_INTERVAL`` times per interval (every 50 ms at the default):
20 looks a second while commands flow, back to 5 three seconds after the
last one.  bench/command_latency_bench.py prints the requests per second.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from ..backoff import backoff_delay
from ..config import Settings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..probe import backoff_wait
from ..stages import DeadLetterSink
from ..timeouts import wait_for
from ..uplink.protocol import CommandSource, PolledMessage, UplinkError, UplinkRejected
from .commands import (
    INVALID_COMMAND,
    Command,
    CommandState,
    DesiredConfig,
    Refused,
    commands_topic,
    config_topic,
    printable,
    read_command,
    read_config,
)
from .inbox import Inbox, RowRefused, StoredBatch

log = logging.getLogger(__name__)

TOO_MANY_CONFIG_DEVICES: Final = "too_many_config_devices"
BACKOFF_MAX_S: Final = 30.0
PROBES_PER_INTERVAL: Final = 5  # looks at the commands topic per poll_interval_s
HOT_LOOKS_PER_INTERVAL: Final = 20  # ... while commands come in
HOT_INTERVALS: Final = 3  # poll intervals after the last command that count as "coming in"
FULL_ROUND_EVERY: Final = 20  # poll intervals between rounds that poll every partition


@dataclass(frozen=True, slots=True)
class _Partition:
    stream: str
    topic: str
    partition_id: int
    is_config: bool

    def source(self, offset: int) -> str:
        return f"{self.topic}/{self.partition_id}@{offset}"


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
    ) -> None:
        self.reconfigure(settings)
        self._source = source
        self._inbox = inbox
        self._dead_letters = dead_letters
        self._metrics = metrics
        self._on_stored = on_stored
        self._limited = RateLimitedLog(log)
        stream, n = self._dl.stream, settings.iggy.partitions
        self.partitions = [
            *(_Partition(stream, commands_topic(settings), p, False) for p in range(n)),
            *(_Partition(stream, config_topic(settings), p, True) for p in range(n)),
        ]
        self._last: dict[_Partition, int] = {}
        self._mirrored: dict[_Partition, int | None] = {}
        self._next_config = 0.0  # monotonic: when the config topic is looked at next
        self._next_full = 0.0  # monotonic: when every partition is polled next
        # False once the server refused a look (a user allowed to poll but not
        # to read topic details): then every round polls every partition.
        self._looks = True
        self._last_command = -float("inf")  # monotonic: when a round last got a command

    def reconfigure(self, settings: Settings) -> None:
        """Polling cadence, batch, inbox bound and TTL from `settings` (a reload)."""
        self._settings = settings
        self._dl = settings.downlink

    async def run(self) -> None:
        stored = await self._inbox.offsets()
        for part in self.partitions:
            last, mirrored = stored.get((part.stream, part.topic, part.partition_id), (-1, None))
            self._last[part] = last
            self._mirrored[part] = mirrored
        resumed = {f"{p.topic}/{p.partition_id}": self._last[p] + 1 for p in self.partitions}
        log.info("return poll: resuming at %s", resumed)
        failures = 0
        started = False
        while True:
            try:
                if not started:
                    await self._source.start()
                    started = True
                    await self._check_partition_count()
                got = await self._round()
            except UplinkError as e:
                self._metrics.downlink_errors.labels("poll").inc()
                delay = backoff_delay(failures, self._dl.poll_interval_s, BACKOFF_MAX_S)
                failures += 1
                self._limited.warning(
                    "poll",
                    "return poll: Iggy not reachable (%s); retrying in %.1fs; delivery goes on",
                    e,
                    delay,
                )
                if await backoff_wait(self._source, delay):
                    log.info("return poll: the probe reaches Iggy again; polling now")
                continue
            failures = 0
            await self._mirror_all()
            if not got:
                await asyncio.sleep(self._pause())

    def _pause(self) -> float:
        """Seconds until the next look (module docstring: cadence)."""
        interval = self._dl.poll_interval_s
        if not self._looks:
            return interval
        if time.monotonic() - self._last_command < HOT_INTERVALS * interval:
            return interval / HOT_LOOKS_PER_INTERVAL
        return interval / PROBES_PER_INTERVAL

    async def _check_partition_count(self) -> None:
        """Warn when a topic has more partitions than we read (their commands
        would never arrive): a poll one past our count must be refused."""
        n = self._settings.iggy.partitions
        for topic in (commands_topic(self._settings), config_topic(self._settings)):
            try:
                await self._source.poll(self._dl.stream, topic, n, 0, 1)
            except UplinkError:
                continue  # as expected: no partition n
            log.error(
                "return poll: %s/%s has more than iggy.partitions=%d partitions; commands in the extra"
                " partitions are NOT read -- set iggy.partitions to the topic's count",
                self._dl.stream,
                topic,
                n,
            )

    async def _round(self) -> int:
        """Poll the partitions that have something new (all of them on a full
        round); the number of messages consumed."""
        now = time.monotonic()
        full = not self._looks or now >= self._next_full
        if full:
            self._next_full = now + FULL_ROUND_EVERY * self._dl.poll_interval_s
        with_config = full or now >= self._next_config
        if with_config:
            self._next_config = now + self._dl.poll_interval_s
        total = 0
        waiting = await self._inbox.waiting()
        self._metrics.inbox_records.set(waiting)
        room = self._dl.max_inbox - waiting
        for part in await self._due(full, with_config):
            if part.is_config:
                total += await self._poll_or_skip(part, self._dl.poll_batch)
                continue
            if room <= 0:
                self._metrics.downlink_inbox_full.inc()
                self._limited.warning(
                    "inbox-full",
                    "return poll: inbox full (%d commands wait for delivery): paused, commands stay in Iggy",
                    self._dl.max_inbox,
                )
                continue
            got = await self._poll_or_skip(part, min(self._dl.poll_batch, room))
            room -= got
            total += got
            if got:
                self._last_command = time.monotonic()
        if total:
            self._metrics.inbox_records.set(await self._inbox.waiting())
        return total

    async def _due(self, full: bool, with_config: bool) -> list[_Partition]:
        """The partitions to poll this round: on a full round all, otherwise
        those of the commands topic (and the config topic when `with_config`)
        whose newest offset is past the last one read.  A topic the server
        does not show is polled as before, so polling reports what is wrong."""
        if full:
            return self.partitions
        due: list[_Partition] = []
        topics: dict[str, list[_Partition]] = {}
        for part in self.partitions:
            if with_config or not part.is_config:
                topics.setdefault(part.topic, []).append(part)
        for topic, parts in topics.items():
            try:
                newest = await self._source.last_offsets(self._dl.stream, topic)
            except UplinkRejected as e:
                log.warning(
                    "return poll: the server refuses a look at %s/%s (%s): polling every partition"
                    " every poll_interval_s instead",
                    self._dl.stream,
                    topic,
                    e,
                )
                self._looks = False
                return self.partitions
            if newest is None:
                due.extend(parts)
                continue
            due.extend(p for p in parts if newest.get(p.partition_id, -1) > self._last[p])
        return due

    async def _poll_or_skip(self, part: _Partition, count: int) -> int:
        """A partition the server refuses (missing, no permission) is logged
        and skipped so the others are still read; Iggy being unreachable
        raises and the round is retried with backoff."""
        try:
            return await self._poll(part, count)
        except UplinkRejected as e:
            self._metrics.downlink_errors.labels("poll").inc()
            self._limited.error(f"rejected:{part.topic}/{part.partition_id}", "return poll: %s", e)
            return 0

    async def _poll(self, part: _Partition, count: int) -> int:
        start = self._last[part] + 1
        messages = await self._source.poll(part.stream, part.topic, part.partition_id, start, count)
        if not messages:
            return 0
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
        for m in messages:
            source = part.source(m.offset)
            got: Command | DesiredConfig | Refused
            if part.is_config:
                got = read_config(m.payload, now=now, fallback_id=f"offset-{m.offset}")
            else:
                got = read_command(m.payload, now=now, default_ttl_s=self._dl.default_ttl_s)
            if isinstance(got, Refused):
                await self._dead_letter(part, m, got.reason, got.detail)
            elif isinstance(got, Command):
                commands.append((got, source))
                origin[source] = m
            else:
                configs.append((got, source))
                origin[source] = m
        if configs:
            configs = await self._bound_configs(part, configs, origin)
        last = messages[-1].offset
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
        return len(messages)

    async def _store(
        self,
        part: _Partition,
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
        part: _Partition,
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

    async def _dead_letter(self, part: _Partition, m: PolledMessage, reason: str, detail: str) -> None:
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

    async def _mirror_all(self) -> None:
        """Mirror every offset the server does not have yet (bounded, best effort)."""
        for part, last in self._last.items():
            if last < 0 or self._mirrored.get(part) == last:
                continue
            try:
                await wait_for(
                    self._source.mirror_offset(part.stream, part.topic, part.partition_id, last),
                    self._dl.mirror_timeout_s,
                )
            except (UplinkError, TimeoutError) as e:
                self._metrics.downlink_errors.labels("mirror").inc()
                self._limited.warning(
                    "mirror",
                    "return poll: mirroring offset %d of %s failed (%s); retried later",
                    last,
                    part.source(last),
                    e,
                )
                return
            self._mirrored[part] = last
            await self._inbox.set_mirrored(part.stream, part.topic, part.partition_id, last)
