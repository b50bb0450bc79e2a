"""The updater's MQTT connection: publishes manifests and chunks on the
boards' ``down/ota`` at QoS 1.

Its own gmqtt client (``iggy-edge-{gateway}-ota``, clean start), like the
return path's deliver client (downlink/deliver.py) and for the same reason:
ingest's persistent session must never carry publishes, and a chunk waiting
for its PUBACK must not hold up acknowledging device messages.  Connected
only while updates are in progress (`wanted`), reconnected with the shared
backoff (mqttconn.keep_session).  PUBACKs are not awaited: the flow control
is the board's (window 1, the updater resends after a timeout), so a
message lost with a connection is simply sent again.  The board's replies
come back through ingest (``up/ota``), not through this client.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Final

import gmqtt

from .. import gmqtt_hooks as hooks
from ..config import Settings
from ..logs import RateLimitedLog
from ..mqttconn import close, connect, keep_session, set_credentials
from ..timeouts import wait_for

log = logging.getLogger(__name__)

IDLE_CLOSE_S: Final = 30.0  # no update in progress this long: the connection closes


def ota_client_id(settings: Settings) -> str:
    return f"iggy-edge-{settings.gateway_id}-ota"


class Link:
    def __init__(self, settings: Settings, on_connected: Callable[[], None]) -> None:
        self._settings = settings
        self._mqtt = settings.mqtt
        self._on_connected = on_connected
        self._client: gmqtt.Client | None = None
        self._lost = asyncio.Event()
        self.wanted = asyncio.Event()  # set while an update is in progress
        self.connected = asyncio.Event()
        self._limited = RateLimitedLog(log)

    def publish(self, topic: str, payload: bytes) -> bool:
        """QoS 1 on the live connection; False while there is none."""
        client = self._client
        if client is None or not self.connected.is_set():
            return False
        try:
            client.publish(topic, payload, qos=1, retain=False)
        except (OSError, RuntimeError, AttributeError) as e:
            log.debug("ota: not published on %s: %s", topic, e)
            self._lost.set()
            return False
        return True

    async def run(self) -> None:
        while True:
            await self.wanted.wait()
            await keep_session(
                self._mqtt,
                name="ota",
                open_session=self._connect,
                serve=self._serve,
                close_session=self._close,
                pause=self._pause,
                limited=self._limited,
                meanwhile="; updates wait",
            )

    async def _connect(self) -> gmqtt.Client:
        client = gmqtt.Client(ota_client_id(self._settings), clean_session=True)
        hooks.own_reconnect(client, self._lost.set)
        client.on_disconnect = lambda *_: self._lost.set()
        set_credentials(client, self._mqtt)
        self._lost.clear()
        await connect(client, self._mqtt)
        return client

    async def _close(self, client: gmqtt.Client) -> None:
        self.connected.clear()
        self._client = None
        await close(client)

    async def _serve(self, client: gmqtt.Client) -> bool:
        """True to reconnect after a loss; False once idle for IDLE_CLOSE_S."""
        self._client = client
        self.connected.set()
        log.info("ota: connected to %s:%d", self._mqtt.host, self._mqtt.port)
        self._on_connected()
        idle_since: float | None = None
        loop = asyncio.get_running_loop()
        while not self._lost.is_set():
            if self.wanted.is_set():
                idle_since = None
            elif idle_since is None:
                idle_since = loop.time()
            elif loop.time() - idle_since >= IDLE_CLOSE_S:
                return False
            with contextlib.suppress(TimeoutError):
                await wait_for(self._lost.wait(), 1.0)
        self._limited.warning("ota-lost", "ota: connection to the broker lost; reconnecting")
        return True

    async def _pause(self, delay: float) -> bool:
        await asyncio.sleep(delay)
        return False
