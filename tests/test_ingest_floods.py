"""Floods stay bounded (issue 8 item 6): the agent process, flooded through a
real Mosquitto, keeps its peak RSS under a loose bound (200 MB; the benchmark,
bench/flood_bench.py, prints the figures against the 120 MB target).  Before
pending work was bounded by bytes these two floods peaked at 242 MB (800
oversize QoS0 dead letters) and 506 MB (1,500 QoS1 payloads of 256 KiB).
Also: QoS0 dead letters keep to the QoS0 bound, and dead letters are
committed in groups."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from iggy_edge import ingest

from tests.support.agent import make_settings, running_agent
from tests.support.broker import Broker, mosquitto_binary
from tests.support.mqtt import publish_all
from tests.support.wait import async_wait_until

ROOT = Path(__file__).resolve().parent.parent
LOOSE_BOUND_MB = 200


@pytest.mark.parametrize("flood", ["oversize_qos0", "large_qos1"])
def test_flood_peak_rss_is_bounded(flood: str) -> None:
    if mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: run .ci/setup")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "flood_bench.py"), "--floods", flood],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    ).stdout
    (res,) = [json.loads(line) for line in out.splitlines() if f'"{flood}_peak_rss"' in line]
    # every message was taken and settled: a flood that was simply not read would also stay small
    assert res["received"] == res["count"]
    assert res["committed"] + res["dead_letters"] + sum(res["dropped"].values()) == res["count"]
    assert res["agent_exit"] == 0
    assert res["value"] < LOOSE_BOUND_MB, res


async def test_qos0_dead_letters_keep_to_the_qos0_bound(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While dead letters wait for their commit, more QoS0 dead letters than
    the QoS0 bound are dropped and counted, not queued without limit."""
    monkeypatch.setattr(ingest, "QOS0_PENDING_LIMIT", 50)
    release = asyncio.Event()
    async with running_agent(make_settings(tmp_path, broker)) as agent:
        assert agent.outbox is not None
        real = agent.outbox.dead._commit_dead_group  # noqa: SLF001 - hold the store's dead-letter commit

        async def held(group: Any) -> None:
            await release.wait()
            await real(group)

        monkeypatch.setattr(agent.outbox.dead, "_commit_dead_group", held)
        await publish_all(broker.host, broker.port, "flood-q0", [("edge/d/up/env", b"")] * 200, qos=0)
        m = agent.metrics
        await async_wait_until(lambda: m.value("iggy_edge_ingest_messages_total", qos="0") == 200, 20)
        dropped = m.value("iggy_edge_store_dropped_records_total", reason="qos0_queue_full")
        assert dropped == 150
        release.set()
        await async_wait_until(
            lambda: m.value("iggy_edge_store_dead_letters_total", reason="empty_payload") == 50, 20
        )


async def test_dead_letters_are_committed_in_groups(
    tmp_path: Path, broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    groups: list[int] = []
    async with running_agent(make_settings(tmp_path, broker)) as agent:
        assert agent.outbox is not None
        real = agent.outbox.dead._commit_dead_group  # noqa: SLF001 - count the store's dead-letter commits

        async def counted(group: Any) -> None:
            groups.append(len(group.rows))
            await real(group)

        monkeypatch.setattr(agent.outbox.dead, "_commit_dead_group", counted)
        await publish_all(broker.host, broker.port, "flood-g", [("edge/d/up/env", b"")] * 2000, qos=1)
        await async_wait_until(lambda: sum(groups) == 2000, 30)
    assert max(groups) > 1
    assert len(groups) < 2000 / 4, f"{len(groups)} commits for 2000 dead letters"
