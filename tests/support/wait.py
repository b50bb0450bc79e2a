"""Poll a condition with a timeout instead of sleeping and hoping."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable


def wait_until(
    cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> None:
    """Block until `cond()` is truthy; AssertionError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        time.sleep(interval)


async def async_wait_until(
    cond: Callable[[], object], timeout: float = 10.0, interval: float = 0.02, what: str = ""
) -> None:
    """Like wait_until, but yields to the event loop between polls."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or cond}")
        await asyncio.sleep(interval)
