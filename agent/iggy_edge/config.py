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

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

MQTT_TOPIC_FILTER = re.compile(r"^(?:[^+#/]*|\+)(?:/(?:[^+#/]*|\+))*(?:/#)?$|^#$")
IGGY_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,254}$")
TRUE_WORDS = {"1", "true", "yes", "on"}


class ConfigError(Exception):
    """A configuration cannot be used.  `problems` is a list of (key, message)."""

    def __init__(self, source: str, problems: list[tuple[str, str]]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  {key}: {msg}" for key, msg in problems)
        super().__init__(f"{source}: {len(problems)} problem(s)\n{lines}")


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


class Subscription(_Model):
    filter: str
    qos: Literal[0, 1, 2] = 1

    @field_validator("filter")
    @classmethod
    def _valid_filter(cls, v: str) -> str:
        if not v or not MQTT_TOPIC_FILTER.match(v):
            raise ValueError(f"not a valid MQTT topic filter: {v!r}")
        return v


class MqttSettings(_Model):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 1883
    client_id: str = ""  # default: iggy-edge-{gateway_id}
    username: str | None = None
    password: SecretStr | None = None
    tls: bool = False
    tls_ca_file: Path | None = None
    keepalive_s: Annotated[int, Field(ge=5, le=3600)] = 30
    # MQTT 5 persistent session: the broker keeps our subscriptions and
    # queues QoS1/2 messages while we are away for this long.  Zero would
    # make the broker forget the session at disconnect (messages lost).
    session_expiry_s: Annotated[int, Field(ge=60)] = 7 * 24 * 3600
    # Receive maximum sent in CONNECT: how many unacknowledged QoS1/2
    # deliveries the broker may have in flight to us.  With acknowledge-after-
    # commit, throughput ~ window / commit latency.
    receive_maximum: Annotated[int, Field(ge=1, le=65535)] = 2000
    reconnect_min_s: PositiveFloat = 0.5
    reconnect_max_s: PositiveFloat = 30.0
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

    filter: str
    stream: str = "edge"
    topic: str = "telemetry"
    key_level: Annotated[int, Field(ge=0)] | None = 1

    @field_validator("filter")
    @classmethod
    def _valid_filter(cls, v: str) -> str:
        if not MQTT_TOPIC_FILTER.match(v):
            raise ValueError(f"not a valid MQTT topic filter: {v!r}")
        return v

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
    tls_ca_file: Path | None = None
    tls_domain: str | None = None
    # Every Iggy call is bounded by this; the SDK itself would retry forever.
    request_timeout_s: PositiveFloat = 10.0
    connect_timeout_s: PositiveFloat = 10.0
    create_missing: bool = True
    partitions: Annotated[int, Field(ge=1, le=1000)] = 3
    file_path: Path | None = None

    @model_validator(mode="after")
    def _kind_needs(self) -> IggySettings:
        if self.kind == "file" and self.file_path is None:
            raise ValueError("file_path is required when kind = 'file'")
        if self.kind == "iggy":
            for a in self.nodes:
                if not re.match(r"^[^:\s,]+:\d{1,5}$", a):
                    raise ValueError(f"address must be host:port, got {a!r}")
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
    path: Path | None = None  # default: {state_dir}/buffer.db
    max_records: PositiveInt = 5_000_000
    max_bytes: PositiveInt = 1024 * 1024 * 1024
    # What happens when a bound is hit:
    #   drop_oldest - delete the oldest records to make room (keeps fresh data)
    #   reject_new  - refuse new records (keeps history); they are acknowledged and counted as dropped
    overflow: Literal["drop_oldest", "reject_new"] = "drop_oldest"
    ttl_s: Annotated[int, Field(ge=0)] = 7 * 24 * 3600  # 0 = no expiry
    # "full": a committed record survives power loss (fsync per commit);
    # "normal": survives a crash of the agent, may lose the last commits on
    # power loss.  See bench/ for the measured cost.
    synchronous: Literal["full", "normal"] = "full"
    commit_interval_ms: Annotated[float, Field(ge=0, le=1000)] = 2.0
    commit_max_records: PositiveInt = 2000
    max_payload_bytes: PositiveInt = 256 * 1024
    max_dead_letters: PositiveInt = 10_000


class ForwardSettings(_Model):
    batch_records: PositiveInt = 1000
    batch_bytes: PositiveInt = 1024 * 1024
    linger_ms: Annotated[float, Field(ge=0)] = 50.0
    backoff_initial_s: PositiveFloat = 0.5
    backoff_max_s: PositiveFloat = 30.0

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
    poll_interval_s: PositiveFloat = 1.0
    poll_batch: PositiveInt = 100
    # Commands waiting for delivery; when reached, polling pauses and the
    # commands stay in Iggy (backpressure).
    max_inbox: PositiveInt = 10_000
    default_ttl_s: PositiveInt = 3600
    # Deliver: a separate MQTT client (default id iggy-edge-{gateway_id}-deliver).
    client_id: str = ""
    command_topic: str = "edge/{device}/down/cmd"
    config_mqtt_topic: str = "edge/{device}/down/config"
    ack_filter: str = "edge/+/up/ack"
    deliver_window: Annotated[int, Field(ge=1, le=1000)] = 100  # QoS1 publishes awaiting PUBACK
    publish_timeout_s: PositiveFloat = 10.0
    mirror_timeout_s: PositiveFloat = 2.0
    # Finished commands stay listed (and de-duplicated by id) this long.
    history_s: Annotated[int, Field(ge=60)] = 7 * 24 * 3600

    @field_validator("stream", "commands_topic", "config_topic")
    @classmethod
    def _valid_name(cls, v: str) -> str:
        if not IGGY_NAME.match(v):
            raise ValueError(f"not a valid Iggy name: {v!r} (letters, digits, . _ -)")
        return v

    @field_validator("command_topic", "config_mqtt_topic")
    @classmethod
    def _device_template(cls, v: str) -> str:
        if v.count("{device}") != 1 or "+" in v or "#" in v:
            raise ValueError("must contain {device} exactly once and no wildcards")
        return v

    @field_validator("ack_filter")
    @classmethod
    def _valid_ack_filter(cls, v: str) -> str:
        if not MQTT_TOPIC_FILTER.match(v):
            raise ValueError(f"not a valid MQTT topic filter: {v!r}")
        return v


class MetricsSettings(_Model):
    enabled: bool = True
    listen: str = "127.0.0.1:9108"
    # Health turns unhealthy when the uplink has been down this long.
    uplink_down_unhealthy_s: PositiveFloat = 300.0


class LoggingSettings(_Model):
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    format: Literal["text", "json"] = "text"


class Settings(_Model):
    gateway_id: str
    state_dir: Path = Path("/var/lib/iggy-edge")
    mqtt: MqttSettings = MqttSettings()
    iggy: IggySettings = IggySettings()
    routes: tuple[RouteSettings, ...] = Field(default_factory=_default_routes)
    buffer: BufferSettings = BufferSettings()
    forward: ForwardSettings = ForwardSettings()
    downlink: DownlinkSettings = DownlinkSettings()
    metrics: MetricsSettings = MetricsSettings()
    logging: LoggingSettings = LoggingSettings()

    @field_validator("gateway_id")
    @classmethod
    def _valid_gateway(cls, v: str) -> str:
        if not re.match(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$", v):
            raise ValueError("1-64 characters, letters, digits, '-' or '_'")
        return v

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
    if "IGGY_TLS" in env:
        _set(raw, "iggy.tls", env["IGGY_TLS"].strip().lower() in TRUE_WORDS)


def _read_toml(path: Path, what: str) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(str(path), [(what, "file not found")]) from None
    except PermissionError:
        raise ConfigError(str(path), [(what, "permission denied")]) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), [(what, f"not valid TOML: {e}")]) from None


def _merge_credentials(raw: dict[str, Any], base: Path) -> None:
    """`credentials_file = "path"` points at a small TOML (mode 0600) holding
    `[mqtt] password` / `[iggy] password`; its values fill the tree."""
    cred = raw.pop("credentials_file", None)
    if cred is None:
        return
    if not isinstance(cred, str):
        raise ConfigError("config", [("credentials_file", "must be a path string")])
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
            else:
                _set(raw, f"{section}.{k}", v)
    if problems:
        raise ConfigError(str(path), problems)


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
        return Settings.model_validate(raw)
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


def load_config(path: Path, *, env: Mapping[str, str] | None = None) -> Settings:
    raw = _read_toml(path, "config")
    _merge_credentials(raw, path.parent)
    return parse_config(raw, source=str(path), env=env)
