"""The return path as one runtime component: return poll + deliver + acks.

`return_path(host)` is one of runtime.COMPONENTS.  It sees the agent only
as a `stages.ReturnPathHost` (settings, metrics, the command source, the
dead-letter sink, ingest's committed messages).  It opens the inbox (the
agent's buffer database, own connection), registers an ingest observer for
device acks and one for a lost MQTT session (the broker forgot ingest's
session: its retained configs are most likely gone too, so `Restorer` marks
every delivered config for publishing again), and runs its tasks in one
task group until cancelled.  Without a command source (``[iggy] kind`` "none" or "file", or
``downlink.enabled = false``) it logs that and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Final

from ..config import Settings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..ota.cloud import CloudRequests
from ..ota.metrics import ota_metrics
from ..stages import DeadLetterSink, ReturnPathHost
from ..uplink.protocol import CommandSource, UplinkError
from .commands import Ack, parse_ack, printable
from .deliver import Deliverer
from .inbox import Inbox
from .poll import ReturnPoll

log = logging.getLogger(__name__)

ACK_QUEUE: Final = 10_000
ACK_WRONG_DEVICE: Final = "ack_wrong_device"
ACK_BATCH: Final = 500
PRUNE_INTERVAL_S: Final = 3600.0


@dataclass(frozen=True, slots=True)
class _Seen:
    device: str | None  # from the topic; None when the filter has no `+` to name it
    topic: str
    payload: bytes


class AckListener:
    """Sees every committed ingest message (`observe`, synchronous, never
    raises) and records the device acks among them in the inbox.

    The device an ack comes from is the device level of its topic
    (``{prefix}/{device}/up/ack``, topics.py: the broker's ACL lets only that
    device publish there).  An ack counts only for a command addressed to that
    device: one for another device's command changes nothing, is counted
    (``iggy_edge_downlink_errors_total{kind="ack_wrong_device"}``) and
    dead-lettered with reason ``ack_wrong_device``."""

    def __init__(
        self, settings: Settings, inbox: Inbox, metrics: Metrics, dead_letters: DeadLetterSink
    ) -> None:
        self._topics = settings.topics
        self._inbox = inbox
        self._metrics = metrics
        self._dead_letters = dead_letters
        self._queue: asyncio.Queue[_Seen] = asyncio.Queue(ACK_QUEUE)
        self._limited = RateLimitedLog(log)

    def observe(self, topic: str, payload: bytes) -> None:
        device = self._topics.device_of_ack(topic)
        if device is None:
            return
        try:
            self._queue.put_nowait(_Seen(device, topic, payload))
        except asyncio.QueueFull:
            # The ack still went uplink; only our local state misses it.
            self._metrics.downlink_errors.labels("ack_queue_full").inc()
            self._limited.warning("ack-full", "ack queue full: a device ack was not recorded locally")

    async def run(self) -> None:
        while True:
            seen = [await self._queue.get()]
            while len(seen) < ACK_BATCH and not self._queue.empty():
                seen.append(self._queue.get_nowait())
            acks: list[tuple[str, Ack]] = []
            sources: list[_Seen] = []
            for s in seen:
                ack = parse_ack(s.payload)
                if ack is not None and s.device is not None:
                    acks.append((s.device, ack))
                    sources.append(s)
            result = await self._inbox.apply_acks(acks)
            for cid, state in result.done:
                self._metrics.commands.labels(state.value).inc()
                log.debug("command %s: %s by the device", cid, state.value)
            for i, addressed in result.wrong_device:
                await self._wrong_device(sources[i], acks[i][1], addressed)

    async def _wrong_device(self, seen: _Seen, ack: Ack, addressed: str) -> None:
        self._metrics.downlink_errors.labels(ACK_WRONG_DEVICE).inc()
        detail = printable(
            f"ack for command {ack.id!r}, addressed to {addressed!r}, came from {seen.device!r}"
        )
        self._limited.warning("ack-wrong-device", "device ack refused: %s", detail)
        await self._dead_letters.dead_letter(
            mqtt_topic=seen.topic,
            payload=seen.payload,
            qos=1,
            retain=False,
            reason=ACK_WRONG_DEVICE,
            detail=detail,
        )


class Restorer:
    """`request` (synchronous, from ingest's session-lost hook) -> every
    delivered config marked ``republish`` in the inbox, durably, then the
    deliverer woken.  Requests while one is being marked fold into it."""

    def __init__(self, inbox: Inbox, deliverer: Deliverer) -> None:
        self._inbox = inbox
        self._deliverer = deliverer
        self._requested = asyncio.Event()

    def request(self) -> None:
        self._requested.set()

    async def run(self) -> None:
        while True:
            await self._requested.wait()
            self._requested.clear()
            # Not those already published to this broker since the deliverer reached it.
            marked = await self._inbox.mark_republish(before=self._deliverer.connected_since)
            log.warning(
                "the MQTT broker forgot the agent's session and most likely its retained messages: "
                "restoring the device configs from the inbox (%d marked now, besides any the "
                "deliverer marked on reconnecting)",
                marked,
            )
            self._deliverer.wake()


class Downlink:
    def __init__(self, host: ReturnPathHost, source: CommandSource, inbox: Inbox) -> None:
        s = host.settings
        self.inbox = inbox
        self.deliverer = Deliverer(s, inbox, host.metrics)
        self.acks = AckListener(s, inbox, host.metrics, host.dead_letters)
        self.restorer = Restorer(inbox, self.deliverer)
        self.poll = ReturnPoll(
            s,
            source,
            inbox,
            host.dead_letters,
            host.metrics,
            on_stored=self.deliverer.wake,
            ota=CloudRequests(s, ota_metrics(host.metrics)),  # board updates ride the return topic
        )

    def reconfigure(self, settings: Settings) -> None:
        """A reload (reload.py): the live downlink keys, from the next use on."""
        self.inbox.reconfigure(settings)
        self.poll.reconfigure(settings)
        self.deliverer.reconfigure(settings)

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.poll.run(), name="downlink-poll")
            tg.create_task(self.deliverer.run(), name="downlink-deliver")
            tg.create_task(self.acks.run(), name="downlink-acks")
            tg.create_task(self.restorer.run(), name="downlink-restore")
            tg.create_task(self._prune(), name="downlink-prune")

    async def _prune(self) -> None:
        while True:
            removed = await self.inbox.prune()
            if removed:
                log.info("inbox: forgot %d finished commands older than history_s", removed)
            await asyncio.sleep(PRUNE_INTERVAL_S)


async def return_path(host: ReturnPathHost) -> None:
    """Runtime component (see runtime.Component): the whole return path."""
    source = host.command_source
    if source is None:
        log.info("return path off: no command source (iggy kind %r)", host.settings.iggy.kind)
        return
    inbox = await Inbox.open(host.settings.buffer_path, host.settings)
    component = Downlink(host, source, inbox)
    stop_observing = host.observe_ingest(component.acks.observe)
    stop_restoring = host.observe_session_lost(component.restorer.request)
    stop_reloading = host.observe_reload(component.reconfigure)
    try:
        await component.run()
    finally:
        stop_reloading()
        stop_restoring()
        stop_observing()
        await inbox.close()
        with contextlib.suppress(UplinkError, RuntimeError, OSError):  # closing must not mask the exit
            await source.close()
