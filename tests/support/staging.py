"""env_sensor staged as `iggy-edge device provision` stages it (the agent's
own ``prepare``), for the tests that provision a board's flash."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from iggy_edge.provision.sources import source_root
from iggy_edge.provision.staging import Staged, prepare

MQTT_PASSWORD = "board-password-0123456789"  # the board's, through IGGY_TEST_MQTT_PW


def stage_env_sensor(
    staging: Path, monkeypatch: pytest.MonkeyPatch, dev: str, port: int, **kw: Any
) -> Staged:
    """Into ``staging`` (made here), for device ``dev`` and a broker on
    ``port``; ``kw``: more of ``prepare``'s options (mpy, tls, ca_cert...)."""
    monkeypatch.setenv("IGGY_TEST_MQTT_PW", MQTT_PASSWORD)
    staging.mkdir()
    return prepare(
        source_root(),
        "env_sensor",
        staging,
        device_id=dev,
        wifi_ssid="lab",
        wifi_password="wifi-secret",
        broker="127.0.0.1",
        broker_port=port,
        mqtt_password_env="IGGY_TEST_MQTT_PW",
        **kw,
    )
