"""Give memory back after a flood of large payloads.

glibc serves allocations above its mmap threshold (128 KiB at start) with
mmap, and unmaps them when freed.  But after the first such free it raises
the threshold to that size (dynamically, up to 32 MiB), so from then on 256
KiB payloads come from the heap, which fragments and is not returned: after
1,500 QoS1 payloads of 256 KiB the agent stayed at its 185 MB peak.  Fixing
the threshold at 128 KiB (which also turns that adjustment off) kept it near
its working set (bench/flood_bench.py; the figures are in docs/operations.md).
On a C library without `mallopt` (musl) this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import logging
from typing import Final

log = logging.getLogger(__name__)

M_MMAP_THRESHOLD: Final = -3  # glibc malloc.h
MMAP_THRESHOLD_BYTES: Final = 128 * 1024


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Pin glibc's mmap threshold (process-wide); False when not glibc."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        log.debug("no mallopt in this C library: the mmap threshold stays dynamic")
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, nbytes))


def trim() -> None:
    """Return the free memory at the top of glibc's heaps to the system
    (after a flood; a few milliseconds)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        return


# Python starts a full collection of the cyclic garbage collector after 10
# collections of its middle generation; a full one walks every object of the
# process (modules, gmqtt, pydantic, prometheus: 40-80 ms each here).  The
# groups in flight (thousands of records, acks and messages at a time) drive
# the young collections, so a drain of 100,000 messages paid six full ones
# (0.3-0.5 s: about a fifth of ingest's CPU, bench/ingest_bench.py).  After
# 100 instead, none ran in such a drain.  Young collections keep their pace,
# so short-lived cycles are freed as before; only garbage old enough to be in
# the old generation waits longer.
FULL_COLLECTION_AFTER: Final = 100


def spare_full_collections() -> None:
    """Process-wide (ingest calls it once, beside fix_mmap_threshold): full
    collections after FULL_COLLECTION_AFTER middle-generation collections,
    unless the collector is off or already set to wait longer."""
    young, middle, full = gc.get_threshold()
    if young and full < FULL_COLLECTION_AFTER:
        gc.set_threshold(young, middle, FULL_COLLECTION_AFTER)
