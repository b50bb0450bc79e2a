"""Every device the gateway has heard from, at a glance.

`DeviceTable.observe` is an ingest observer (stages.IngestObserver): it sees
each committed message and keeps, per device, when it was last heard from,
its readings and bytes since the agent started, its current rate, its
retained status (``online`` / ``offline`` on ``edge/<device>/status``, and
since when) and the versions it reports in its diag (``lib``, ``fw``, and
``app_v``: the app version over-the-air updates installed, when the board
sends them).  `iggy-edge device list`, ``/devices`` on the HTTP endpoint and
the dashboard show it, with what the buffer, the receipts and
the return path know of the same device (`DeviceTable.rows`).

Cost on ingest: one dict lookup per message (`observe_group` gathers a
group commit's messages by topic), then per topic and group one prefix
check, one ``str.find`` and a few integer updates; the status and diag
payloads are parsed only on those topics.

Bounded: at most `MAX_DEVICES` devices are kept.  When a new one would pass
the bound, the stalest tenth is forgotten at once (so the scan is paid once
per thousand new devices, not per message), counted in
``iggy_edge_devices_forgotten_total`` and logged, rate-limited.  A device
that is forgotten and heard from again starts its counts afresh.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from .device_ids import is_device_id
from .logs import RateLimitedLog
from .topics import DEFAULT, TopicLayout

log = logging.getLogger(__name__)

MAX_DEVICES: Final = 10_000
RATE_WINDOW_S: Final = 10.0  # the current rate is the count of the last full window
MAX_VERSION_CHARS: Final = 40


@dataclass(slots=True)
class _Device:
    first_seen: float
    last_seen: float
    readings: int = 0
    bytes: int = 0
    window_start: float = 0.0
    window_count: int = 0
    rate: float = 0.0  # readings per second in the last full window
    status: str = ""
    status_since: float | None = None
    lib: str = ""
    fw: str = ""
    app_v: str = ""  # the app version over-the-air updates installed (ota/)


class DeviceTable:
    def __init__(self, topics: TopicLayout = DEFAULT, *, max_devices: int = MAX_DEVICES) -> None:
        self._prefix = topics.head  # ``edge/``: what stands before the device id
        self._max = max_devices
        self._devices: dict[str, _Device] = {}
        self.forgotten = 0
        self._limited = RateLimitedLog(log)

    def __len__(self) -> int:
        return len(self._devices)

    # -- what ingest tells us (synchronous, never raises) ----------------------

    def observe(self, topic: str, payload: bytes) -> None:
        self.observe_group(((topic, payload),))

    def observe_group(self, messages: Sequence[tuple[str, bytes]]) -> None:
        """The messages of one group commit (ingest's group observer),
        gathered by topic first (one dict lookup a message): each topic is
        taken apart, and its device's counts updated, once per group."""
        now = time.time()
        by_topic: dict[str, list[bytes]] = {}
        for topic, payload in messages:
            held = by_topic.get(topic)
            if held is None:
                by_topic[topic] = [payload]
            else:
                held.append(payload)
        for topic, payloads in by_topic.items():
            hit = self._device_of(topic, now)
            if hit is None:
                continue
            dev, rest = hit
            dev.last_seen = now
            if rest == "status":
                for payload in payloads:  # in arrival order: the last one holds
                    self._status(dev, payload, now)
                continue
            if rest == "up/ack":
                continue  # a command's ack, not a reading (the return path counts it)
            n = len(payloads)
            dev.readings += n
            dev.bytes += sum(map(len, payloads))
            if now - dev.window_start >= RATE_WINDOW_S:
                elapsed = now - dev.window_start
                # a window long past says nothing of the current rate
                dev.rate = dev.window_count / elapsed if elapsed < 2 * RATE_WINDOW_S else 0.0
                dev.window_start, dev.window_count = now, 0
            dev.window_count += n
            if rest == "up/diag":
                for payload in payloads:
                    self._diag(dev, payload)

    def _device_of(self, topic: str, now: float) -> tuple[_Device, str] | None:
        """The device a topic is of, and the rest of the topic after it."""
        prefix = self._prefix
        if not topic.startswith(prefix):
            return None
        start = len(prefix)
        end = topic.find("/", start)
        if end <= start:
            return None
        rest = topic[end + 1 :]
        if rest.startswith("down/"):
            return None  # ours (receipts, commands) echoed back: not the device's
        dev_id = topic[start:end]
        dev = self._devices.get(dev_id)
        if dev is None:
            if not is_device_id(dev_id):
                return None  # not a device a person could look up; ingest dead-letters or stores it
            dev = self._new(dev_id, now)
        return dev, rest

    def _new(self, dev_id: str, now: float) -> _Device:
        if len(self._devices) >= self._max:
            stalest = sorted(self._devices, key=lambda k: self._devices[k].last_seen)
            drop = stalest[: max(1, self._max // 10)]
            for k in drop:
                del self._devices[k]
            self.forgotten += len(drop)
            self._limited.warning(
                "forget",
                "device table full (%d devices): forgot the %d heard from longest ago",
                self._max,
                len(drop),
            )
        dev = self._devices[dev_id] = _Device(first_seen=now, last_seen=now, window_start=now)
        return dev

    @staticmethod
    def _status(dev: _Device, payload: bytes, now: float) -> None:
        text = payload[:16].decode("ascii", "replace").strip().lower()
        state = text if text in ("online", "offline") else "unknown"
        if state != dev.status:
            dev.status, dev.status_since = state, now

    @staticmethod
    def _diag(dev: _Device, payload: bytes) -> None:
        if len(payload) > 4096:
            return
        try:
            doc = json.loads(payload)
        except ValueError:  # UnicodeDecodeError and JSONDecodeError alike
            return
        if not isinstance(doc, dict):
            return
        for key in ("lib", "fw", "app_v"):
            value = doc.get(key)
            if isinstance(value, str) and value.isprintable():
                setattr(dev, key, value[:MAX_VERSION_CHARS])

    # -- what the views read -----------------------------------------------------

    def rows(self, now: float | None = None) -> list[dict[str, Any]]:
        """One JSON-ready dict per device, stalest first."""
        now = time.time() if now is None else now
        out = []
        for dev_id, d in sorted(self._devices.items(), key=lambda kv: kv[1].last_seen):
            rate = _rate(d, now)
            out.append(
                {
                    "device": dev_id,
                    "last_seen": round(d.last_seen, 3),
                    "silent_s": round(max(0.0, now - d.last_seen), 1),
                    "readings": d.readings,
                    "bytes": d.bytes,
                    "rate_per_s": round(rate, 2),
                    "status": d.status or None,
                    "status_since": None if d.status_since is None else round(d.status_since, 3),
                    "lib": d.lib or None,
                    "fw": d.fw or None,
                    "app_v": d.app_v or None,
                }
            )
        return out

    def stale(self, silent_s: float, now: float | None = None) -> int:
        now = time.time() if now is None else now
        return sum(1 for d in self._devices.values() if now - d.last_seen > silent_s)


def _rate(d: _Device, now: float) -> float:
    """Readings per second over the last RATE_WINDOW_S: the open window's
    count plus the last full window's rate for the part of it still in
    range (a sliding-window estimate, two numbers per device)."""
    elapsed = now - d.window_start
    if elapsed < RATE_WINDOW_S:
        return (d.window_count + d.rate * (RATE_WINDOW_S - elapsed)) / RATE_WINDOW_S
    if elapsed < 2 * RATE_WINDOW_S:
        return d.window_count / elapsed
    return 0.0


def read_extras(db: Path, prefix: str, devices: set[str]) -> dict[str, dict[str, Any]]:
    """What the buffer file knows of `devices`: dead letters by reason and
    the newest command with its state.  Read-only, on a connection of its
    own (run it in a thread); a table that is not there yet (the return path
    never ran) is left out."""
    out: dict[str, dict[str, Any]] = {d: {"dead_letters": {}, "last_command": None} for d in devices}
    try:
        conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1.0)
    except sqlite3.Error:
        return out
    try:
        with contextlib.suppress(sqlite3.OperationalError):
            rows = conn.execute(
                "SELECT mqtt_topic, reason, count(*) FROM dead_letters GROUP BY mqtt_topic, reason"
            ).fetchall()
            for topic, reason, n in rows:
                text = topic.decode("utf-8", "replace") if isinstance(topic, bytes) else str(topic)
                if not text.startswith(prefix):
                    continue
                dev = text[len(prefix) :].split("/", 1)[0]
                if dev in out:
                    dead = out[dev]["dead_letters"]
                    dead[reason] = dead.get(reason, 0) + n
        with contextlib.suppress(sqlite3.OperationalError):
            rows = conn.execute(
                "SELECT device, id, name, state, updated_at FROM downlink_commands"
                " WHERE seq IN (SELECT max(seq) FROM downlink_commands GROUP BY device)"
            ).fetchall()
            for dev, cid, name, state, updated in rows:
                if dev in out:
                    out[dev]["last_command"] = {"id": cid, "name": name, "state": state, "at": updated}
    finally:
        conn.close()
    return out
