"""Logging helpers: one event per line, and rate limiting for repeating events.

A failure that repeats (uplink down, buffer full) is logged at most once per
`interval` per key, with the number of suppressed repeats; rates belong in
metrics, not in logs.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        if len(self._last) > 1024:  # bounded: keys are a small fixed set in practice
            self._last = {key: now}
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            self._logger.log(level, msg + " (%d similar suppressed)", *args, suppressed)
        else:
            self._logger.log(level, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args)


def setup_logging(level: str = "INFO", fmt: str = "text") -> None:
    """One event per line on stderr (journald adds its own timestamps)."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # gmqtt logs every (re)connection attempt at INFO/WARNING; ours say it once.
    logging.getLogger("gmqtt").setLevel(logging.ERROR)
