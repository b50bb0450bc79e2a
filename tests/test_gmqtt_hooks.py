"""Canary for the gmqtt hooks: they match the installed gmqtt, and a gmqtt
that renamed or reshaped anything they touch fails loudly at start-up, naming
it, with nothing half-installed.  (The live session's hooks and the one-write
acknowledgements are checked against Mosquitto in test_ingest_fast_path.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import gmqtt
import pytest
from gmqtt.mqtt.connection import MQTTConnection
from gmqtt.mqtt.handler import MqttPackageHandler
from gmqtt.mqtt.protocol import MQTTProtocol
from iggy_edge import gmqtt_hooks
from iggy_edge.gmqtt_hooks import GmqttInternalsChanged, check_gmqtt, problems
from iggy_edge.ingest import Ingest
from iggy_edge.metrics import Metrics
from iggy_edge.routing import Router

from tests.support.agent import make_settings

pytestmark = pytest.mark.unit


@pytest.fixture
def fresh_check() -> Iterator[None]:
    """check_gmqtt() runs once per process; these tests run it again."""
    check_gmqtt.cache_clear()
    yield
    check_gmqtt.cache_clear()


def test_installed_gmqtt_matches_the_hooks() -> None:
    assert problems() == []
    check_gmqtt()


def test_renamed_keepalive_attribute_is_named(monkeypatch: pytest.MonkeyPatch, fresh_check: None) -> None:
    """If gmqtt renamed `_last_data_in`, writing it would silently stop
    feeding the keepalive: the check reads gmqtt's own keepalive code."""

    def keep_connection(self: Any) -> None:
        self._last_byte_in = 0.0

    monkeypatch.setattr(MQTTConnection, "_keep_connection", keep_connection)
    with pytest.raises(GmqttInternalsChanged, match=r"_keep_connection no longer uses '_last_data_in'"):
        check_gmqtt()


def test_renamed_method_is_named(monkeypatch: pytest.MonkeyPatch, fresh_check: None) -> None:
    monkeypatch.delattr(MqttPackageHandler, "_handle_qos_1_publish_packet")
    with pytest.raises(GmqttInternalsChanged, match=r"_handle_qos_1_publish_packet is missing"):
        check_gmqtt()


def test_changed_signature_is_named(monkeypatch: pytest.MonkeyPatch, fresh_check: None) -> None:
    async def read(self: Any, n: int = -1, timeout: float = 0) -> bytes:
        return b""

    monkeypatch.setattr(MQTTProtocol, "read", read)
    with pytest.raises(GmqttInternalsChanged, match=r"MQTTProtocol.read\(.*\) no longer takes"):
        check_gmqtt()


def test_agent_start_fails_loudly(monkeypatch: pytest.MonkeyPatch, fresh_check: None, tmp_path: Path) -> None:
    monkeypatch.delattr(MQTTConnection, "put_package")
    settings = make_settings(tmp_path)
    with pytest.raises(GmqttInternalsChanged, match="put_package"):
        Ingest(settings, cast(Any, None), Router(settings.routes, 1024), Metrics())


class _Sink:
    def raw_publish(self, conn: Any, cmd: int, body: bytes, v5: bool) -> bool:
        return True

    def parsed_publish(self, *args: Any) -> None:
        pass

    def hook_error(self, exc: Exception) -> None:
        pass


def test_nothing_is_half_installed() -> None:
    """An install that finds a piece missing changes nothing."""
    client = gmqtt.Client("canary")
    handler = vars(client)["_package_handler"]
    del handler._connection_state  # noqa: SLF001 - simulate a gmqtt without it
    with pytest.raises(GmqttInternalsChanged, match="_connection_state"):
        gmqtt_hooks.install_publish_hooks(client, _Sink())
    assert "_handle_publish_packet" not in vars(handler)
    assert "_handle_qos_1_publish_packet" not in vars(handler)


def test_hooks_come_before_the_first_dispatch() -> None:
    """gmqtt caches its handler lookup: a hook installed after the first
    packet would never run, so installing then is refused."""
    client = gmqtt.Client("canary-late")
    handler = vars(client)["_package_handler"]
    handler._handler_cache[0x30] = handler._handle_publish_packet  # noqa: SLF001 - as gmqtt's dispatch does
    with pytest.raises(GmqttInternalsChanged, match="before connect"):
        gmqtt_hooks.install_publish_hooks(client, _Sink())
