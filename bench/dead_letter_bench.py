"""Dead letters under a flood: 50,000 unroutable QoS0 messages with empty
payloads (issue 8, item 6), store side only (no MQTT).

* ``grouped``: `Outbox.enqueue_dead_letter` -- synchronous, one small row per
  letter, committed in groups (at most 1000 letters / 4 MiB each);
* ``task_each``: what ingest did before -- one task per letter awaiting
  `Outbox.dead_letter` (which now joins the same groups);

Each prints the time to commit them all and the Python heap peak while they
wait (tracemalloc), plus the process RSS after the run (ru_maxrss is the
peak of the whole process, so the modes run in separate processes).

    .venv/bin/python bench/dead_letter_bench.py [--quick] [--mode grouped|task_each]
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, emit_machine
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.store import Outbox

BENCH = "dead_letter"


async def run(mode: str, n: int) -> None:
    with tempfile.TemporaryDirectory() as d:
        box = await Outbox.open(
            Path(d) / "buffer.db", BufferSettings(max_dead_letters=n), "gw-bench", Metrics()
        )
        box.start()
        tracemalloc.start()
        started = time.perf_counter()
        futures: list[asyncio.Future[None]] = []
        for i in range(n):
            kw = {
                "mqtt_topic": f"flood/{i % 100}",
                "payload": b"",
                "qos": 0,
                "retain": False,
                "reason": "unroutable",
                "detail": "no route",
            }
            if mode == "grouped":
                futures.append(box.enqueue_dead_letter(**kw))  # type: ignore[arg-type]
            else:
                futures.append(asyncio.ensure_future(box.dead_letter(**kw)))  # type: ignore[arg-type]
        await asyncio.gather(*futures)
        seconds = time.perf_counter() - started
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        await box.close()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    emit(BENCH, f"{mode}_seconds", round(seconds, 2), "s", letters=n)
    emit(
        BENCH,
        f"{mode}_heap_peak",
        round(peak / 1e6, 1),
        "MB",
        letters=n,
        note="tracemalloc peak while pending",
    )
    emit(
        BENCH,
        f"{mode}_rss_peak",
        round(rss, 1),
        "MB",
        letters=n,
        note="process ru_maxrss, tracemalloc on (it adds its own overhead)",
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mode", choices=["grouped", "task_each"])
    ap.add_argument("--letters", type=int, default=50_000)
    args = ap.parse_args()
    n = 2000 if args.quick else args.letters
    if args.mode:
        asyncio.run(run(args.mode, n))
        return
    emit_machine(BENCH)
    for mode in ("grouped", "task_each"):
        subprocess.run([sys.executable, __file__, "--mode", mode, "--letters", str(n)], check=True)


if __name__ == "__main__":
    main()
