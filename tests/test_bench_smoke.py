"""Every benchmark runs in --quick mode and prints JSON lines that parse.

Only the shape is checked, never the figures: timings on a shared machine are
not a test (see bench/ for the measured numbers)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.broker import mosquitto_binary

ROOT = Path(__file__).resolve().parent.parent
BENCHES = [
    "ingest",
    "drain",
    "memory",
    "disk",
    "dead_letter",
    "flood",
    "broker_crash",
    "fleet",
    "ota",
    "idle",
]


@pytest.mark.parametrize("name", BENCHES)
def test_bench_quick_prints_json_figures(name: str) -> None:
    if name in ("ingest", "memory", "flood", "broker_crash", "ota") and mosquitto_binary() is None:
        pytest.fail("mosquitto is not installed: run .ci/setup")
    extra = ["--no-iggy"] if name == "drain" else []
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / f"{name}_bench.py"), "--quick", *extra],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    # the bench's own stderr says why it failed; CalledProcessError would hide it
    assert run.returncode == 0, f"{name}_bench.py --quick exited {run.returncode}:\n{run.stderr[-4000:]}"
    out = run.stdout
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    assert lines, "no output"
    assert all(line["bench"] == name and "figure" in line and "value" in line for line in lines)
    figures = {line["figure"] for line in lines}
    assert "machine" in figures
    assert len(figures) > 1, figures
