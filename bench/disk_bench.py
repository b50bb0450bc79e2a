"""Disk: bytes on disk per buffered record, 60-byte JSON payload.

The outbox is filled through `Outbox.submit` (10 devices, topic
``edge/devN/up/env``, a device ``"seq"`` in every payload), closed (which
checkpoints the WAL and truncates it), and the file sizes (database + WAL)
are divided by the record count.  Page-level figures come from `dbstat`
when this SQLite has it.

Reference, same run, same payloads: a minimal SQLite table
``(id INTEGER PRIMARY KEY, payload BLOB)`` -- what any SQLite buffer of
these payloads costs -- and the payload itself (60 bytes).

    .venv/bin/python bench/disk_bench.py [--quick] [--records N]
"""

from __future__ import annotations

import argparse
import asyncio
import sqlite3
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import emit, emit_machine, payload_60
from drain_bench import DEVICES, fill

BENCH = "disk"


def file_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in (path, path.with_name(path.name + "-wal")) if p.exists())


def table_bytes(path: Path) -> dict[str, int]:
    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("SELECT name, sum(pgsize) FROM dbstat GROUP BY name").fetchall()
    except sqlite3.OperationalError:
        return {}
    finally:
        conn.close()
    return {str(n): int(b) for n, b in rows}


def reference_db(path: Path, records: int) -> int:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload BLOB NOT NULL)")
    conn.execute("BEGIN")
    conn.executemany(
        "INSERT INTO t(payload) VALUES (?)",
        ((payload_60(i % DEVICES, i // DEVICES + 1),) for i in range(records)),
    )
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return file_bytes(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    ap.add_argument("--records", type=int, default=100_000)
    a = ap.parse_args()
    records = 2000 if a.quick else a.records
    emit_machine(BENCH)
    with tempfile.TemporaryDirectory(prefix="iggy-edge-disk-") as tmp:
        path = Path(tmp) / "agent" / "buffer.db"
        path.parent.mkdir()
        asyncio.run(fill(path, records))
        total = file_bytes(path)
        tables = table_bytes(path)
        ref = reference_db(Path(tmp) / "ref.db", records)
    per_table = {k: round(v / records, 1) for k, v in tables.items() if v >= 4096 * 4}
    emit(
        BENCH,
        "bytes_per_record",
        round(total / records, 1),
        "bytes/record",
        target=len(payload_60(0, 1)) + 40,
        reference=round(ref / records, 1),
        reference_name="minimal SQLite table (id, payload) of the same payloads",
        payload_bytes=len(payload_60(0, 1)),
        records=records,
        file_bytes=total,
        by_table_bytes_per_record=per_table,
        note="database + WAL after checkpoint(TRUNCATE); includes the ingest_recent redelivery index",
    )


if __name__ == "__main__":
    main()
