"""Typed, immutable settings: the only place TOML and the environment are read.

`load_config(path)` returns a frozen `Settings` or raises `ConfigError` that
lists *every* problem with its dotted key (pydantic collects them all).
Secrets come from the environment or a credentials file, never from the
command line; they are `SecretStr` so they never reach a log line.

Environment variables (they override the file):

=====================  ================================================
IGGY_ADDRESS           host:port of the Iggy server, or several comma-separated
                       (cluster nodes); enables the iggy uplink
IGGY_USERNAME          Iggy user
IGGY_PASSWORD          Iggy password
IGGY_TLS               "1"/"true" to use TLS
IGGY_TLS_CA_FILE       CA bundle for the server certificate
IGGY_TLS_DOMAIN        server name to verify
IGGY_EDGE_MQTT_HOST    broker host
IGGY_EDGE_MQTT_PORT    broker port
IGGY_EDGE_MQTT_USERNAME / IGGY_EDGE_MQTT_PASSWORD   broker credentials
=====================  ================================================
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Final, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .topics import DEFAULT_PREFIX, TopicLayout, prefix_problem

IGGY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
TRUE_WORDS = {"1", "true", "yes", "on"}
# A configuration file is small; anything bigger is not one (and would be
# read into memory whole).
MAX_FILE_BYTES: Final = 1024 * 1024
# The deepest legitimate key is mqtt.subscriptions[0].filter (depth 4); a
# deeper tree is a mistake, refused before validation walks it.
MAX_DEPTH: Final = 16
MAX_MQTT_STRING_BYTES: Final = 65535  # MQTT's UTF-8 string length field
MAX_SESSION_EXPIRY_S: Final = 0xFFFFFFFF  # MQTT 5: a four-byte integer
MAX_PAYLOAD_BYTES: Final = 268_435_455  # MQTT's largest packet
TEN_YEARS_S: Final = 10 * 365 * 24 * 3600
MAX_WAIT_S: Final = 3600.0  # timeouts, backoff bounds, poll intervals


def topic_filter_problem(v: str) -> str | None:
    """Why `v` is not a valid MQTT topic filter (MQTT 5, section 4.7), or None."""
    if not v:
        return "an MQTT topic filter cannot be empty"
    if "\x00" in v:
        return "an MQTT topic filter cannot contain NUL"
    if len(v.encode()) > MAX_MQTT_STRING_BYTES:
        return f"an MQTT topic filter is at most {MAX_MQTT_STRING_BYTES} bytes"
    levels = v.split("/")
    for i, level in enumerate(levels):
        if "#" in level and (level != "#" or i != len(levels) - 1):
            return f"not a valid MQTT topic filter: {v!r} ('#' only as the whole last level)"
        if "+" in level and level != "+":
            return f"not a valid MQTT topic filter: {v!r} ('+' only as a whole level)"
    return None


def _topic_filter(v: str) -> str:
    problem = topic_filter_problem(v)
    if problem:
        raise ValueError(problem)
    return v


def _mqtt_string(v: str) -> str:
    if "\x00" in v:
        raise ValueError("cannot contain NUL")
    if len(v.encode()) > MAX_MQTT_STRING_BYTES:
        raise ValueError(f"at most {MAX_MQTT_STRING_BYTES} bytes")
    return v


def _host(v: str) -> str:
    if not v or v != v.strip() or any(c.isspace() or c == "\x00" for c in v) or len(v) > 253:
        raise ValueError(f"must be a host name or IP address, got {v!r}")
    return v


def _path_text(v: Any) -> Any:
    """Before pydantic turns it into a Path: "" would become "." (the current
    directory) and a NUL byte fails only when the agent opens the file."""
    if isinstance(v, str):
        if not v.strip():
            raise ValueError("a path cannot be empty")
        if "\x00" in v:
            raise ValueError("a path cannot contain NUL")
        if len(v.encode()) > 4096:
            raise ValueError("a path is at most 4096 bytes")
    return v


def parse_listen(listen: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); the host is an IP
    address or ``localhost`` (empty means 127.0.0.1).  Raises ValueError."""
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isascii() or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be host:port with a port 1-65535, e.g. 127.0.0.1:9108; got {listen!r}")
    host = host.strip("[]") or "127.0.0.1"
    if host != "localhost":
        try:
            ipaddress.ip_address(host)
        except ValueError:
            raise ValueError(
                f"the host must be an IP address or localhost (the address to listen on), got {host!r}"
            ) from None
    return host, int(port)


def _listen(v: str) -> str:
    parse_listen(v)
    return v


TopicFilter = Annotated[str, AfterValidator(_topic_filter)]
MqttString = Annotated[str, AfterValidator(_mqtt_string)]
Host = Annotated[str, AfterValidator(_host)]
FilePath = Annotated[Path, BeforeValidator(_path_text)]
PositiveInt = Annotated[int, Field(gt=0)]
Seconds = Annotated[float, Field(gt=0, le=MAX_WAIT_S)]
Lifetime = Annotated[int, Field(ge=0, le=TEN_YEARS_S)]


class ConfigError(Exception):
    """A configuration cannot be used.  `problems` is a list of (key, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


def _scalar_kinds(annotation: Any) -> set[type]:
    """The int/float/bool types a field takes, when it takes only those (and None)."""
    args = (
        typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType)
        else ()
    )
    plain = (
        typing.get_args(a)[0] if typing.get_origin(a) is Annotated else a for a in (args or (annotation,))
    )
    kinds = {a for a in plain if a is not type(None)}
    return kinds if kinds and kinds <= {int, float, bool} else set()


def _strict_scalar(value: Any, kinds: set[type]) -> Any:
    """TOML has real integers, floats and booleans: "1883" for a port or 1
    for a bool is a mistake, not something to convert (pydantic's lax mode
    would).  Environment overrides are converted before (_apply_env)."""
    if value is None:
        return value
    if bool in kinds and isinstance(value, bool):
        return value
    if not isinstance(value, bool) and (
        (int in kinds and isinstance(value, int)) or (float in kinds and isinstance(value, int | float))
    ):
        return value
    want = " or ".join(
        sorted({int: "an integer", float: "a number", bool: "true or false"}[k] for k in kinds)
    )
    got = {bool: "a boolean", int: "an integer", float: "a float", str: "a string"}.get(
        type(value), "a table or list"
    )
    hint = " (write it without quotes)" if isinstance(value, str) else ""
    raise ValueError(f"must be {want}, not {got} {value!r}{hint}")


class _Model(BaseModel):
    # inf and nan are valid TOML floats but no setting means them: inf as a
    # linger or a timeout would wedge a stage, nan compares false to everything.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, value: Any, info: ValidationInfo) -> Any:
        field = cls.model_fields.get(info.field_name or "")
        kinds = _scalar_kinds(field.annotation) if field is not None else set()
        return _strict_scalar(value, kinds) if kinds else value


class Subscription(_Model):
    filter: TopicFilter
    qos: Literal[0, 1, 2] = 1


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
    subscriptions: tuple[Subscription, ...] = (
        Subscription(filter="edge/+/up/#", qos=1),
        Subscription(filter="edge/+/status", qos=1),
    )

    @model_validator(mode="after")
    def _backoff_order(self) -> MqttSettings:
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        if not self.subscriptions:
            raise ValueError("subscriptions: at least one subscription is needed")
        return self


class RouteSettings(_Model):
    """One routing rule: MQTT topic filter -> Iggy stream/topic/partition key.

    `key_level` picks the topic level (0-based) used as partition key, e.g.
    1 for the device id in `edge/{device}/up/...`; None uses the whole topic.
    """

    filter: TopicFilter
    stream: str = "edge"
    topic: str = "telemetry"
    key_level: Annotated[int, Field(ge=0, le=255)] | None = 1

    @field_validator("stream", "topic")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not IGGY_NAME.match(v):
            raise ValueError(f"not a valid Iggy name: {v!r} (letters, digits, . _ -)")
        return v


def _default_routes() -> tuple[RouteSettings, ...]:
    return (
        RouteSettings(filter="edge/+/up/ack", stream="edge", topic="acks"),
        RouteSettings(filter="edge/+/status", stream="edge", topic="events"),
        RouteSettings(filter="edge/+/up/#", stream="edge", topic="telemetry"),
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
    file_path: FilePath | None = None

    @model_validator(mode="after")
    def _kind_needs(self) -> IggySettings:
        if self.kind == "file" and self.file_path is None:
            raise ValueError("file_path is required when kind = 'file'")
        if self.kind == "iggy":
            for a in self.nodes:
                m = re.match(r"^([^:\s,]+):(\d{1,5})$", a)
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
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError("backoff_max_s must be >= backoff_initial_s")
        return self


class DownlinkSettings(_Model):
    """Return path (see docs/return-path.md).  Each gateway reads its own
    Iggy topics ``{commands_topic}.{gateway_id}`` and ``{config_topic}.{gateway_id}``
    in `stream`, partitioned by device id with `iggy.partitions` partitions."""

    enabled: bool = True
    stream: str = "edge"
    commands_topic: str = "commands"
    config_topic: str = "config"
    poll_interval_s: Seconds = 1.0
    poll_batch: Annotated[int, Field(gt=0, le=100_000)] = 100
    # Commands waiting for delivery; when reached, polling pauses and the
    # commands stay in Iggy (backpressure).
    max_inbox: Annotated[int, Field(gt=0, le=10**9)] = 10_000
    default_ttl_s: Annotated[int, Field(gt=0, le=TEN_YEARS_S)] = 3600
    # Deliver: a separate MQTT client (default id iggy-edge-{gateway_id}-deliver).
    client_id: MqttString = ""
    command_topic: str = "edge/{device}/down/cmd"
    config_mqtt_topic: str = "edge/{device}/down/config"
    ack_filter: TopicFilter = "edge/+/up/ack"
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

    @field_validator("stream", "commands_topic", "config_topic")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not IGGY_NAME.match(v):
            raise ValueError(f"not a valid Iggy name: {v!r} (letters, digits, . _ -)")
        return v

    @field_validator("command_topic", "config_mqtt_topic")
    @classmethod
    def _device_template(cls, v: str) -> str:
        if v.count("{device}") != 1 or "+" in v or "#" in v or "\x00" in v:
            raise ValueError("must contain {device} exactly once and no wildcards or NUL")
        if len(v.encode()) > 255 - 64:  # room for a 64-character device id in 255 bytes
            raise ValueError("at most 191 bytes (the topic with a device id must fit in 255)")
        return v


class ReceiptSettings(_Model):
    """Delivery receipts to the devices (docs/receipts.md): the newest
    reading of each device the gateway holds durably, published retained
    (QoS0) on `topic`, at most once per device per `min_interval_ms`."""

    enabled: bool = True
    # "committed": after the SQLite commit; "iggy": after Iggy confirmed it
    mode: Literal["committed", "iggy"] = "committed"
    topic: str = "edge/{device}/down/receipt"
    min_interval_ms: Annotated[int, Field(ge=0, le=60_000)] = 200

    @field_validator("topic")
    @classmethod
    def _device_template(cls, v: str) -> str:
        if v.count("{device}") != 1 or "+" in v or "#" in v or "\x00" in v:
            raise ValueError("must contain {device} exactly once and no wildcards or NUL")
        head, _, tail = v.partition("{device}")
        if (head and not head.endswith("/")) or not tail.startswith("/"):
            raise ValueError("{device} must be a whole topic level, e.g. edge/{device}/down/receipt")
        if len(v.encode()) > 255 - 64:
            raise ValueError("at most 191 bytes (the topic with a device id must fit in 255)")
        return v


class MetricsSettings(_Model):
    enabled: bool = True
    listen: Annotated[str, AfterValidator(_listen)] = "127.0.0.1:9108"
    # Health turns unhealthy when the uplink has been down this long.
    uplink_down_unhealthy_s: Annotated[float, Field(gt=0, le=TEN_YEARS_S)] = 300.0
    # A device silent this long is stale (device list, /devices, the dashboard,
    # iggy_edge_devices_stale).
    device_stale_s: Annotated[float, Field(gt=0, le=TEN_YEARS_S)] = 600.0


class LoggingSettings(_Model):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"


class Settings(_Model):
    gateway_id: str
    state_dir: FilePath = Path("/var/lib/iggy-edge")
    # The devices' topics hang off this prefix (topics.py); the device
    # library's `topic_prefix` must say the same.
    topic_prefix: str = DEFAULT_PREFIX
    mqtt: MqttSettings = MqttSettings()
    iggy: IggySettings = IggySettings()
    # At least one rule: with none every message would be dead-lettered.
    routes: tuple[RouteSettings, ...] = Field(default_factory=_default_routes)
    buffer: BufferSettings = BufferSettings()
    forward: ForwardSettings = ForwardSettings()
    downlink: DownlinkSettings = DownlinkSettings()
    receipts: ReceiptSettings = ReceiptSettings()
    metrics: MetricsSettings = MetricsSettings()
    logging: LoggingSettings = LoggingSettings()

    @field_validator("routes")
    @classmethod
    def _some_routes(cls, v: tuple[RouteSettings, ...]) -> tuple[RouteSettings, ...]:
        if not v:
            raise ValueError("at least one route is needed (with none every message is dead-lettered)")
        return v

    @field_validator("gateway_id")
    @classmethod
    def _valid_gateway(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", v):
            raise ValueError("1-64 characters, letters, digits, '-' or '_'")
        return v

    @field_validator("topic_prefix")
    @classmethod
    def _valid_prefix(cls, v: str) -> str:
        problem = prefix_problem(v)
        if problem is not None:
            raise ValueError(problem)
        return v

    @property
    def topics(self) -> TopicLayout:
        """The device topic layout (topics.py), from `topic_prefix`."""
        return TopicLayout(self.topic_prefix)

    @property
    def buffer_path(self) -> Path:
        return self.buffer.path or (self.state_dir / "buffer.db")

    @property
    def mqtt_client_id(self) -> str:
        return self.mqtt.client_id or f"iggy-edge-{self.gateway_id}"


def _set(tree: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for p in parents:
        node = node.setdefault(p, {})
        if not isinstance(node, dict):
            raise ConfigError("environment", [(dotted, f"cannot override: {p} is not a table")])
    node[leaf] = value


def _apply_env(raw: dict[str, Any], env: Mapping[str, str]) -> None:
    if "IGGY_ADDRESS" in env:
        # "host:port" or a comma-separated list of cluster nodes.
        nodes = [a.strip() for a in env["IGGY_ADDRESS"].split(",") if a.strip()]
        _set(raw, "iggy.address", nodes[0] if nodes else env["IGGY_ADDRESS"])
        _set(raw, "iggy.addresses", nodes if len(nodes) > 1 else [])
        _set(raw, "iggy.kind", "iggy")
    simple = {
        "IGGY_USERNAME": "iggy.username",
        "IGGY_PASSWORD": "iggy.password",
        "IGGY_TLS_CA_FILE": "iggy.tls_ca_file",
        "IGGY_TLS_DOMAIN": "iggy.tls_domain",
        "IGGY_EDGE_MQTT_HOST": "mqtt.host",
        "IGGY_EDGE_MQTT_PORT": "mqtt.port",
        "IGGY_EDGE_MQTT_USERNAME": "mqtt.username",
        "IGGY_EDGE_MQTT_PASSWORD": "mqtt.password",
    }
    for var, key in simple.items():
        if var in env:
            _set(raw, key, env[var])
    # The environment gives strings; the models take TOML's real types.
    port = env.get("IGGY_EDGE_MQTT_PORT", "").strip()
    if re.fullmatch(r"[0-9]{1,5}", port):
        _set(raw, "mqtt.port", int(port))
    if "IGGY_TLS" in env:
        _set(raw, "iggy.tls", env["IGGY_TLS"].strip().lower() in TRUE_WORDS)


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    """Read and parse one TOML file; every way it can fail is a ConfigError
    naming `what` (a file is refused whole: there is no key to name inside
    bytes that are not TOML)."""
    try:
        with path.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(str(path), [(what, "file not found")]) from None
    except PermissionError:
        raise ConfigError(str(path), [(what, "permission denied")]) from None
    except IsADirectoryError:
        raise ConfigError(str(path), [(what, "is a directory, not a file")]) from None
    except OSError as e:
        raise ConfigError(str(path), [(what, f"cannot read it: {e.strerror or e}")]) from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(str(path), [(what, f"larger than {MAX_FILE_BYTES} bytes: not a config file")])
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError(
            str(path), [(what, f"not UTF-8 text: byte 0x{data[e.start]:02x} at line {line}")]
        ) from None
    try:
        tree = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [(what, f"not valid TOML: {e}")]) from None
    except RecursionError:
        raise ConfigError(str(path), [(what, "not valid TOML: nested too deeply")]) from None
    except ValueError as e:  # an integer beyond Python's 4300-digit conversion limit
        why = "an integer with more than 4300 digits" if "digits" in str(e) else str(e)
        raise ConfigError(str(path), [(what, f"not valid TOML: {why}")]) from None
    _check_depth(tree, str(path), "" if what == "config" else what)
    return tree


def _check_depth(tree: dict[str, Any], source: str, prefix: str) -> None:
    """Refuse a tree nested deeper than MAX_DEPTH, naming the key where the
    nesting starts (its first three levels)."""
    stack: list[tuple[Any, list[str], int]] = [(tree, [prefix] if prefix else [], 0)]
    while stack:
        node, key, depth = stack.pop()
        if depth > MAX_DEPTH:
            name = "".join(p if p.startswith("[") or i == 0 else "." + p for i, p in enumerate(key[:3]))
            raise ConfigError(source, [(name or "(top level)", f"nested deeper than {MAX_DEPTH} levels")])
        if isinstance(node, dict):
            stack.extend((v, [*key, str(k)], depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, [*key, f"[{i}]"], depth + 1) for i, v in enumerate(node))


def _merge_credentials(raw: dict[str, Any], base: Path) -> None:
    """`credentials_file = "path"` points at a small TOML (mode 0600) holding
    `[mqtt] password` / `[iggy] password`; its values fill the tree."""
    cred = raw.pop("credentials_file", None)
    if cred is None:
        return
    if not isinstance(cred, str) or not cred.strip():
        raise ConfigError("config", [("credentials_file", "must be a path string")])
    if "\x00" in cred:
        raise ConfigError("config", [("credentials_file", "a path cannot contain NUL")])
    path = Path(cred) if Path(cred).is_absolute() else base / cred
    secrets = _read_toml(path, "credentials_file")
    problems: list[tuple[str, str]] = []
    for section, values in secrets.items():
        if section not in ("mqtt", "iggy") or not isinstance(values, dict):
            problems.append((f"credentials_file.{section}", "only [mqtt] and [iggy] tables allowed"))
            continue
        for k, v in values.items():
            if k not in ("username", "password"):
                problems.append((f"credentials_file.{section}.{k}", "only username/password allowed"))
            elif not isinstance(v, str):
                problems.append((f"credentials_file.{section}.{k}", "must be a string"))
            else:
                _set(raw, f"{section}.{k}", v)
    if problems:
        raise ConfigError(str(path), problems)


def _file_problem(path: Path, *, need: bool) -> str | None:
    """Why `path` cannot be a file the agent reads or writes, or None.  A
    missing file is a problem only when `need`-ed (the buffer is created)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return "file not found" if need else None
    except NotADirectoryError:
        return "a parent of this path is not a directory"
    except OSError as e:
        return f"cannot inspect it: {e.strerror or e}"
    if path.is_dir():
        return "is a directory, not a file"
    if not path.is_file():
        return f"is not a regular file (mode {oct(st.st_mode)[-6:]}); name a file"
    return None


def _ca_problem(path: Path) -> str | None:
    problem = _file_problem(path, need=True)
    if problem:
        return problem
    try:
        ssl.create_default_context(cafile=str(path))
    except (ssl.SSLError, OSError, ValueError) as e:
        return f"not a PEM CA bundle: {e}"
    return None


def _machine_problems(s: Settings) -> list[tuple[str, str]]:
    """Checks against this machine and across sections, each with its key:
    what would otherwise fail only once the agent runs."""
    problems: list[tuple[str, str]] = []
    if s.state_dir.exists() and not s.state_dir.is_dir():
        problems.append(("state_dir", "exists and is not a directory"))
    key = "buffer.path" if s.buffer.path is not None else "state_dir"
    problem = _file_problem(s.buffer_path, need=False)
    if problem:
        problems.append((key, f"{s.buffer_path} {problem}"))
    elif s.buffer_path.name in ("", ".", ".."):
        problems.append((key, f"{s.buffer_path} does not name a file"))
    for section, ca in (("mqtt", s.mqtt.tls_ca_file), ("iggy", s.iggy.tls_ca_file)):
        if ca is not None and (problem := _ca_problem(ca)):
            problems.append((f"{section}.tls_ca_file", f"{ca}: {problem}"))
    if s.iggy.kind == "file" and s.iggy.file_path is not None:
        problem = _file_problem(s.iggy.file_path, need=False)
        if problem:
            problems.append(("iggy.file_path", f"{s.iggy.file_path} {problem}"))
    deliver_id = s.downlink.client_id or f"{s.mqtt_client_id}-deliver"
    if deliver_id == s.mqtt_client_id:
        problems.append(
            (
                "downlink.client_id",
                "must differ from mqtt.client_id (the broker would drop one for the other)",
            )
        )
    return problems


def _key(loc: tuple[int | str, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif p.startswith(("function-after", "function-before")):
            continue
        else:
            parts.append(("." if parts else "") + p)
    return "".join(parts) or "(top level)"


def parse_config(
    raw: dict[str, Any], *, source: str = "config", env: Mapping[str, str] | None = None
) -> Settings:
    """Validate an already-read TOML tree (plus environment overrides)."""
    raw = dict(raw)
    _apply_env(raw, os.environ if env is None else env)
    try:
        settings = Settings.model_validate(raw)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (typo?)"
            elif err["type"] == "missing":
                msg = "required key is missing"
            problems.append((_key(err["loc"]), msg.removeprefix("Value error, ")))
        raise ConfigError(source, problems) from None
    problems = _machine_problems(settings)
    if problems:
        raise ConfigError(source, problems)
    return settings


def passwords_in_file(path: Path) -> list[str]:
    """The keys of passwords written in the main config file itself (they
    belong in /etc/iggy-edge/env or a credentials_file: the main file is
    world-readable and gets copied, diffed and pasted)."""
    raw = _read_toml(path, "config")
    return [
        f"{section}.password"
        for section in ("mqtt", "iggy")
        if isinstance(raw.get(section), dict) and "password" in raw[section]
    ]


def load_config(path: Path, *, env: Mapping[str, str] | None = None) -> Settings:
    raw = _read_toml(path, "config")
    _merge_credentials(raw, path.parent)
    return parse_config(raw, source=str(path), env=env)
