"""Floods stay bounded (issue 8 item 6): the agent process, flooded through a
real Mosquitto, keeps its peak RSS under a loose bound (200 MB; the benchmark,
bench/flood_bench.py, prints the figures against the 120 MB target).  Before
pending work was bounded by bytes these two floods peaked at 242 MB (800
oversize QoS0 dead letters) and 506 MB (1,500 QoS1 payloads of 256 KiB)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.broker import mosquitto_binary

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
