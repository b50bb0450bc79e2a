"""The operator's view: every device at a glance (devices.py, /devices) and
the local dashboard at / (dashboard.py), rendered by a real headless
Chromium against a running agent fed through a real Mosquitto."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import time
import urllib.request
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
from iggy_edge.devices import DeviceTable
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker
from tests.support.mqtt import publish_all
from tests.support.ports import free_port
from tests.support.wait import async_wait_until

# -- the device table (pure) ----------------------------------------------------------


@pytest.mark.unit
def test_device_table_counts_readings_status_and_versions_per_device() -> None:
    t = DeviceTable()
    t.observe("edge/env-1/status", b"online")
    for _ in range(3):
        t.observe("edge/env-1/up/env", b"x" * 10)
    t.observe("edge/env-1/up/ack", b'{"id":"c1","status":"ok"}')  # an ack is not a reading
    t.observe("edge/env-1/up/diag", b'{"lib":"0.2.0","fw":"v1.24.1","heap_free":1}')
    t.observe("edge/env-1/down/receipt", b"{}")  # ours, echoed back
    t.observe("other/env-2/up/env", b"y")  # another layout
    t.observe("edge/bad\x1bid/up/env", b"z")  # not a device id a person could look up
    t.observe("edge/env-2/up/env", b"yy")
    rows = {r["device"]: r for r in t.rows()}
    assert set(rows) == {"env-1", "env-2"}
    one = rows["env-1"]
    assert (one["readings"], one["bytes"], one["status"], one["lib"], one["fw"]) == (
        4,
        30 + 44,
        "online",
        "0.2.0",
        "v1.24.1",
    )
    assert rows["env-2"]["readings"] == 1
    t.observe("edge/env-1/status", b"offline")
    assert {r["device"]: r["status"] for r in t.rows()}["env-1"] == "offline"


@pytest.mark.unit
def test_device_table_lists_stalest_first_and_counts_stale() -> None:
    t = DeviceTable()
    t.observe("edge/a/up/env", b"1")
    time.sleep(0.02)
    t.observe("edge/b/up/env", b"1")
    rows = t.rows(now=time.time() + 100)
    assert [r["device"] for r in rows] == ["a", "b"]
    assert t.stale(50, now=time.time() + 100) == 2
    assert t.stale(50) == 0


@pytest.mark.unit
def test_device_table_is_bounded_and_forgets_the_stalest_tenth() -> None:
    t = DeviceTable(max_devices=100)
    for i in range(100):
        t.observe(f"edge/d{i:03d}/up/env", b"1")
    t.observe("edge/d000/up/env", b"1")  # heard from again: the freshest now
    t.observe("edge/new/up/env", b"1")
    assert len(t) == 91
    assert t.forgotten == 10
    names = {r["device"] for r in t.rows()}
    assert {"d000", "new"} <= names
    assert not names & {f"d{i:03d}" for i in range(1, 11)}
    for i in range(10_000):  # a flood of new ids costs no more than the bound
        t.observe(f"edge/flood{i}/up/env", b"1")
    assert len(t) <= 100


# -- a running agent ----------------------------------------------------------------


def _get(url: str) -> tuple[int, str, bytes]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        return resp.status, resp.headers["Content-Type"], resp.read()


class _Page(HTMLParser):
    """The rendered DOM as Chromium dumps it: the device table's rows and the
    plots' polylines."""

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[tuple[str, list[str]]] = []
        self.lines: dict[str, list[str]] = {}
        self.cards: dict[str, str] = {}
        self._in_devices = False
        self._row: list[str] | None = None
        self._row_class = ""
        self._cell: list[str] | None = None
        self._svg = ""
        self._card: str | None = None
        self._value = False
        self.state = ""
        self._in_state = False

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tbody" and a.get("id") == "devices":
            self._in_devices = True
        elif tag == "tr" and self._in_devices:
            self._row, self._row_class = [], a.get("class") or ""
        elif tag == "td" and self._row is not None:
            self._cell = []
        elif tag == "svg":
            self._svg = a.get("id") or ""
        elif tag == "polyline":
            self.lines.setdefault(self._svg, []).append(a.get("points") or "")
        elif tag == "div" and a.get("class") == "card":
            self._card = a.get("data-key")
        elif tag == "div" and a.get("class") == "v" and self._card:
            self._value = True
        elif tag == "span" and a.get("id") == "state":
            self._in_state = True

    def handle_endtag(self, tag: str) -> None:
        if tag == "tbody":
            self._in_devices = False
        elif tag == "tr" and self._row is not None:
            self.rows.append((self._row_class, self._row))
            self._row = None
        elif tag == "td" and self._cell is not None and self._row is not None:
            self._row.append("".join(self._cell))
            self._cell = None
        elif tag == "div" and self._value:
            self._value = False
            self._card = None
        elif tag == "span":
            self._in_state = False

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        if self._value and self._card:
            self.cards[self._card] = self.cards.get(self._card, "") + data
        if self._in_state:
            self.state += data


def _chromium() -> str:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    if binary is None:
        pytest.fail("chromium is not installed: run .ci/setup (the dashboard test needs a real browser)")
    return binary


def _browse(url: str, shot: Path) -> str:
    """The page's DOM after its scripts ran, and a screenshot of it."""
    base = [_chromium(), "--headless=new", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
            "--virtual-time-budget=5000", "--window-size=1280,900"]  # fmt: skip
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=True)
    subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, timeout=90, check=True)
    return dom.stdout


async def _feed(broker: Broker, stop: asyncio.Event) -> None:
    """quiet-1 sends once and goes silent; env-1 (5 a round) and env-2 (1)
    go on until `stop`."""
    await publish_all(broker.host, broker.port, "t-quiet", [("edge/quiet-1/up/env", b'{"t":20.5}')])
    await publish_all(broker.host, broker.port, "t-status", [("edge/env-1/status", b"online")], retain=True)
    await publish_all(broker.host, broker.port, "t-empty", [("edge/env-2/up/env", b"")])  # a dead letter
    i = 0
    while not stop.is_set():
        i += 1
        round_ = [*[("edge/env-1/up/env", b'{"t":21.0}')] * 5, ("edge/env-2/up/env", b'{"t":19.0}')]
        await publish_all(broker.host, broker.port, f"t-{i}", round_)
        await asyncio.sleep(0.5)


@pytest.mark.xdist_group(
    "machine"
)  # a real browser (CPU-heavy): on the worker of the package builds, not beside them
async def test_device_view_and_dashboard_in_a_real_browser(broker: Broker, tmp_path: Path) -> None:
    port = free_port()
    settings = make_settings(
        tmp_path,
        broker,
        metrics={"enabled": True, "listen": f"127.0.0.1:{port}", "device_stale_s": 3.0},
        iggy={"kind": "memory"},
    )
    base = f"http://127.0.0.1:{port}"
    iggy = MemoryIggy()
    stop = asyncio.Event()
    async with running_agent(settings, iggy.uplink(), components=_http_only()) as agent:
        feeder = asyncio.create_task(_feed(broker, stop))
        await async_wait_until(lambda: len(agent.devices) == 3, 10, what="three devices seen")
        # the plots need two sampling intervals (dashboard.SAMPLE_S = 5 s)
        deadline = time.monotonic() + 15
        while len(await asyncio.to_thread(_series, base)) < 2:
            assert time.monotonic() < deadline, "two samples in 15 s"
            await asyncio.sleep(0.5)

        await async_wait_until(
            lambda: agent.devices.stale(3.0) == 1, 10, what="quiet-1 silent for longer than device_stale_s"
        )
        status, ctype, body = await asyncio.to_thread(_get, f"{base}/devices")
        assert status == 200
        assert ctype == "application/json"
        devices = json.loads(body)["devices"]
        assert devices[0]["device"] == "quiet-1"  # stalest first
        by_id = {d["device"]: d for d in devices}
        assert by_id["quiet-1"]["stale"] is True
        assert by_id["quiet-1"]["readings"] == 1
        assert by_id["env-1"]["stale"] is False
        assert by_id["env-1"]["status"] == "online"
        one, two = by_id["env-1"]["readings"], by_id["env-2"]["readings"]
        assert two >= 10
        assert 5 * two - 5 <= one <= 5 * two + 5  # five a round against one
        assert by_id["env-1"]["rate_per_s"] > by_id["env-2"]["rate_per_s"] > 0
        assert by_id["env-2"]["dead_letters"] == {"empty_payload": 1}
        assert by_id["env-1"]["dead_letters"] == {}
        assert by_id["env-1"]["last_command"] is None

        status, ctype, page = await asyncio.to_thread(_get, f"{base}/")
        assert ctype.startswith("text/html")
        assert not re.search(rb"<(script|link|img)[^>]+(src|href)=", page)  # self-contained: nothing fetched

        shot = tmp_path / "dashboard.png"
        dom = await asyncio.to_thread(_browse, f"{base}/", shot)
        assert shot.stat().st_size > 10_000  # a real picture of the page
        stop.set()
        await feeder

    rendered = _Page()
    rendered.feed(dom)
    rows = {cells[0].replace("  stale", ""): (cls, cells) for cls, cells in rendered.rows}
    assert set(rows) == {"quiet-1", "env-1", "env-2"}, rendered.rows
    assert rows["quiet-1"][0] == "stale"
    assert rows["env-1"][0] == ""
    assert rows["env-1"][1][1] == "online"
    assert int(rows["env-1"][1][3].replace(",", "")) >= one
    assert rows["env-2"][1][9] == "empty_payload 1"
    assert rendered.state == "healthy"
    assert rendered.cards["devices"] == "3"
    # both rate lines and the backlog line, each with one point per interval
    assert len(rendered.lines.get("rates", [])) == 2, rendered.lines
    assert len(rendered.lines.get("backlog", [])) == 1
    assert all(len(p.split()) >= 2 for p in rendered.lines["rates"])


def _series(base: str) -> list[Any]:
    _, _, body = _get(f"{base}/api/overview")
    series: list[Any] = json.loads(body)["series"]
    return series


def _http_only() -> tuple[Any, ...]:
    from iggy_edge.httpd import http_endpoint  # noqa: PLC0415 - only this test runs a bare endpoint

    return (http_endpoint,)


def test_device_table_takes_a_group_at_once_as_it_takes_each_message() -> None:
    """Ingest hands the table each group commit once (`observe_group`, issue
    22): the figures are those of the messages one by one, also when the
    group fills the table and devices are forgotten in the middle of it."""
    msgs = [(f"edge/d{i % 10}/up/env", b"x" * (i % 7)) for i in range(1_000)]
    msgs += [("edge/d1/status", b"online"), ("edge/d1/up/ack", b"{}"), ("edge/d1/down/cmd", b"{}")]
    one, group = DeviceTable(), DeviceTable()
    for topic, payload in msgs:
        one.observe(topic, payload)
    group.observe_group(msgs)
    keys = ("readings", "bytes", "status")
    assert {r["device"]: [r[k] for k in keys] for r in group.rows()} == {
        r["device"]: [r[k] for k in keys] for r in one.rows()
    }
    small = DeviceTable(max_devices=10)
    small.observe_group([(f"edge/n{i}/up/env", b"1") for i in range(25)] + [("edge/n24/up/env", b"1")])
    assert len(small) <= 10
    assert small.forgotten == 25 - len(small)
    assert {r["device"]: r["readings"] for r in small.rows()}["n24"] == 2
