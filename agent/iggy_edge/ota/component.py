"""The updater as one runtime component (runtime.COMPONENTS): ``ota.db``,
the updater and its MQTT link.  The cloud path is the return poll's
(downlink/poll.py hands ``kind = ota`` messages to ota/cloud.py).

It sees the agent as a `stages.UpdateHost`: ingest hands it every ``up/ota``
message (never stored as a reading) and every committed message (a board's
``status`` turning ``online`` means it reconnected).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from ..stages import UpdateHost
from .link import Link
from .metrics import ota_metrics
from .requests import db_path
from .state import OtaState
from .updater import Limits, Updater

log = logging.getLogger(__name__)


async def run_updates(host: UpdateHost, limits: Limits | None = None) -> None:
    limits = limits or Limits()
    s = host.settings
    metrics = ota_metrics(host.metrics)
    state = await OtaState.open(db_path(s.state_dir))
    updater: Updater | None = None

    def connected() -> None:
        if updater is not None:
            updater.link_connected()

    link = Link(s, connected)
    updater = Updater(s, state, link.publish, metrics, limits, link.wanted)
    stops = [host.observe_ota(updater.observe_reply), host.observe_ingest(updater.observe_ingest)]
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(updater.run(), name="ota-updater")
            tg.create_task(link.run(), name="ota-link")
    finally:
        for stop in stops:
            with contextlib.suppress(Exception):
                stop()
        await state.close()


def updates_with(limits: Limits) -> Callable[[UpdateHost], Awaitable[None]]:
    """A component with other limits (tests: short resend timeouts)."""

    async def updates(host: UpdateHost) -> None:
        await run_updates(host, limits)

    return updates
