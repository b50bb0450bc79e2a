"""`wait_for`: asyncio.wait_for without Python 3.11's lost cancellation.

On 3.11, a task cancelled at the moment the awaited thing finishes gets that
result (or its exception) from `asyncio.wait_for` and never sees the
CancelledError (CPython gh-86296; 3.12 rebuilt wait_for on `asyncio.timeout`).
A loop such as "connect, on OSError back off, try again" then swallows the
cancel and runs on: the deliverer's shutdown hung that way in the suite
(cancelled while a connect to a stopped broker was failing).  This is the
3.12 construction, which 3.11 already has the parts for.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(aw: Awaitable[T], timeout: float | None) -> T:
    """Await `aw` for at most `timeout` seconds (None: no limit); raises
    TimeoutError when the time runs out, and lets a cancellation through."""
    async with asyncio.timeout(timeout):
        return await aw
