"""The WAL header check: SQLite silently ignores a -wal whose header is
invalid (and every commit in it), so a damaged one is copied aside first
(see the package docstring)."""

from __future__ import annotations

import logging
import shutil
import struct
import time
from pathlib import Path
from typing import Final

from .events import Event

log = logging.getLogger(__name__)

WAL_MAGIC: Final = (0x377F0682, 0x377F0683)
WAL_VERSION: Final = 3007000
WAL_HEADER: Final = 32
WAL_FRAME_HEADER: Final = 24


def wal_checksum(data: bytes, big_endian: bool, s0: int = 0, s1: int = 0) -> tuple[int, int]:
    """SQLite's WAL checksum over `data` (a multiple of 8 bytes)."""
    words = struct.unpack((">" if big_endian else "<") + f"{len(data) // 4}I", data)
    for i in range(0, len(words), 2):
        s0 = (s0 + words[i] + s1) & 0xFFFFFFFF
        s1 = (s1 + words[i + 1] + s0) & 0xFFFFFFFF
    return s0, s1


def wal_header_problem(header: bytes) -> str | None:
    """None for a valid WAL header, else what is wrong with it."""
    if len(header) < WAL_HEADER:
        return f"header is {len(header)} bytes, not {WAL_HEADER}"
    magic, version, page_size, _ckpt, _salt1, _salt2, c1, c2 = struct.unpack(">8I", header[:WAL_HEADER])
    if magic not in WAL_MAGIC:
        return f"bad magic 0x{magic:08x}"
    if version != WAL_VERSION:
        return f"unknown format version {version}"
    if page_size < 512 or page_size > 65536 or page_size & (page_size - 1):
        return f"bad page size {page_size}"
    if wal_checksum(header[:24], bool(magic & 1)) != (c1, c2):
        return "header checksum does not match (magic, salts or checksum damaged)"
    return None


def db_page_size(path: Path) -> int:
    """Page size from the database header (offset 16, big-endian; 1 = 65536)."""
    try:
        with path.open("rb") as f:
            head = f.read(18)
    except OSError:
        return 4096
    if len(head) < 18:
        return 4096
    size = int.from_bytes(head[16:18], "big")
    return 65536 if size == 1 else size if size >= 512 else 4096


def check_wal(path: Path, *, now: float | None = None) -> Event | None:
    """Copy a -wal with a damaged header aside before SQLite discards it."""
    wal = path.with_name(path.name + "-wal")
    try:
        size = wal.stat().st_size
        if size < WAL_HEADER:
            return None  # empty (after a checkpoint) or never written: nothing to lose
        with wal.open("rb") as f:
            header = f.read(WAL_HEADER)
    except FileNotFoundError:
        return None
    problem = wal_header_problem(header)
    if problem is None:
        return None
    now = time.time() if now is None else now
    copy = wal.with_name(f"{wal.name}.damaged-{int(now)}")
    shutil.copy2(wal, copy)
    frames = (size - WAL_HEADER) // (WAL_FRAME_HEADER + db_page_size(path))
    log.error(
        "buffer WAL %s is damaged (%s): SQLite will ignore it, so up to %d frames (%d bytes) of the most "
        "recent commits may be MISSING from the buffer; a copy is kept at %s",
        wal,
        problem,
        frames,
        size,
        copy,
    )
    return Event("wal_damaged", now, problem, aside=str(copy), frames_lost=frames)
