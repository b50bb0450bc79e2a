"""Shared pieces of the benchmarks: a throw-away Mosquitto, the JSON line
format, the machine description and medians.

Every benchmark prints one JSON object per line and figure::

    {"bench": "ingest", "figure": "qos1_full_rate", "value": 12345.0,
     "unit": "msg/s", "reference": 14000.0, ...}

Figures on a shared machine are noisy: each benchmark runs its reference in
the same run, repeats (``--repeat``, default 3) and reports the median with
the spread (min/max) of the repeats.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable
sys.path.insert(0, str(ROOT))

from tests.support.broker import Broker  # noqa: E402
from tests.support.ports import free_port, wait_port  # noqa: E402

__all__ = ["Broker", "broker", "free_port", "wait_port"]


def emit(bench: str, figure: str, value: Any, unit: str = "", **extra: Any) -> None:
    """One figure as one JSON line on stdout (flushed: runners read it live)."""
    line = {"bench": bench, "figure": figure, "value": value, "unit": unit, **extra}
    print(json.dumps(line, separators=(",", ":")), flush=True)


def skipped(bench: str, figure: str, reason: str) -> None:
    emit(bench, figure, None, skipped=True, reason=reason)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def emit_machine(bench: str) -> None:
    load1, _, _ = os.getloadavg()
    emit(
        bench,
        "machine",
        os.cpu_count(),
        "cpus",
        cpu=cpu_model(),
        python=platform.python_version(),
        loadavg_1m=round(load1, 2),
        kernel=platform.release(),
    )


def spread(values: list[float], digits: int = 1) -> dict[str, Any]:
    """Median plus min/max and the raw repeats, for the JSON line."""
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
        "runs": [round(v, digits) for v in values],
    }


def median(values: list[float]) -> float:
    return float(statistics.median(values))


def broker(workdir: Path, *, queue_qos0: bool = False) -> Broker:
    """The tests' Mosquitto (configured like the shipped snippet: deep queues
    for the agent's persistent session), in memory for the benchmarks."""
    return Broker(
        workdir,
        persistence=False,
        extra_conf="queue_qos0_messages true" if queue_qos0 else "",
    )


def payload_60(device: int, seq: int) -> bytes:
    """A 60-byte telemetry JSON like the example firmware sends."""
    body = b'{"seq":%d,"t":21.37,"rh":45.2,"hpa":1013.2,"dev":%d}' % (seq, device)
    return body.ljust(60, b" ")


def vm_hwm_kb(pid: int) -> int:
    """Peak resident set size (VmHWM) of a live process, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmHWM for pid {pid}")


def vm_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
