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
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listening on 127.0.0.1:{port} after {timeout}s") from None
            time.sleep(0.05)


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )


@dataclass
class Broker:
    """Mosquitto on a free loopback port, configured like the shipped snippet
    (deep queues for the agent's persistent session).  In-memory only: the
    benchmarks measure the agent, not the broker's autosave."""

    workdir: Path
    port: int = field(default_factory=free_port)
    queue_qos0: bool = False
    proc: subprocess.Popen[bytes] | None = None

    host = "127.0.0.1"

    def start(self) -> Broker:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("mosquitto is not installed (run .ci/setup)")
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        conf.write_text(
            f"""\
listener {self.port} 127.0.0.1
allow_anonymous true
persistence false
max_queued_messages 0
max_queued_bytes 0
max_inflight_messages 0
queue_qos0_messages {"true" if self.queue_qos0 else "false"}
log_dest stderr
log_type error
log_type warning
log_type notice
log_type information
"""
        )
        # stderr to a file we open: mosquitto started as root drops to its own
        # user and could not open a log file in our temporary directory.
        with (self.workdir / "mosquitto.log").open("wb") as log:
            self.proc = subprocess.Popen([binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=log)
        try:
            wait_port(self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
