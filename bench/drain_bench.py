"""Drain: a backlog of 1,000,000 outbox records sent to the uplink.

The backlog is filled through `Outbox.submit` (the ingest side of the store,
without MQTT: 100 devices, 60-byte JSON payloads with a device ``"seq"``),
checkpointed, and copied for every run so each run starts from the same file.
Then the real `Forwarder` (default `[forward]` settings) drains it:

* to `MemoryIggy` (``keep_payloads=False``: it keeps ids and keys only) --
  the agent's own cost of read -> build records -> send -> confirm/delete.
  Reference, in the same run on a copy of the same file: plain `sqlite3` (no
  aiosqlite, no record objects, no uplink) reading the same batches in seq
  order and deleting each after reading -- the floor the storage sets.
* to a real Iggy server when ``iggy-server`` is on PATH (started on a free
  port by tests/support/iggy_server.py, one shard, a fresh server per run;
  the agent creates the topic as it does in production: fsync per request),
  with topics of 1, 3 and 12 partitions (``--partitions``).  Reference, same
  run, same server build, same file: the forwarder as it was before issue 14
  (``sequential_drain``: read the oldest batch, send its partitions one after
  the other over one connection, delete it, repeat -- one request in flight).
  Without the server a "skipped" line says why.
* a backlog of 200 kB records (``--large``, default 1,000: 200 MB) to
  `MemoryIggy`: the peak RSS the drain adds, against what the forwarder may
  read ahead (4 x ``batch_bytes``), and its rate.

The uplink's own share is measured apart (``memory_uplink_send_rate``):
`MemoryUplink.send` alone, the records already built, 1,000-record batches
over 500 keys (target 500,000 records/s, so that it stays a small part of a
drain at the 100,000/s target; this was a timed test before).

    .venv/bin/python bench/drain_bench.py [--quick] [--records N] [--repeat R] [--partitions 1,3,12]
                                           [--large N]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from _common import emit, emit_machine, payload_60, skipped, spread
from iggy_edge import heap
from iggy_edge.config import parse_config
from iggy_edge.forward import Forwarder
from iggy_edge.metrics import Metrics
from iggy_edge.records import OutboundRecord, Route, make_message_id
from iggy_edge.store import Incoming, Outbox
from iggy_edge.uplink.iggy import IggyUplink
from iggy_edge.uplink.memory import MemoryIggy

from tests.support.iggy_server import IggyServer

BENCH = "drain"
DEVICES = 10  # disk_bench's fill
DRAIN_DEVICES = 100  # enough keys to reach each of 12 partitions


def _settings(state: Path, **iggy: Any) -> Any:
    return parse_config(
        {
            "gateway_id": "bench",
            "state_dir": str(state),
            "iggy": iggy or {"kind": "none"},
            "buffer": {"synchronous": "normal", "commit_interval_ms": 0},
            "downlink": {"enabled": False},
            "metrics": {"enabled": False},
        },
        env={},
    )


async def fill(path: Path, records: int, devices: int = DEVICES) -> float:
    """Fill a fresh outbox with `records` records of `devices` devices
    (round robin); returns records/s."""
    settings = _settings(path.parent)
    box = await Outbox.open(path, settings.buffer, settings.gateway_id, Metrics())
    box.start()
    routes = [Route("edge", "telemetry", f"dev{d}") for d in range(devices)]
    topics = [f"edge/dev{d}/up/env" for d in range(devices)]
    started = time.perf_counter()
    chunk = 20_000
    now_us = time.time_ns() // 1000
    for lo in range(0, records, chunk):
        done = None
        for i in range(lo, min(records, lo + chunk)):
            d, seq = i % devices, i // devices + 1
            done = box.submit(Incoming(routes[d], topics[d], 1, False, now_us, payload_60(d, seq), seq))
        assert done is not None
        await done
    rate = records / (time.perf_counter() - started)
    await box.close()  # checkpoints the WAL into the main file
    return rate


async def drain(path: Path, records: int, uplink: Any, settings: Any, *, close_uplink: bool = False) -> float:
    """The Forwarder drains the outbox at `path` into `uplink`; seconds."""
    metrics = Metrics()
    box = await Outbox.open(path, settings.buffer, settings.gateway_id, metrics)
    box.start()
    assert box.records == records, (box.records, records)
    forwarder = Forwarder(box, uplink, settings.forward, metrics)
    started = time.perf_counter()
    task = asyncio.create_task(forwarder.run())
    while box.records > 0 and not task.done():  # noqa: ASYNC110 - polling is the stopwatch
        await asyncio.sleep(0.005)
    seconds = time.perf_counter() - started
    forwarder.stop()
    await task
    if close_uplink:
        await uplink.close()
    await box.close()
    sent = metrics.value("iggy_edge_forward_records_total")
    if sent != records:
        raise RuntimeError(f"forwarded {sent} of {records}")
    return seconds


def reference(path: Path, records: int, batch: int) -> float:
    """Plain sqlite3: read each batch in seq order, delete it; seconds."""
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    started = time.perf_counter()
    done = 0
    while True:
        rows = conn.execute(
            "SELECT seq, source_id, flags, received_us, device_seq, payload FROM outbox ORDER BY seq LIMIT ?",
            (batch,),
        ).fetchall()
        if not rows:
            break
        conn.execute("BEGIN IMMEDIATE")
        conn.execute("DELETE FROM outbox WHERE seq BETWEEN ? AND ?", (rows[0][0], rows[-1][0]))
        conn.execute("COMMIT")
        done += len(rows)
    seconds = time.perf_counter() - started
    conn.close()
    if done != records:
        raise RuntimeError(f"reference read {done} of {records}")
    return seconds


async def uplink_send(records: int, repeat: int) -> list[float]:
    """MemoryUplink.send alone, `repeat` times over `records` records (in
    1,000-record batches, 500 keys); records/s of each run.  (Was
    tests/test_uplink_memory.py::test_million_records_fast_enough.)"""
    keys = [f"dev-{i}" for i in range(500)]
    batch = 1000
    batches = [
        [
            OutboundRecord(
                seq=b * batch + i + 1,
                message_id=make_message_id(0xABCD, 7, b * batch + i + 1),
                stream="edge",
                topic="telemetry",
                key=keys[i % len(keys)],
                payload=b"p",
                headers={"mqtt-topic": f"edge/{keys[i % len(keys)]}/up/t"},
            )
            for i in range(batch)
        ]
        for b in range(max(1, min(records, 100_000) // batch))
    ]
    # At most 100,000 distinct records in memory, sent again until `records`.
    rounds = max(1, records // (len(batches) * batch))
    sent = rounds * len(batches) * batch
    rates = []
    for _ in range(repeat):
        iggy = MemoryIggy(keep_payloads=False)
        up = iggy.uplink()
        started = time.perf_counter()
        for _ in range(rounds):
            for b in batches:
                await up.send(b)
        rates.append(sent / (time.perf_counter() - started))
        if iggy.count() != sent:
            raise RuntimeError(f"memory iggy holds {iggy.count()} of {sent}")
    return rates


LARGE_PAYLOAD = 200_000


def _vm_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


async def fill_large(path: Path, records: int) -> None:
    """`records` records of LARGE_PAYLOAD bytes (10 devices), committed 20 at a time."""
    settings = _settings(path.parent)
    box = await Outbox.open(path, settings.buffer, settings.gateway_id, Metrics())
    box.start()
    done = None
    for i in range(records):
        d = i % DEVICES
        item = Incoming(
            Route("edge", "telemetry", f"dev{d}"),
            f"edge/dev{d}/up/blob",
            1,
            False,
            0,
            bytes([i % 256]) * LARGE_PAYLOAD,
        )
        done = box.submit(item)
        if i % 20 == 19:
            await done
    if done is not None:
        await done
    await box.close()


def large_payloads(work: Path, records: int) -> None:
    """A backlog of 200 kB records drained to the in-memory uplink: the rate
    and the peak RSS the drain adds (VmHWM reset through /proc/self/clear_refs
    just before it).  Before the byte cut moved into SQLite, each read loaded
    `batch_records` payloads (200 MB) to return five."""
    path = work / "large" / "buffer.db"
    path.parent.mkdir()
    asyncio.run(fill_large(path, records))
    heap.trim()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before = _vm_kb("VmRSS")
    settings = _settings(path.parent)
    secs = asyncio.run(drain(path, records, MemoryIggy(keep_payloads=False).uplink(), settings))
    peak_extra = (_vm_kb("VmHWM") - before) / 1024
    f = settings.forward
    emit(
        BENCH,
        "large_payload_drain_peak_rss",
        round(peak_extra, 1),
        "MB",
        reference=round(f.batch_bytes * 4 / 2**20, 1),
        reference_name="payload bytes the forwarder may read ahead (4 x batch_bytes)",
        records=records,
        payload_bytes=LARGE_PAYLOAD,
        backlog_mb=round(records * LARGE_PAYLOAD / 1e6),
        rate=round(records / secs),
        rate_mb_s=round(records * LARGE_PAYLOAD / secs / 1e6, 1),
        note="peak RSS added by the drain over the process before it",
    )
    shutil.rmtree(path.parent)


def copy_db(src: Path, dst: Path) -> Path:
    dst.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(src, dst)
    return dst


async def sequential_drain(path: Path, records: int, uplink: IggyUplink, settings: Any) -> float:
    """The reference: the forwarder's loop before issue 14 -- read the oldest
    batch, `send` it (its partitions one after the other, one connection),
    delete it, repeat.  Seconds (uplink start included, as in `drain`)."""
    box = await Outbox.open(path, settings.buffer, settings.gateway_id, Metrics())
    box.start()
    assert box.records == records, (box.records, records)
    s = settings.forward
    started = time.perf_counter()
    try:
        await uplink.start()
        sent = 0
        while box.records > 0:
            batch = await box.read_batch(s.batch_records, s.batch_bytes)
            await uplink.send(batch)
            sent += await box.confirm(batch)
        seconds = time.perf_counter() - started
    finally:
        await uplink.close()
        await box.close()
    if sent != records:
        raise RuntimeError(f"reference forwarded {sent} of {records}")
    return seconds


def _iggy_once(src: Path, workdir: Path, records: int, partitions: int, *, pipelined: bool) -> float:
    """One drain of a copy of `src` into a fresh iggy-server; records/s."""
    shutil.rmtree(workdir, ignore_errors=True)
    server = IggyServer(workdir / "iggy").start()
    try:
        path = copy_db(src, workdir / "agent" / "buffer.db")
        settings = _settings(
            path.parent,
            kind="iggy",
            address=server.address,
            username=server.username,
            password=server.password,
            partitions=partitions,
        )
        uplink = IggyUplink(settings.iggy, settings.gateway_id, topics=[("edge", "telemetry")])
        if pipelined:
            seconds = asyncio.run(drain(path, records, uplink, settings, close_uplink=True))
        else:
            seconds = asyncio.run(sequential_drain(path, records, uplink, settings))
    finally:
        server.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return records / seconds


def run_iggy(src: Path, workdir: Path, records: int, partitions: list[int], repeat: int) -> None:
    if shutil.which("iggy-server") is None:
        skipped(BENCH, "iggy_rate", "iggy-server not on PATH (see tests/support/iggy_server.py to build it)")
        return
    for n in partitions:
        rates: list[float] = []
        ref_rates: list[float] = []
        for r in range(repeat):
            order = (True, False) if r % 2 == 0 else (False, True)
            for pipelined in order:
                rate = _iggy_once(src, workdir / f"iggy-{n}", records, n, pipelined=pipelined)
                (rates if pipelined else ref_rates).append(rate)
        s, ref = spread(rates, 0), spread(ref_rates, 0)
        emit(
            BENCH,
            f"iggy_rate_{n}p",
            s["median"],
            "records/s",
            target=100_000,
            partitions=n,
            records=records,
            spread=s,
            reference=ref["median"],
            reference_name="one batch in flight (the forwarder before issue 14), same server and file",
            reference_spread=ref,
            speedup=round(s["median"] / ref["median"], 2),
            devices=DRAIN_DEVICES,
            uplink="real iggy-server on loopback (1 shard), topic created by the agent (fsync per request)",
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, one repeat (smoke test)")
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-iggy", action="store_true", help="skip the real Iggy runs")
    ap.add_argument("--partitions", default="1,3,12", help="partition counts of the real Iggy runs")
    ap.add_argument(
        "--large", type=int, default=1000, help="records of 200 kB for the large-payload drain (0: skip)"
    )
    a = ap.parse_args()
    records, repeat = (5000, 1) if a.quick else (a.records, a.repeat)
    partitions = [int(x) for x in a.partitions.split(",") if x]
    emit_machine(BENCH)
    with tempfile.TemporaryDirectory(prefix="iggy-edge-drain-") as tmp:
        work = Path(tmp)
        src = work / "src" / "buffer.db"
        src.parent.mkdir()
        fill_rate = asyncio.run(fill(src, records, DRAIN_DEVICES))
        emit(
            BENCH,
            "fill_rate",
            round(fill_rate),
            "records/s",
            records=records,
            note="Outbox.submit group commit, synchronous=normal, no MQTT",
        )
        batch = _settings(work).forward.batch_records
        rates: list[float] = []
        ref_rates: list[float] = []
        for r in range(repeat):
            run = work / f"run{r}"
            pair = [
                ("agent", copy_db(src, run / "agent" / "buffer.db")),
                ("ref", copy_db(src, run / "ref" / "buffer.db")),
            ]
            for name, path in pair[:: 1 if r % 2 == 0 else -1]:
                if name == "agent":
                    iggy = MemoryIggy(keep_payloads=False)
                    secs = asyncio.run(drain(path, records, iggy.uplink(), _settings(path.parent)))
                    if iggy.count() != records:
                        raise RuntimeError(f"memory iggy holds {iggy.count()} of {records}")
                    rates.append(records / secs)
                else:
                    ref_rates.append(records / reference(path, records, batch))
            shutil.rmtree(run)
        s = spread(rates, 0)
        ref_median = spread(ref_rates, 0)["median"]
        emit(
            BENCH,
            "memory_rate",
            s["median"],
            "records/s",
            target=200_000,
            ratio=round(s["median"] / ref_median, 2),
            ratio_target=0.5,
            records=records,
            seconds=round(records / s["median"], 2),
            spread=s,
            reference=spread(ref_rates, 0)["median"],
            reference_name="plain sqlite3 read+delete of the same batches",
            reference_spread=spread(ref_rates, 0),
            batch_records=batch,
            uplink="MemoryIggy(keep_payloads=False)",
        )
        send = spread(asyncio.run(uplink_send(records, repeat)), 0)
        emit(
            BENCH,
            "memory_uplink_send_rate",
            send["median"],
            "records/s",
            target=500_000,
            records=records,
            spread=send,
            note="MemoryUplink.send alone, 1000-record batches over 500 keys",
        )
        if a.large:
            large_payloads(work, 50 if a.quick else a.large)
        if not a.no_iggy:
            run_iggy(src, work, records, partitions, 1 if a.quick else max(1, repeat - 1))


if __name__ == "__main__":
    main()
