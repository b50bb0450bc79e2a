"""What ingest and deliver share about their MQTT connections: credentials,
TLS, and one bounded connect.  (Each keeps its own client and session: the
persistent ingest session must never be shared with the publisher.)"""

from __future__ import annotations

import contextlib
import ssl
from typing import Final

import gmqtt
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MQTTConnectError

from .config import MqttSettings
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
