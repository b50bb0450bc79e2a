"""Capped exponential backoff with full jitter, shared by every retry loop
(MQTT reconnects in ingest and deliver, the uplink in forward, the return
poll, the supervisor's stage restarts).

Full jitter (a uniform draw between 0 and the capped exponential) spreads
the retries of many gateways that lost the same server at the same moment,
so they do not come back in lock step (AWS architecture blog, "Exponential
Backoff And Jitter").
"""

from __future__ import annotations

import random


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds to wait before retry number `attempt` (0 for the first retry):
    uniform in [0, min(cap, base * 2**attempt)]."""
    return random.uniform(0, min(cap, base * (2 ** min(attempt, 30))))  # noqa: S311 - jitter, not crypto
