"""Did the broker keep ingest's persistent MQTT session?

CONNACK says whether the broker still had our session.  When it had
forgotten one the agent had (in this process, or in an earlier one: the
outbox's meta table remembers the client id), the messages it queued for us,
and those published before we re-subscribed, are gone: logged as an error,
counted (`iggy_edge_mqtt_session_lost_total`), shown in health and
`status`, and the `observers` are told (the return path restores the retained
configs then).  docs/operations.md says when a broker loses sessions.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from typing import Final

from .config import Settings
from .metrics import Metrics
from .store import Outbox, StoreError

log = logging.getLogger("iggy_edge.ingest")

SESSION_META_KEY: Final = "mqtt_session_client_id"


class SessionMemory:
    def __init__(self, settings: Settings, outbox: Outbox, metrics: Metrics) -> None:
        self._settings = settings
        self._outbox = outbox
        self._metrics = metrics
        self._had_session = False
        self.lost = 0  # connects where the broker had forgotten the session
        # Called (quick, must not raise) when the broker had forgotten our session.
        self.observers: list[Callable[[], None]] = []

    async def check(self, present: bool) -> None:
        """After a CONNACK whose session-present flag is `present`."""
        cid = self._settings.mqtt_client_id
        try:
            had = self._had_session or await self._outbox.get_meta(SESSION_META_KEY) == cid
        except (sqlite3.Error, StoreError) as e:
            log.warning("cannot read the MQTT session flag from the outbox: %s", e)
            had = self._had_session
        if had and not present:
            self.lost += 1
            self._metrics.mqtt_sessions_lost.inc()
            mqtt = self._settings.mqtt
            log.error(
                "MQTT broker %s:%d had forgotten the agent's session %r: messages it held for the "
                "agent, and any published before the agent subscribed again, may be lost (a broker "
                "restart without persistence or before its autosave, or the agent offline longer "
                "than mqtt.session_expiry_s = %ds); see docs/operations.md",
                mqtt.host,
                mqtt.port,
                cid,
                mqtt.session_expiry_s,
            )
            for notify in list(self.observers):
                notify()
        if not self._had_session:
            self._had_session = True
            try:
                await self._outbox.set_meta(SESSION_META_KEY, cid)
            except (sqlite3.Error, StoreError) as e:
                log.warning("cannot write the MQTT session flag to the outbox: %s", e)
