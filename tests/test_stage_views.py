"""httpd, the dashboard, systemd and receipts see the agent only through
the narrow interfaces of stages.py (`HttpView`, `StatusView`, `Publish`):
each is served here by a small stand-in, not an `Agent` (issue 22: no
upward reach into `Agent`'s stage fields)."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path
from typing import Any, cast

import pytest
from iggy_edge.config import ReceiptSettings, Settings, parse_config
from iggy_edge.devices import DeviceTable
from iggy_edge.downlink.component import AckListener
from iggy_edge.httpd import MetricsServer
from iggy_edge.ingest import Ingest
from iggy_edge.metrics import Metrics
from iggy_edge.receipts import Receipts
from iggy_edge.routing import Router
from iggy_edge.stages import Health, HttpView, StatusView
from iggy_edge.systemd import _status_line

from tests.support.ports import free_port

pytestmark = pytest.mark.unit


class View:
    """Only what stages.HttpView names: no outbox, ingest or receipts."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.metrics = Metrics()
        self.devices = DeviceTable(settings.topics)
        self.devices.observe("site/d1/up/env", b'{"seq":1}')
        self.devices.observe("edge/other/up/env", b"{}")  # another layout: not a device here

    def health(self) -> Health:
        return Health(True, "up", "ok", "none")

    @property
    def backlog_records(self) -> int:
        return 4

    @property
    def buffer_instance(self) -> str | None:
        return "1234"

    def backlog_by_device(self) -> dict[str, tuple[int, int]]:
        return {"d1": (4, 400)}

    def unreceipted(self) -> dict[str, float]:
        return {"d1": 2.0}

    async def wait_up(self, timeout: float) -> bool:
        return True


def settings(tmp_path: Path) -> Settings:
    raw = {"gateway_id": "gw-v", "state_dir": str(tmp_path), "topic_prefix": "site"}
    return parse_config(raw, env={})


def fetch(url: str) -> tuple[int, Any]:
    with urllib.request.urlopen(url, timeout=5) as r:
        body = r.read()
        return r.status, json.loads(body) if r.headers.get_content_type() == "application/json" else body


async def test_http_endpoints_need_only_the_http_view(tmp_path: Path) -> None:
    view: HttpView = View(settings(tmp_path))
    server = MetricsServer(view, f"127.0.0.1:{free_port()}")
    await server.start()
    base = f"http://127.0.0.1:{server.port}"
    try:
        status, doc = await asyncio.to_thread(fetch, f"{base}/health")
        assert status == 200
        assert doc["instance"] == "1234"
        _, devices = await asyncio.to_thread(fetch, f"{base}/devices")
        (row,) = devices["devices"]
        assert (row["device"], row["buffered"], row["unreceipted_age_s"]) == ("d1", 4, 2.0)
        _, overview = await asyncio.to_thread(fetch, f"{base}/api/overview")
        assert overview["figures"]["devices"] == 1
        _, text = await asyncio.to_thread(fetch, f"{base}/metrics")
        assert b"iggy_edge_devices_seen 1.0" in text
    finally:
        await server.close()


def test_systemd_status_line_needs_only_the_status_view(tmp_path: Path) -> None:
    view: StatusView = View(settings(tmp_path))
    assert _status_line(view) == "STATUS=ingest up, store ok, uplink none, backlog 4 records"


async def test_receipts_publish_through_the_session_that_owns_the_client(tmp_path: Path) -> None:
    s = settings(tmp_path)
    ingest = Ingest(s, cast(Any, None), Router(s.routes, 1024), Metrics())
    assert ingest.publish("site/d1/down/receipt", b"{}", True) is False  # no session: not published


async def test_receipts_and_device_acks_follow_the_topic_layout(tmp_path: Path) -> None:
    s = settings(tmp_path)
    sent: list[str] = []

    def publish(topic: str, payload: bytes, retain: bool) -> bool:
        sent.append(topic)
        return True

    r = Receipts(ReceiptSettings(min_interval_ms=0), Metrics(), publish, s.topics)
    r.observe_group([("site/d1/up/env", b'{"seq":1}'), ("edge/d2/up/env", b'{"seq":1}')])
    assert sent == ["site/d1/down/receipt"]
    acks = AckListener(s, cast(Any, None), Metrics(), cast(Any, None))
    acks.observe("site/d1/up/ack", b'{"id":"c1","status":"ok"}')
    acks.observe("edge/d1/up/ack", b'{"id":"c2","status":"ok"}')  # not this layout's
    assert acks._queue.qsize() == 1  # noqa: SLF001 - what was taken for the inbox
