"""The sections of the configuration file, one model each ([mqtt], [iggy],
[[routes]], [buffer], [forward], [downlink], [receipts], [metrics],
[logging]).  Their defaults for the device topics are those of the default
layout (topics.DEFAULT); `Settings` moves them to its `topic_prefix`
(config/layout.py)."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import Field, SecretStr, model_validator

from ..topics import DEFAULT, TopicLayout
from .fields import (
    MAX_PAYLOAD_BYTES,
    MAX_SESSION_EXPIRY_S,
    TEN_YEARS_S,
    DeviceTemplate,
    FilePath,
    Host,
    IggyName,
    Lifetime,
    Listen,
    MqttString,
    Seconds,
    TopicFilter,
    _Model,
    require_order,
)

_NODE = re.compile(r"([^:\s,]+):(\d{1,5})")


class Subscription(_Model):
    filter: TopicFilter
    qos: Literal[0, 1, 2] = 1


def default_subscriptions(layout: TopicLayout = DEFAULT) -> tuple[Subscription, ...]:
    """What the agent subscribes to unless told otherwise: the devices'
    readings and acks (``up/#``) and their status."""
    return (
        Subscription(filter=layout.up_filter, qos=1),
        Subscription(filter=layout.status_filter, qos=1),
    )


class MqttSettings(_Model):
    host: Host = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 1883
    client_id: MqttString = ""  # default: iggy-edge-{gateway_id}
    username: MqttString | None = None
    password: SecretStr | None = None
    tls: bool = False
    tls_ca_file: FilePath | None = None
    keepalive_s: Annotated[int, Field(ge=5, le=3600)] = 30
    # MQTT 5 persistent session: the broker keeps our subscriptions and
    # queues QoS1/2 messages while we are away for this long.  Zero would
    # make the broker forget the session at disconnect (messages lost); the
    # field is four bytes on the wire (0xFFFFFFFF = never expires).
    session_expiry_s: Annotated[int, Field(ge=60, le=MAX_SESSION_EXPIRY_S)] = 7 * 24 * 3600
    # Receive maximum sent in CONNECT: how many unacknowledged QoS1/2
    # deliveries the broker may have in flight to us.  With acknowledge-after-
    # commit, throughput ~ window / commit latency.
    receive_maximum: Annotated[int, Field(ge=1, le=65535)] = 2000
    reconnect_min_s: Seconds = 0.5
    reconnect_max_s: Seconds = 30.0
    subscriptions: tuple[Subscription, ...] = default_subscriptions()

    @model_validator(mode="after")
    def _backoff_order(self) -> MqttSettings:
        require_order("reconnect_min_s", self.reconnect_min_s, "reconnect_max_s", self.reconnect_max_s)
        if not self.subscriptions:
            raise ValueError("subscriptions: at least one subscription is needed")
        return self


class RouteSettings(_Model):
    """One routing rule: MQTT topic filter -> Iggy stream/topic/partition key.

    `key_level` picks the topic level (0-based) used as partition key, e.g.
    1 for the device id in `edge/{device}/up/...`; None uses the whole topic.
    """

    filter: TopicFilter
    stream: IggyName = "edge"
    topic: IggyName = "telemetry"
    key_level: Annotated[int, Field(ge=0, le=255)] | None = 1


def default_routes(layout: TopicLayout = DEFAULT) -> tuple[RouteSettings, ...]:
    """Acks, status and readings to their Iggy topics, keyed by the device
    level (1 under ``edge``, 2 under ``site/edge``)."""
    level = layout.head.count("/")
    return (
        RouteSettings(filter=layout.ack_filter, stream="edge", topic="acks", key_level=level),
        RouteSettings(filter=layout.status_filter, stream="edge", topic="events", key_level=level),
        RouteSettings(filter=layout.up_filter, stream="edge", topic="telemetry", key_level=level),
    )


class IggySettings(_Model):
    # "iggy": a real server; "none": no uplink (records stay in the outbox);
    # "file": append JSON lines to `file_path` (debugging, tests);
    # "memory": in-process, for tests and benchmarks.
    kind: Literal["iggy", "none", "file", "memory"] = "none"
    address: str = "127.0.0.1:8090"
    # Several nodes of one Iggy cluster, tried in this order; when set it
    # replaces `address` (see `nodes`).  The agent moves to the next node
    # when the one in use cannot be reached or stops answering.
    addresses: Annotated[tuple[str, ...], Field(max_length=16)] = ()
    username: str = "iggy"
    password: SecretStr | None = None
    # A personal access token of the gateway's user: when set the agent logs
    # in with it instead of username/password -- a token login costs the
    # server a hash lookup, a password login an Argon2 verification
    # (docs/scaling.md, "What a login costs").
    token: SecretStr | None = None
    tls: bool = False
    tls_ca_file: FilePath | None = None
    tls_domain: str | None = None
    # Every Iggy call is bounded by this; the SDK itself would retry forever.
    request_timeout_s: Seconds = 10.0
    connect_timeout_s: Seconds = 10.0
    create_missing: bool = True
    partitions: Annotated[int, Field(ge=1, le=1000)] = 3
    # Connections the uplink opens at most, one per partition it sends to
    # (requests to different partitions run side by side; the server answers
    # one request at a time per connection).  Partitions beyond share them.
    uplink_connections: Annotated[int, Field(ge=1, le=64)] = 16
    # The SDK pings the server this often on every connection (each ping is a
    # request); any request also counts as liveness for the server, so the
    # connection the return poll uses pings once an hour (uplink/factory.py).
    heartbeat_interval_s: Annotated[float, Field(ge=1, le=3600)] = 60.0
    # The first connect of the agent waits a random 0..start_jitter_s, so a
    # fleet starting together (power returning to a site, a rollout) does not
    # log in all at once; later reconnects use the jittered backoff.
    start_jitter_s: Annotated[float, Field(ge=0, le=3600)] = 0.0
    file_path: FilePath | None = None

    @model_validator(mode="after")
    def _kind_needs(self) -> IggySettings:
        if self.kind == "file" and self.file_path is None:
            raise ValueError("file_path is required when kind = 'file'")
        if self.kind == "iggy":
            for a in self.nodes:
                m = _NODE.fullmatch(a)
                if not m or not 0 < int(m.group(2)) < 65536:
                    raise ValueError(f"address must be host:port (port 1-65535), got {a!r}")
            if len(set(self.nodes)) != len(self.nodes):
                raise ValueError(f"addresses lists a node twice: {list(self.nodes)}")
        return self

    @property
    def nodes(self) -> tuple[str, ...]:
        """The Iggy nodes to use, in order: `addresses`, or else `address`."""
        return self.addresses or (self.address,)

    @property
    def where(self) -> str:
        """The nodes for messages: "host:port" or "h1:p, h2:p, ..."."""
        return ", ".join(self.nodes)


class BufferSettings(_Model):
    path: FilePath | None = None  # default: {state_dir}/buffer.db
    max_records: Annotated[int, Field(gt=0, le=10**12)] = 5_000_000
    max_bytes: Annotated[int, Field(gt=0, le=2**50)] = 1024 * 1024 * 1024
    # What happens when a bound is hit:
    #   drop_oldest - delete the oldest records to make room (keeps fresh data)
    #   reject_new  - refuse new records (keeps history); they are acknowledged and counted as dropped
    overflow: Literal["drop_oldest", "reject_new"] = "drop_oldest"
    ttl_s: Lifetime = 7 * 24 * 3600  # 0 = no expiry
    # "full": a committed record survives power loss (fsync per commit);
    # "normal": survives a crash of the agent, may lose the last commits on
    # power loss.  See bench/ for the measured cost.
    synchronous: Literal["full", "normal"] = "full"
    commit_interval_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    commit_max_records: Annotated[int, Field(gt=0, le=1_000_000)] = 2000
    max_payload_bytes: Annotated[int, Field(gt=0, le=MAX_PAYLOAD_BYTES)] = 256 * 1024
    max_dead_letters: Annotated[int, Field(gt=0, le=10**9)] = 10_000
    # Dead letters have their own byte bound, outside max_bytes (docs/config.md):
    # a flood of bad messages must not evict good readings, nor the reverse.
    max_dead_letter_bytes: Annotated[int, Field(gt=0, le=2**40)] = 64 * 1024 * 1024
    # Per-device bounds (the device is a record's partition key, normally the
    # device level of its topic): distinct MQTT topics a device may have in the
    # buffer, and devices the buffer tracks at once.  Beyond them a message is a
    # dead letter (too_many_topics / too_many_devices).
    max_topics_per_device: Annotated[int, Field(gt=0, le=100_000)] = 32
    max_devices: Annotated[int, Field(gt=0, le=1_000_000)] = 1000


class ForwardSettings(_Model):
    batch_records: Annotated[int, Field(gt=0, le=1_000_000)] = 1000
    batch_bytes: Annotated[int, Field(gt=0, le=2**30)] = 1024 * 1024
    linger_ms: Annotated[float, Field(ge=0, le=60_000)] = 50.0
    backoff_initial_s: Seconds = 0.5
    backoff_max_s: Seconds = 30.0

    @model_validator(mode="after")
    def _backoff_order(self) -> ForwardSettings:
        require_order("backoff_initial_s", self.backoff_initial_s, "backoff_max_s", self.backoff_max_s)
        return self


class DownlinkSettings(_Model):
    """Return path (see docs/return-path.md).  Each gateway reads one Iggy
    topic of one partition, ``{return_topic}.{gateway_id}`` in stream
    ``{stream_prefix}-{n}`` (n = a stable hash of the gateway id mod
    `stream_shards`), commands and desired configs told apart by a ``kind``
    header.  `stream`, `commands_topic` and `config_topic` name the earlier
    two-topic scheme, read once at upgrade for what was pending there."""

    enabled: bool = True
    # Changing any of these three moves every gateway's topic: a migration
    # (docs/return-path.md, "Changing the shard count").
    stream_prefix: IggyName = "edge-rp"
    stream_shards: Annotated[int, Field(ge=1, le=4096)] = 8
    return_topic: IggyName = "return"
    # The two-topic scheme before it (a migration reads them once, then never).
    migrate_legacy: bool = True
    stream: IggyName = "edge"
    commands_topic: IggyName = "commands"
    config_topic: IggyName = "config"
    poll_interval_s: Seconds = 1.0
    poll_batch: Annotated[int, Field(gt=0, le=100_000)] = 100
    # Commands waiting for delivery; when reached, polling pauses and the
    # commands stay in Iggy (backpressure).
    max_inbox: Annotated[int, Field(gt=0, le=10**9)] = 10_000
    default_ttl_s: Annotated[int, Field(gt=0, le=TEN_YEARS_S)] = 3600
    # Deliver: a separate MQTT client (default id iggy-edge-{gateway_id}-deliver).
    client_id: MqttString = ""
    # The device topics follow `topic_prefix` (config/layout.py).
    command_topic: DeviceTemplate = DEFAULT.command_template
    config_mqtt_topic: DeviceTemplate = DEFAULT.config_template
    ack_filter: TopicFilter = DEFAULT.ack_filter
    deliver_window: Annotated[int, Field(ge=1, le=1000)] = 100  # QoS1 publishes awaiting PUBACK
    publish_timeout_s: Seconds = 10.0
    mirror_timeout_s: Seconds = 2.0
    # Finished commands stay listed (and de-duplicated by id) this long.
    history_s: Annotated[int, Field(ge=60, le=TEN_YEARS_S)] = 7 * 24 * 3600
    # Restore (broker lost its retained configs; `config republish`): configs
    # published again per second at most, so thousands do not flood the broker.
    republish_rate: Annotated[float, Field(gt=0, le=100_000)] = 50.0
    # After the deliver connection was lost, configs delivered this long
    # before the loss are published again: a broker that crashed keeps only
    # what its last autosave wrote (Mosquitto's autosave_interval, 1800 s by
    # default).  0 = off.
    republish_recent_s: Annotated[int, Field(ge=0, le=TEN_YEARS_S)] = 1800
    # Devices that may have a desired config (each one a retained message of
    # up to 4 KiB in the broker); a config for one more device is a dead
    # letter (docs/return-path.md, "Outages and bounds").
    max_config_devices: Annotated[int, Field(ge=1, le=1_000_000)] = 2000


class ReceiptSettings(_Model):
    """Delivery receipts to the devices (docs/receipts.md): the newest
    reading of each device the gateway holds durably, published retained
    (QoS0) on `topic`, at most once per device per `min_interval_ms`."""

    enabled: bool = True
    # "committed": after the SQLite commit; "iggy": after Iggy confirmed it
    mode: Literal["committed", "iggy"] = "committed"
    topic: DeviceTemplate = DEFAULT.receipt_template  # follows `topic_prefix`
    min_interval_ms: Annotated[int, Field(ge=0, le=60_000)] = 200


class MetricsSettings(_Model):
    enabled: bool = True
    listen: Listen = "127.0.0.1:9108"
    # Health turns unhealthy when the uplink has been down this long.
    uplink_down_unhealthy_s: Annotated[float, Field(gt=0, le=TEN_YEARS_S)] = 300.0
    # A device silent this long is stale (device list, /devices, the dashboard,
    # iggy_edge_devices_stale).
    device_stale_s: Annotated[float, Field(gt=0, le=TEN_YEARS_S)] = 600.0


class LoggingSettings(_Model):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"
