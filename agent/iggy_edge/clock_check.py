"""Doctor's clock check: the system time is plausible (a Pi without RTC
boots in 1970 until NTP syncs; receive times and TTLs depend on it) and NTP
synchronisation where systemd-timesyncd reports it."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Final

from .checks import Check

MIN_YEAR: Final = 2024


def check_clock(now: float | None = None) -> Check:
    now = time.time() if now is None else now
    year = time.gmtime(now).tm_year
    if year < MIN_YEAR:
        return Check(
            "clock",
            "fail",
            f"system time is {time.strftime('%Y-%m-%d %H:%M:%SZ', time.gmtime(now))}",
            "the clock is not set (no RTC?): enable NTP (timedatectl set-ntp true) and check network access "
            "to the NTP servers; receive times and TTLs depend on it",
        )
    stamp = time.strftime("%Y-%m-%d %H:%M:%SZ", time.gmtime(now))
    synced = Path("/run/systemd/timesync/synchronized")
    if Path("/run/systemd/timesync").is_dir() and not synced.exists():
        return Check(
            "clock",
            "warn",
            f"{stamp}, but systemd-timesyncd has not synchronised yet",
            "check: timedatectl timesync-status",
        )
    return Check("clock", "ok", stamp + (" (NTP synchronised)" if synced.exists() else ""))
