"""In-flight bookkeeping of the deliver connection (deliver.py): which
publish the broker acknowledged, with which reason code, and which ones were
unacknowledged when a connection was lost (suspects of being a poison
publish, see deliver.py's docstring)."""

from __future__ import annotations

import asyncio
from typing import Final

import gmqtt
from gmqtt.storage import PersistentStorage

from .. import gmqtt_hooks as hooks

# Lost connections with one publish alone in flight that make it `failed`.
POISON_STRIKES: Final = 3
MAX_SUSPECTS: Final = 10_000  # beyond: forget them all (careful mode ends; nothing is lost)


class BrokerLost(Exception):
    """The deliver connection is gone or stopped acknowledging."""


class PubackTracker(PersistentStorage):  # type: ignore[misc]  # gmqtt is untyped
    """gmqtt's in-flight store, extended to tell us when a PUBACK arrives."""

    def __init__(self) -> None:
        super().__init__()
        self.last_mid: int | None = None
        self._waiters: dict[int, asyncio.Future[int]] = {}
        self._reasons: dict[int, int] = {}

    def push_message(self, mid: int, raw_package: bytes) -> None:
        super().push_message(mid, raw_package)
        self.last_mid = mid

    def remove_message_by_mid(self, mid: int) -> None:
        super().remove_message_by_mid(mid)
        waiter = self._waiters.pop(mid, None)
        reason = self._reasons.pop(mid, 0)
        if waiter is not None and not waiter.done():
            waiter.set_result(reason)

    def clear(self) -> None:
        super().clear()
        self.fail_all()

    def wait_for(self, mid: int) -> asyncio.Future[int]:
        fut: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiters[mid] = fut
        return fut

    def fail_all(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for fut in waiters.values():
            if not fut.done():
                fut.set_exception(BrokerLost("connection closed before PUBACK"))
                fut.exception()  # retrieved: the waiter may be gone already

    def hook_reason_codes(self, client: gmqtt.Client) -> None:
        """Record the PUBACK reason code before gmqtt's own handler frees the id."""
        hooks.on_puback(client, self._reasons.__setitem__)


class Suspects:
    """Publishes that were unacknowledged when the connection was lost, by
    key (``cmd:<id>``, ``cfg:<device>:<id>``), with their strikes."""

    def __init__(self) -> None:
        self._strikes: dict[str, int] = {}

    def __contains__(self, key: str) -> bool:
        return key in self._strikes

    def strikes(self, key: str) -> int:
        return self._strikes.get(key, 0)

    def lost(self, keys: list[str]) -> str | None:
        """The connection was lost with `keys` unacknowledged: the key that
        was alone in flight and is a suspect already, or None."""
        if len(keys) == 1 and keys[0] in self._strikes:
            self._strikes[keys[0]] += 1
            return keys[0]
        if len(self._strikes) + len(keys) > MAX_SUSPECTS:
            self._strikes.clear()
        for k in keys:
            self._strikes.setdefault(k, 0)
        return None

    def done(self, key: str) -> None:
        self._strikes.pop(key, None)

    def careful(self, keys: list[str]) -> int:
        """How many of `keys` (in order) may go out together: all up to the
        first suspect, or the first one alone when it is a suspect."""
        for i, k in enumerate(keys):
            if k in self._strikes:
                return max(i, 1)
        return len(keys)
