"""Restart a stage that fails, with backoff, and say which stages run.

`Supervisor.supervise(name, run)` runs ``run()`` until it returns (the stage
is done, e.g. the return path with no command source) or the agent stops.
An unexpected exception is logged with its traceback, counted
(``iggy_edge_agent_stage_restarts_total{stage}``) and the stage is started
again after a capped exponential backoff (1 s doubling to 30 s; back to 1 s
once an attempt ran for `STABLE_S`).  This is the one place outside the
trust-boundary parsers where ``except Exception`` is allowed.

Each attempt runs in a task of its own.  A stage that uses a TaskGroup (the
return path does) has the group cancel its *parent* task when a child
fails, and the parent's cancel count stays raised after the group ends.
Python 3.11.2 (what Debian 12's ``/usr/bin/python3`` runs, and so the .deb)
then turns the next ``asyncio.timeout`` in that task -- the backoff wait --
into a CancelledError: with the attempt run inline the supervisor ended
quietly and the stage was never restarted; 3.11.3 and later compare the
count with the one at the timeout's entry and did not show it.  A fresh task
per attempt takes that count with it, on every Python.

`states()` says of each stage whether it is ``running``, ``failing`` (it
failed less than `STABLE_S` ago: waiting to restart, or in a crash loop) or
``ended``; /health is unhealthy while any stage is failing and `status`
shows which, with the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Final

from .backoff import backoff_delay
from .metrics import Metrics
from .timeouts import wait_for

log = logging.getLogger(__name__)

BACKOFF_INITIAL_S: Final = 1.0
BACKOFF_MAX_S: Final = 30.0
# An attempt that ran this long resets the backoff, and a stage whose last
# failure is this long ago counts as running again.
STABLE_S: Final = 60.0
MAX_ERROR_CHARS: Final = 200


@dataclass
class StageState:
    state: str = "running"  # running | failing | ended
    failures: int = 0
    last_error: str = ""
    failed_at: float | None = None  # monotonic

    def describe(self, now: float) -> str:
        if self.state == "ended":
            return "ended"
        if self.failed_at is not None and now - self.failed_at < STABLE_S:
            return f"failing ({self.failures} failures, last: {self.last_error})"
        return "running"


class Supervisor:
    def __init__(
        self,
        stop: asyncio.Event,
        metrics: Metrics,
        *,
        backoff_initial_s: float = BACKOFF_INITIAL_S,
        backoff_max_s: float = BACKOFF_MAX_S,
    ) -> None:
        self._stop = stop
        self._metrics = metrics
        self._initial = backoff_initial_s
        self._max = backoff_max_s
        self._stages: dict[str, StageState] = {}

    def states(self) -> dict[str, str]:
        """Each supervised stage: ``running``, ``failing (...)`` or ``ended``."""
        now = time.monotonic()
        return {name: st.describe(now) for name, st in self._stages.items()}

    def failing(self) -> list[str]:
        return [name for name, text in self.states().items() if text.startswith("failing")]

    async def supervise(self, name: str, run: Callable[[], Awaitable[None]]) -> None:
        state = self._stages[name] = StageState()
        attempt = 0
        while not self._stop.is_set():
            started = time.monotonic()
            state.state = "running"
            task = asyncio.ensure_future(run())  # its own task: see the module docstring
            try:
                await task
            except asyncio.CancelledError:
                if _cancel_requested() or not task.done():
                    if not task.done():  # cancelled before the attempt first waited
                        task.cancel()
                        with contextlib.suppress(asyncio.CancelledError, Exception):
                            await task
                    raise  # the agent is stopping
                error = "the stage ended with CancelledError nobody asked for"
                log.error("stage %s failed: %s; restarting it", name, error)
            except Exception as e:  # the supervisor: log, count, restart with backoff
                error = describe(e)[:MAX_ERROR_CHARS]
                log.exception("stage %s failed; restarting it", name)
            else:
                state.state = "ended"
                return
            now = time.monotonic()
            state.state = "failing"
            state.failures += 1
            state.last_error = error
            state.failed_at = now
            self._metrics.stage_restarts.labels(name).inc()
            if name == "ingest":  # ingest's restart opens a new MQTT session
                self._metrics.mqtt_reconnects.inc()
            attempt = 0 if now - started > STABLE_S else attempt + 1
            with contextlib.suppress(TimeoutError):
                await wait_for(self._stop.wait(), backoff_delay(attempt, self._initial, self._max))


def describe(e: BaseException) -> str:
    """``Type: text`` of the error, of each error inside a TaskGroup's group."""
    if isinstance(e, BaseExceptionGroup):
        return "; ".join(describe(sub) for sub in e.exceptions)
    return f"{type(e).__name__}: {e}"


def _cancel_requested() -> bool:
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0
