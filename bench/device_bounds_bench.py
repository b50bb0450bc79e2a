"""Per-device bounds (issue 18 items 5-7), in process (Outbox only, no broker):
a quiet device's 100 readings kept while another floods 3,000 past
max_records = 1000; buffer.db size and accounted dead-letter bytes after 400
oversize (270 kB) dead letters; sources cached after reopening a buffer that
took 100,000 distinct topics from one device; the process's peak RSS.

    PYTHONPATH=$PWD/agent .venv/bin/python bench/device_bounds_bench.py

Run it with PYTHONPATH pointing at an older agent for the before figures.
"""

from __future__ import annotations

import asyncio
import os
import resource
import tempfile
from pathlib import Path

from iggy_edge.buffer_admin import read_stats
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox

BIG = 1 << 40


def reading(device: str, topic: str, i: int) -> Incoming:
    return Incoming(Route("edge", "telemetry", device), topic, 1, False, i, b"x" * 60, i)


async def main() -> None:
    path = Path(tempfile.mkdtemp()) / "buffer.db"
    settings = BufferSettings(commit_interval_ms=0, max_records=1000)
    box = await Outbox.open(path, settings, "gw-bench", Metrics())
    box.start()
    for _ in range(400):
        await box.dead_letter(
            mqtt_topic="edge/d/up/env",
            payload=os.urandom(270_000),
            qos=1,
            retain=False,
            reason="oversize",
            detail="",
        )
    for f in [box.submit(reading("quiet", "edge/quiet/up/env", i)) for i in range(100)]:
        await f
    for start in range(0, 3000, 200):
        for f in [box.submit(reading("flood", "edge/flood/up/env", i)) for i in range(start, start + 200)]:
            await f
    quiet = sum(1 for r in await box.read_batch(BIG, BIG) if r.key == "quiet")
    admit = getattr(box, "admit", None)  # absent before issue 18
    for i in range(100_000):
        topic = f"edge/d1/up/c{i}"
        if admit is None or admit(Route("edge", "telemetry", "d1"), topic) is None:
            await box.submit(reading("d1", topic, i))
    await box.close()
    st = read_stats(path)
    box = await Outbox.open(path, settings, "gw-bench", Metrics())
    cached = len(box.catalog.source_names)
    await box.close()
    print(
        f"quiet_kept={quiet}/100 file_MB={st.file_bytes / 1e6:.1f}"
        f" dead_letter_accounted_MB={getattr(st, 'dead_letter_bytes', 0) / 1e6:.2f}"
        f" sources_cached_after_reopen={cached}"
        f" peak_rss_MB={resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f}"
    )


if __name__ == "__main__":
    asyncio.run(main())
