"""Typed, immutable settings: the only place TOML and the environment are read.

`load_config(path)` returns a frozen `Settings` or raises `ConfigError` that
lists *every* problem with its dotted key (pydantic collects them all).
Secrets come from the environment or a credentials file, never from the
command line; they are `SecretStr` so they never reach a log line.

The package: `fields` (the shared field types and their validators),
`sections` (one model per section), `settings` (`Settings`), `load`
(TOML, credentials file, environment, machine checks).

Environment variables (they override the file):

=====================  ================================================
IGGY_ADDRESS           host:port of the Iggy server, or several comma-separated
                       (cluster nodes); enables the iggy uplink
IGGY_USERNAME          Iggy user
IGGY_PASSWORD          Iggy password
IGGY_TOKEN             Iggy personal access token (instead of the password)
IGGY_TLS               "1"/"true" to use TLS
IGGY_TLS_CA_FILE       CA bundle for the server certificate
IGGY_TLS_DOMAIN        server name to verify
IGGY_EDGE_MQTT_HOST    broker host
IGGY_EDGE_MQTT_PORT    broker port
IGGY_EDGE_MQTT_USERNAME / IGGY_EDGE_MQTT_PASSWORD   broker credentials
=====================  ================================================
"""

from .fields import ConfigError, parse_listen, topic_filter_problem
from .load import load_config, parse_config, passwords_in_file
from .sections import (
    BufferSettings,
    DownlinkSettings,
    ForwardSettings,
    IggySettings,
    LoggingSettings,
    MetricsSettings,
    MqttSettings,
    ReceiptSettings,
    RouteSettings,
    Subscription,
)
from .settings import Settings

__all__ = [
    "BufferSettings",
    "ConfigError",
    "DownlinkSettings",
    "ForwardSettings",
    "IggySettings",
    "LoggingSettings",
    "MetricsSettings",
    "MqttSettings",
    "ReceiptSettings",
    "RouteSettings",
    "Settings",
    "Subscription",
    "load_config",
    "parse_config",
    "parse_listen",
    "passwords_in_file",
    "topic_filter_problem",
]
