"""`Settings`: the whole configuration, one frozen model of the sections."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, field_validator

from ..topics import DEFAULT_PREFIX, TopicLayout
from .fields import FilePath, GatewayId, TopicPrefix, _Model
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
    default_routes,
)


class Settings(_Model):
    gateway_id: GatewayId  # its rule: device_ids.gateway_id_problem
    state_dir: FilePath = Path("/var/lib/iggy-edge")
    # The devices' topics hang off this prefix (topics.py); the device
    # library's `topic_prefix` must say the same.
    topic_prefix: TopicPrefix = DEFAULT_PREFIX
    mqtt: MqttSettings = MqttSettings()
    iggy: IggySettings = IggySettings()
    # At least one rule: with none every message would be dead-lettered.
    routes: tuple[RouteSettings, ...] = Field(default_factory=default_routes)
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
