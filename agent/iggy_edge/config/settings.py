"""`Settings`: the whole configuration, one frozen model of the sections."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ..topics import DEFAULT_PREFIX, TopicLayout
from . import layout
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


def _following(section: type[_Model]) -> Any:
    # validate_default: the default section, too, moves to the prefix
    return Field(default_factory=section, validate_default=True)


class Settings(_Model):
    gateway_id: GatewayId  # its rule: device_ids.gateway_id_problem
    state_dir: FilePath = Path("/var/lib/iggy-edge")
    # The devices' topics hang off this prefix (topics.py); the device
    # library's `topic_prefix` must say the same.  Declared before the
    # sections whose device topics follow it (config/layout.py).
    topic_prefix: TopicPrefix = DEFAULT_PREFIX
    mqtt: MqttSettings = _following(MqttSettings)
    iggy: IggySettings = IggySettings()
    # At least one rule: with none every message would be dead-lettered.
    # (default: the layout's, see _routes_follow_the_prefix)
    routes: tuple[RouteSettings, ...] = Field(default_factory=default_routes)
    buffer: BufferSettings = BufferSettings()
    forward: ForwardSettings = ForwardSettings()
    downlink: DownlinkSettings = _following(DownlinkSettings)
    receipts: ReceiptSettings = _following(ReceiptSettings)
    metrics: MetricsSettings = MetricsSettings()
    logging: LoggingSettings = LoggingSettings()

    @model_validator(mode="before")
    @classmethod
    def _routes_follow_the_prefix(cls, data: Any) -> Any:
        return layout.routes_default(data)

    @field_validator("mqtt", "downlink", "receipts")
    @classmethod
    def _topics_follow_the_prefix(cls, section: _Model, info: ValidationInfo) -> _Model:
        prefix = info.data.get("topic_prefix")
        if prefix is None:  # refused itself: nothing to follow
            return section
        return layout.follow(info.field_name or "", section, TopicLayout(prefix))

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
