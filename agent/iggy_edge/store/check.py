"""Doctor's disk check: the buffer's file system has room for
buffer.max_bytes (and the dead letters' bound, and the WAL) in the file
SQLite actually writes."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Final

from ..buffer_admin import read_stats
from ..checks import Check
from . import ROW_OVERHEAD, StoreError

if TYPE_CHECKING:
    from ..config import Settings

# SQLite's file is larger than the accounted bytes (pages, indexes): measured
# file / accounted after a checkpoint, buffer filled to max_bytes, payloads
# 16 B .. 64 KiB: 0.74 .. 1.32 (worst near 1 KiB payloads: rows per page).
# A larger ratio measured on the actual file wins.
DISK_FACTOR: Final = 1.4
# Beside the file, the WAL: it grows to the largest transaction (a group
# commit: up to commit_max_records / receive_maximum records) on top of the
# auto-checkpoint threshold (1000 pages), and keeps its size.  Measured peak
# file + WAL / accounted with 500-record groups: 1.10 (8 KiB payloads) to 2.03
# (64 KiB payloads, 30 MB max_bytes).
WAL_CHECKPOINT_BYTES: Final = 1000 * 4096
TYPICAL_RECORD_BYTES: Final = 1024  # assumed when the buffer has too few records to measure


def check_disk(settings: Settings) -> Check:
    path = settings.buffer_path
    probe = path.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError as e:
        return Check(
            "disk", "fail", f"cannot inspect {probe}: {e}", "check the buffer path (buffer.path / state_dir)"
        )
    free = st.f_bavail * st.f_frsize
    factor, record, measured = DISK_FACTOR, TYPICAL_RECORD_BYTES, "assuming 1 KiB records"
    try:
        stats = read_stats(path) if path.exists() else None
    except StoreError:
        stats = None
    current = stats.file_bytes if stats is not None else path.stat().st_size if path.exists() else 0
    if stats is not None and stats.records >= 1000:
        record = stats.bytes // stats.records
        factor = max(DISK_FACTOR, stats.file_bytes / stats.bytes)
        measured = f"measured on the file: {factor:.2f} x accounted, {record} B per record"
    group = min(settings.buffer.commit_max_records, settings.mqtt.receive_maximum)
    # a group larger than the whole bound is trimmed to it
    wal = WAL_CHECKPOINT_BYTES + int(min(group * record, settings.buffer.max_bytes) * DISK_FACTOR)
    max_bytes = settings.buffer.max_bytes
    # dead letters have their own bound beside max_bytes (store/dead.py)
    dead_bytes = settings.buffer.max_dead_letter_bytes
    need = int((max_bytes + dead_bytes) * factor) + wal - current
    detail = (
        f"{probe}: {free / 1e6:,.0f} MB free; buffer.max_bytes {max_bytes / 1e6:,.0f} MB "
        f"+ buffer.max_dead_letter_bytes {dead_bytes / 1e6:,.0f} MB "
        f"needs about {max(need, 0) / 1e6:,.0f} MB more ({measured}; WAL {wal / 1e6:,.0f} MB)"
    )
    if free < max(need, 0):
        fit = int((free + current - wal) / factor) - ROW_OVERHEAD - dead_bytes
        return Check(
            "disk",
            "fail",
            detail,
            f"free space on {probe}, or lower buffer.max_bytes to at most {max(fit, 0):,} "
            "(the buffer would fill the disk before its bound applies)",
        )
    if not os.access(probe, os.W_OK):
        return Check(
            "disk",
            "warn",
            detail + f"; {probe} is not writable by this user",
            "run doctor as root or the service user",
        )
    return Check("disk", "ok", detail)
