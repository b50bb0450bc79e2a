"""One MQTT session loop for ingest and deliver (mqttconn.keep_session):
retry a failed connect with backoff, close a session however `serve` ended,
reconnect or stop as `serve` and `pause` say (issue 22)."""

from __future__ import annotations

import asyncio
import logging

import pytest
from iggy_edge.config import MqttSettings
from iggy_edge.logs import RateLimitedLog
from iggy_edge.mqttconn import keep_session

pytestmark = pytest.mark.unit


class Script:
    """`open_session` fails `fail` times, then hands out numbered sessions;
    `serve` answers from `answers` (an exception is raised)."""

    def __init__(self, fail: int, answers: list[bool | Exception]) -> None:
        self.fail = fail
        self.answers = answers
        self.events: list[str] = []
        self.pauses: list[float] = []
        self.n = 0

    async def open_session(self) -> int:
        if self.fail:
            self.fail -= 1
            self.events.append("refused")
            raise ConnectionRefusedError("no broker")
        self.n += 1
        self.events.append(f"open {self.n}")
        return self.n

    async def serve(self, session: int) -> bool:
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    async def close_session(self, session: int) -> None:
        self.events.append(f"close {session}")

    async def pause(self, delay: float) -> bool:
        self.pauses.append(delay)
        return False


async def run(script: Script, retries: list[int]) -> None:
    mqtt = MqttSettings(reconnect_min_s=0.5, reconnect_max_s=4.0)
    await keep_session(
        mqtt,
        name="t",
        open_session=script.open_session,
        serve=script.serve,
        close_session=script.close_session,
        pause=script.pause,
        limited=RateLimitedLog(logging.getLogger("t")),
        on_retry=lambda: retries.append(1),
    )


async def test_retries_a_refused_connect_then_reconnects_until_serve_says_stop() -> None:
    s = Script(fail=3, answers=[True, False])
    retries: list[int] = []
    await run(s, retries)
    assert s.events == ["refused", "refused", "refused", "open 1", "close 1", "open 2", "close 2"]
    assert len(retries) == 3
    assert len(s.pauses) == 4  # three retries, one reconnect
    assert all(0 <= p <= 4.0 for p in s.pauses)


async def test_a_session_is_closed_when_serve_fails_or_is_cancelled() -> None:
    s = Script(fail=0, answers=[RuntimeError("bug")])
    with pytest.raises(RuntimeError):
        await run(s, [])
    assert s.events == ["open 1", "close 1"]

    hold = Script(fail=0, answers=[])
    gate = asyncio.Event()

    async def serve_forever(session: int) -> bool:
        gate.set()
        await asyncio.Event().wait()
        return True

    hold.serve = serve_forever  # type: ignore[method-assign]
    task = asyncio.create_task(run(hold, []))
    await gate.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert hold.events == ["open 1", "close 1"]
