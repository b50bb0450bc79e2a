"""The return path as one runtime component: return poll + deliver + acks.

`downlink_component(agent)` is registered in cli/run.py's EXTRA_COMPONENTS.
It opens the inbox (the agent's buffer database, own connection), registers
an ingest observer for device acks, and runs the three tasks in one task
group until cancelled.  Without a command source (``[iggy] kind`` "none" or
"file", or ``downlink.enabled = false``) it logs that and returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Final

from ..config import Settings
from ..logs import RateLimitedLog
from ..metrics import Metrics
from ..routing import topic_matches
from ..uplink.protocol import UplinkError
from .commands import parse_ack
from .deliver import Deliverer
from .inbox import Inbox
from .poll import ReturnPoll

if TYPE_CHECKING:
    from ..runtime import Agent

log = logging.getLogger(__name__)

ACK_QUEUE: Final = 10_000
ACK_BATCH: Final = 500
PRUNE_INTERVAL_S: Final = 3600.0


class AckListener:
    """Sees every committed ingest message (`observe`, synchronous, never
    raises) and records the device acks among them in the inbox."""

    def __init__(self, settings: Settings, inbox: Inbox, metrics: Metrics) -> None:
        self._filter = settings.downlink.ack_filter.split("/")
        self._inbox = inbox
        self._metrics = metrics
        self._queue: asyncio.Queue[bytes] = asyncio.Queue(ACK_QUEUE)
        self._limited = RateLimitedLog(log)

    def observe(self, topic: str, payload: bytes) -> None:
        if not topic_matches(self._filter, topic.split("/")):
            return
        try:
            self._queue.put_nowait(payload)
        except asyncio.QueueFull:
            # The ack still went uplink; only our local state misses it.
            self._metrics.downlink_errors.labels("ack_queue_full").inc()
            self._limited.warning("ack-full", "ack queue full: a device ack was not recorded locally")

    async def run(self) -> None:
        while True:
            payloads = [await self._queue.get()]
            while len(payloads) < ACK_BATCH and not self._queue.empty():
                payloads.append(self._queue.get_nowait())
            acks = [a for a in map(parse_ack, payloads) if a is not None]
            for cid, state in await self._inbox.apply_acks(acks):
                self._metrics.commands.labels(state.value).inc()
                log.debug("command %s: %s by the device", cid, state.value)


class Downlink:
    def __init__(self, agent: Agent, inbox: Inbox) -> None:
        assert agent.outbox is not None
        assert agent.command_source is not None
        s = agent.settings
        self.inbox = inbox
        self.deliverer = Deliverer(s, inbox, agent.metrics)
        self.acks = AckListener(s, inbox, agent.metrics)
        self.poll = ReturnPoll(
            s, agent.command_source, inbox, agent.outbox, agent.metrics, on_stored=self.deliverer.wake
        )

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.poll.run(), name="downlink-poll")
            tg.create_task(self.deliverer.run(), name="downlink-deliver")
            tg.create_task(self.acks.run(), name="downlink-acks")
            tg.create_task(self._prune(), name="downlink-prune")

    async def _prune(self) -> None:
        while True:
            removed = await self.inbox.prune()
            if removed:
                log.info("inbox: forgot %d finished commands older than history_s", removed)
            await asyncio.sleep(PRUNE_INTERVAL_S)


async def return_path(agent: Agent) -> None:
    """Runtime component (see runtime.Component): the whole return path."""
    if agent.command_source is None:
        log.info("return path off: no command source (iggy kind %r)", agent.settings.iggy.kind)
        return
    assert agent.outbox is not None
    assert agent.ingest is not None
    inbox = await Inbox.open(agent.settings.buffer_path, agent.settings)
    component = Downlink(agent, inbox)
    agent.ingest.observers.append(component.acks.observe)
    try:
        await component.run()
    finally:
        with contextlib.suppress(ValueError):
            agent.ingest.observers.remove(component.acks.observe)
        await inbox.close()
        with contextlib.suppress(UplinkError, RuntimeError, OSError):  # closing must not mask the exit
            await agent.command_source.close()
