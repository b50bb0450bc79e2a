"""What ingest and deliver share about their MQTT connections: credentials,
TLS, one bounded connect, and the session loop (`keep_session`: connect,
serve, reconnect with capped full-jitter backoff).  Each keeps its own client
and session: the persistent ingest session must never be shared with the
publisher."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import Awaitable, Callable
from typing import Final, TypeVar

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError

from .backoff import backoff_delay
from .config import MqttSettings
from .logs import RateLimitedLog
from .timeouts import wait_for

CONNECT_TIMEOUT_S: Final = 15.0
# What a failed connect attempt raises: retry with backoff.
CONNECT_ERRORS: Final = (OSError, TimeoutError, MQTTConnectError)


def ssl_context(mqtt: MqttSettings) -> ssl.SSLContext | bool:
    if not mqtt.tls:
        return False
    return ssl.create_default_context(cafile=str(mqtt.tls_ca_file) if mqtt.tls_ca_file else None)


def set_credentials(client: gmqtt.Client, mqtt: MqttSettings) -> None:
    if mqtt.username:
        password = mqtt.password.get_secret_value() if mqtt.password else None
        client.set_auth_credentials(mqtt.username, password)


async def connect(client: gmqtt.Client, mqtt: MqttSettings) -> None:
    """Connect (MQTT 5), bounded by CONNECT_TIMEOUT_S; raises one of CONNECT_ERRORS.

    A connect that fails after the TCP connection was made (no CONNACK in
    time, a refusal, a cancellation) leaves gmqtt holding that socket: it is
    closed here before the error goes on, whatever the error is."""
    try:
        await wait_for(
            client.connect(
                mqtt.host, mqtt.port, ssl=ssl_context(mqtt), keepalive=mqtt.keepalive_s, version=MQTTv50
            ),
            CONNECT_TIMEOUT_S,
        )
    except BaseException:
        await close(client)
        raise


async def close(client: gmqtt.Client, timeout: float = 5.0) -> None:
    """Close `client`'s connection in whatever state it is: connected, half
    way through a connect, or lost.  gmqtt's `disconnect()` closes the socket
    before its first await, so even a cancelled caller leaves nothing open
    (`is_connected` is False until the CONNACK: checking it first would
    leak the socket of a connect that got no answer)."""
    with contextlib.suppress(OSError, RuntimeError, AttributeError, TimeoutError):
        await wait_for(client.disconnect(), timeout)


C = TypeVar("C")


async def keep_session(
    mqtt: MqttSettings,
    *,
    name: str,
    open_session: Callable[[], Awaitable[C]],
    serve: Callable[[C], Awaitable[bool]],
    close_session: Callable[[C], Awaitable[None]],
    pause: Callable[[float], Awaitable[bool]],
    limited: RateLimitedLog,
    on_retry: Callable[[], None] | None = None,
    meanwhile: str = "",
    stopped: Callable[[], bool] = lambda: False,
) -> None:
    """One MQTT session after the other until `serve` or `pause` says stop.

    `open_session` makes a client and connects it (closing what it opened
    when it fails; one of CONNECT_ERRORS is retried after a capped,
    full-jitter backoff, anything else goes on); `serve` runs while it is up
    and returns True to reconnect (after the shortest backoff), False to end;
    `close_session` runs after `serve` however it ended (a cancellation too).
    `pause(delay)` waits and returns True when the owner is stopping.
    `on_retry` counts each failed connect (ingest's reconnect metric);
    `meanwhile` says in the warning what waits ("commands wait"); no new
    session is opened once `stopped()`."""
    attempt = 0
    while not stopped():
        try:
            session = await open_session()
        except CONNECT_ERRORS as e:
            if on_retry is not None:
                on_retry()
            delay = backoff_delay(attempt, mqtt.reconnect_min_s, mqtt.reconnect_max_s)
            attempt += 1
            limited.warning(
                f"{name}-connect",
                "%s: MQTT broker %s:%d not reachable (%s)%s; retrying in %.1fs",
                name,
                mqtt.host,
                mqtt.port,
                e or type(e).__name__,
                meanwhile,
                delay,
            )
            if await pause(delay):
                return
            continue
        attempt = 0
        try:
            again = await serve(session)
        finally:
            await close_session(session)
        if not again or await pause(backoff_delay(0, mqtt.reconnect_min_s, mqtt.reconnect_max_s)):
            return


async def wait_first(*events: asyncio.Event) -> None:
    """Return once any of `events` is set."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
