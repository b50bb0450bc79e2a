"""Memory: peak RSS of the agent with a 1,000,000-record backlog while ingesting.

The backlog is written into the agent's buffer.db beforehand (through
`Outbox.submit`, as drain_bench does).  Then `iggy-edge run` -- the real
command, in its own process, uplink ``none`` so the backlog stays -- is
started against a fresh Mosquitto while `_publisher.py` streams QoS1
telemetry into it (default 2,000 msg/s for 20 s, 10 devices).  VmHWM (the
kernel's peak resident set) is read from /proc/<pid>/status just before
SIGTERM.

Reference, same run: the same agent with an empty buffer under the same
stream -- so the figure shows what the backlog itself costs.

Also printed (issue 14, a lean agent process): ``import_rss`` -- a fresh
interpreter after importing what `iggy-edge run` imports (the CLI's main
module and cli/run.py), and ``idle_rss`` -- the agent 2 s after its start
with an empty buffer, connected, before the stream begins (and with the
backlog, ``idle_rss_backlog``).

    .venv/bin/python bench/memory_bench.py [--quick] [--records N] [--rate R] [--seconds S]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import PYTHON, emit, emit_machine, vm_hwm_kb, vm_rss_kb
from _common import broker as make_broker
from drain_bench import fill

BENCH = "memory"
TARGET_MB = 50  # issue 14 (was 80)
IDLE_TARGET_MB = 40

PRINT_RSS = "import re\nprint(re.search(r'VmRSS:\\s+(\\d+)', open('/proc/self/status').read()).group(1))"
RUN_IMPORTS = "import iggy_edge.cli.main, iggy_edge.cli.run\n"  # what `iggy-edge run` imports


def rss_after_kb(code: str) -> int:
    """VmRSS of a fresh interpreter after running `code`."""
    out = subprocess.run([PYTHON, "-c", code + PRINT_RSS], check=True, capture_output=True, text=True).stdout
    return int(out.split()[-1])


def iggy_edge_cmd() -> list[str]:
    exe = Path(PYTHON).with_name("iggy-edge")
    if exe.exists():
        return [str(exe)]
    return [PYTHON, "-m", "iggy_edge.cli.main"]


def write_config(state: Path, port: int) -> Path:
    conf = state / "config.toml"
    conf.write_text(
        f"""\
gateway_id = "bench"
state_dir = "{state}"

[mqtt]
port = {port}
client_id = "iggy-edge-membench"

[iggy]
kind = "none"

[downlink]
enabled = false

[metrics]
enabled = false

[logging]
level = "WARNING"
"""
    )
    return conf


def outbox_rows(db: Path) -> int:
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return int(conn.execute("SELECT count(*) FROM outbox").fetchone()[0])
    finally:
        conn.close()


def one_agent(workdir: Path, records: int, rate: float, seconds: float) -> dict[str, Any]:
    state = workdir / "state"
    state.mkdir(parents=True)
    if records:
        asyncio.run(fill(state / "buffer.db", records))
    with make_broker(workdir / "broker") as broker:
        conf = write_config(state, broker.port)
        log = (workdir / "agent.log").open("wb")
        agent = subprocess.Popen([*iggy_edge_cmd(), "run", "--config", str(conf)], stdout=log, stderr=log)
        try:
            time.sleep(2.0)  # start-up: open the buffer, count the backlog, connect
            if agent.poll() is not None:
                raise RuntimeError(f"agent exited: {(workdir / 'agent.log').read_text()[-2000:]}")
            start_rss = vm_rss_kb(agent.pid)
            pub = subprocess.run(
                [
                    PYTHON,
                    str(Path(__file__).with_name("_publisher.py")),
                    "--port",
                    str(broker.port),
                    "--rate",
                    str(rate),
                    "--duration",
                    str(seconds),
                ],
                check=True,
                capture_output=True,
                text=True,
                timeout=seconds + 120,
            )
            time.sleep(1.0)  # the last group commits
            hwm = vm_hwm_kb(agent.pid)
            rss = vm_rss_kb(agent.pid)
        finally:
            agent.send_signal(signal.SIGTERM)
            try:
                agent.wait(timeout=30)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
            log.close()
    sent = json.loads(pub.stdout)["sent"]
    return {
        "hwm_mb": hwm / 1024,
        "rss_end_mb": rss / 1024,
        "rss_start_mb": start_rss / 1024,
        "sent": sent,
        "buffered": outbox_rows(state / "buffer.db"),
        "exit": agent.returncode,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--rate", type=float, default=2000.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    a = ap.parse_args()
    records, rate, seconds = (2000, 200.0, 1.0) if a.quick else (a.records, a.rate, a.seconds)
    emit_machine(BENCH)
    emit(
        BENCH,
        "import_rss",
        round(rss_after_kb(RUN_IMPORTS) / 1024, 1),
        "MB",
        reference=round(rss_after_kb("") / 1024, 1),
        reference_name="bare interpreter",
        cmd="python -c 'import iggy_edge.cli.main, iggy_edge.cli.run'",
    )
    with tempfile.TemporaryDirectory(prefix="iggy-edge-mem-") as tmp:
        agent = one_agent(Path(tmp) / "backlog", records, rate, seconds)
        ref = one_agent(Path(tmp) / "empty", 0, rate, seconds)
    emit(
        BENCH,
        "peak_rss",
        round(agent["hwm_mb"], 1),
        "MB",
        target=TARGET_MB,
        reference=round(ref["hwm_mb"], 1),
        reference_name="same agent, same stream, empty buffer",
        backlog_records=records,
        stream=f"{rate:g} msg/s QoS1 for {seconds:g} s",
        rss_start_mb=round(agent["rss_start_mb"], 1),
        rss_end_mb=round(agent["rss_end_mb"], 1),
        sent=agent["sent"],
        buffered_after=agent["buffered"],
        agent_exit=agent["exit"],
        cmd="iggy-edge run (uplink none)",
    )
    emit(
        BENCH,
        "idle_rss",
        round(ref["rss_start_mb"], 1),
        "MB",
        target=IDLE_TARGET_MB,
        note="empty buffer, 2 s after start, before the stream",
        cmd="iggy-edge run (uplink none)",
    )
    emit(
        BENCH,
        "idle_rss_backlog",
        round(agent["rss_start_mb"], 1),
        "MB",
        backlog_records=records,
        note="as idle_rss, with the backlog in the buffer",
        cmd="iggy-edge run (uplink none)",
    )


if __name__ == "__main__":
    main()
