"""The updater: drives every board update in progress (docs/ota.md).

Per update (one per board at a time) the gateway walks ``queued`` ->
``probing`` (a probe asks the board's state and .mpy version) ->
``offered`` (manifest sent) -> ``downloading`` -> ``switching`` (the board
said ``staged``) -> ``trial`` -> ``done``, or ends ``rolled_back``,
``failed`` or ``cancelled``.

* Flow control is the board's: a chunk goes out only for a ``need`` (window
  1).  The last message sent goes out again when no answer came within
  `Limits.resend_s` (doubling up to `resend_max_s`); a ``bad`` gets that
  chunk again; the manifest goes out again when the board reconnects (its
  retained ``status`` turns ``online``) or says ``idle`` mid-download, and
  the board answers with the (file, offset) its staging area reached.
* Every change of state and progress is committed (state.py) before the
  next message, so a restarted agent resumes: an update that was
  downloading starts again with the manifest, the board continues where
  its flash says it stopped.
* Untrusted input: a reply is parsed by protocol.parse_reply; garbage, a
  reply for another update, a ``need`` outside the files are counted
  (``iggy_edge_ota_replies_total``) and ignored; the update goes on.
* Bounds: `max_concurrent` updates with boards at once (the others wait,
  counted once each), `max_bad_chunks` corrupted chunks and `max_offers`
  manifests per update, `stall_s` without an answer while downloading,
  `switch_s` from ``staged`` to the verdict: each ends the update
  ``failed`` with the bound in its reason.  The reply queue is bounded
  (`reply_queue`, a drop is counted; the resend timer recovers).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Final

from ..config import Settings
from ..logs import RateLimitedLog
from . import protocol as wire
from .metrics import OtaMetrics
from .run import Limits, Run
from .state import OtaState, Row

__all__ = ["Limits", "Publish", "Updater"]

log = logging.getLogger(__name__)

ADMIT_INTERVAL_S: Final = 1.0
PROGRESS_EVERY_S: Final = 1.0
MAX_OFFLINE_TRACKED: Final = 10_000  # as devices.MAX_DEVICES
# publish(topic, payload) at QoS 1 -> False when there is no connection now
Publish = Callable[[str, bytes], bool]


class Updater:
    def __init__(
        self,
        settings: Settings,
        state: OtaState,
        publish: Publish,
        metrics: OtaMetrics,
        limits: Limits,
        on_busy: asyncio.Event,
    ) -> None:
        self._topics = settings.topics
        self._state = state
        self._publish = publish
        self._m = metrics
        self.limits = limits
        self._wanted = on_busy
        self._runs: dict[str, Run] = {}  # device -> its update in progress
        self._queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue(limits.reply_queue)
        self._limited = RateLimitedLog(log)
        self._held: set[str] = set()  # updates counted once as waiting for a slot
        self._admitted_at = 0.0
        self._last_ids: frozenset[str] = frozenset()
        # One event at a time (a reply, a tick): a reply's state change and a
        # timeout's "failed" must not interleave across their awaits.
        self._lock = asyncio.Lock()
        # Boards whose retained status says offline (oldest first, bounded):
        # nothing goes to them until they are back -- their persistent session
        # would queue every resend at the broker for their next connect.
        self._offline: dict[str, None] = {}

    # -- what ingest and the link call (synchronous, never raising) ------------

    def observe_reply(self, device: str, payload: bytes) -> None:
        try:
            self._queue.put_nowait((device, payload))
        except asyncio.QueueFull:
            self._m.bounds.labels("reply_queue").inc()
            self._limited.warning(
                "ota-queue",
                "ota: reply queue full (%d): a board's reply was dropped",
                self.limits.reply_queue,
            )

    def observe_ingest(self, topic: str, payload: bytes) -> None:
        """A board's retained status: ``offline`` holds what goes to it, back
        ``online`` means it reconnected (the manifest goes again)."""
        device = self._topics.device_of_status(topic)
        if device is None:
            return
        status = payload[:7].lower()
        if status.startswith(b"offline"):
            self._offline.pop(device, None)
            self._offline[device] = None
            if len(self._offline) > MAX_OFFLINE_TRACKED:
                del self._offline[next(iter(self._offline))]
        elif status.startswith(b"online"):
            self._offline.pop(device, None)
            run = self._runs.get(device)
            if run is not None:
                self._resend_now(run, "reconnect")

    def link_connected(self) -> None:
        """Our own connection is (again) up: what was in flight may be lost."""
        for run in self._runs.values():
            run.sent_at = 0.0

    def _resend_now(self, run: Run, why: str) -> None:
        if run.state in ("offered", "downloading"):
            run.pending, run.in_flight = self._manifest(run), None
        run.sent_at, run.resends = 0.0, 0
        self._m.resends.labels(why).inc()

    # -- the loops ---------------------------------------------------------------

    async def run(self) -> None:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._replies(), name="ota-replies")
            tg.create_task(self._ticks(), name="ota-ticks")

    async def _replies(self) -> None:
        while True:
            device, payload = await self._queue.get()
            reply = wire.parse_reply(payload)
            if isinstance(reply, wire.Garbage):
                self._m.replies.labels("garbage").inc()
                self._limited.warning(
                    "ota-garbage", "ota: ignored a message from %s on up/ota: %s", device, reply.reason
                )
                continue
            run = self._runs.get(device)
            if run is None:
                self._m.replies.labels("no_update").inc()
                continue
            if reply.id is not None and reply.id != run.uid and reply.st != "idle":
                self._m.replies.labels("stale").inc()
                continue
            self._m.replies.labels("ok").inc()
            async with self._lock:
                if self._runs.get(device) is run:  # not finished meanwhile
                    await self._on_reply(run, reply)

    async def _ticks(self) -> None:
        while True:
            now = time.monotonic()
            async with self._lock:
                if now - self._admitted_at >= ADMIT_INTERVAL_S:
                    self._admitted_at = now
                    await self._admit()
                for run in list(self._runs.values()):
                    if self._runs.get(run.row.device) is run:
                        await self._check_time(run, time.monotonic())
            self._wanted.set() if self._runs else self._wanted.clear()
            await asyncio.sleep(self.limits.tick_s)

    # -- admission: requests, cancels, rollouts ------------------------------------

    async def _admit(self) -> None:
        rows = await self._state.active()
        queued = 0
        verdicts: dict[tuple[str, int], bool | str] = {}
        stopped: set[str] = set()
        for row in rows:
            run = self._runs.get(row.device)
            if row.cancel and run is not None and run.state in ("switching", "trial"):
                self._limited.warning(
                    "ota-late-cancel",
                    "ota: update %s for %s: too late to cancel, the board switched",
                    row.id,
                    row.device,
                )
            elif row.cancel:
                self._publish(self._topics.ota(row.device), wire.abort(row.id))
                if run is not None and run.uid == row.id:
                    await self._finish(run, "cancelled", "cancelled by the operator")
                else:
                    await self._state.save(
                        row.id, "cancelled", row.done_bytes, reason="cancelled by the operator"
                    )
                    self._m.finished.labels("cancelled").inc()
                continue
            if run is not None:
                continue
            if row.state != "queued":  # was in progress when the agent stopped: resume
                await self._start(row, resume=True)
                continue
            wave = (row.rollout, row.wave)
            if wave not in verdicts:  # once per rollout wave and pass: a rollout can have 1000 boards
                verdicts[wave] = await self._state.admissible(row)
            ok = verdicts[wave]
            if isinstance(ok, str):
                if row.rollout not in stopped:
                    stopped.add(row.rollout)
                    await self._state.stop_rollout(row.rollout, ok)
                continue
            if not ok:
                queued += 1
                continue
            if len(self._runs) >= self.limits.max_concurrent:
                queued += 1
                if row.id not in self._held:
                    self._held.add(row.id)
                    self._m.bounds.labels("concurrent").inc()
                    self._limited.warning(
                        "ota-concurrent",
                        "ota: update %s for %s waits: %d updates in progress (the bound)",
                        row.id,
                        row.device,
                        self.limits.max_concurrent,
                    )
                continue
            self._held.discard(row.id)
            await self._start(row, resume=False)
        self._m.queued.set(queued)
        self._m.active.set(len(self._runs))
        ids = frozenset(r.id for r in rows)
        if ids != self._last_ids:  # something finished or came: rollouts may be over (a write: not idle)
            self._last_ids = ids
            await self._state.finish_rollouts()

    async def _start(self, row: Row, *, resume: bool) -> None:
        art = await self._state.artifact(row.artifact)
        if art is None:
            await self._state.save(row.id, "failed", 0, reason="its artifact is no longer on the gateway")
            self._m.finished.labels("failed").inc()
            return
        now = time.monotonic()
        state = row.state if resume else "probing"
        run = self._runs[row.device] = Run(row, art, state, row.done_bytes, now)
        if state in ("offered", "downloading"):
            run.pending = self._manifest(run)  # the board derives where it stopped from its flash
        elif state == "probing":
            run.pending = wire.probe()
        else:  # switching, trial: the board reports by itself; a probe asks again after a while
            run.sent_at = now
        if not resume:
            await self._state.save(row.id, state, 0)
        log.info(
            "ota: update %s for %s: %s (version %s, %d bytes)",
            row.id,
            row.device,
            "resumed" if resume else "started",
            art.version,
            art.total,
        )
        self._wanted.set()

    # -- one board's replies -------------------------------------------------------

    def _manifest(self, run: Run) -> bytes:
        return wire.manifest(run.uid, run.art.version, run.art.entries, run.art.mpy)

    async def _send(self, run: Run, payload: bytes, state: str | None = None) -> None:
        if not wire.is_chunk(payload):
            run.in_flight = None  # after a manifest the board's need is answered, whatever it is
        run.pending = payload
        run.sent_at = time.monotonic()
        if state is not None and state != run.state:
            run.state, run.phase_since = state, run.sent_at
            await self._state.save(run.uid, state, run.done_bytes)
        self._publish(self._topics.ota(run.row.device), payload)  # not out now: the timer sends it again

    async def _offer(self, run: Run) -> None:
        run.offers += 1
        if run.offers > self.limits.max_offers:
            self._m.bounds.labels("offers").inc()
            await self._finish(
                run, "failed", f"the board did not take the manifest ({self.limits.max_offers} offers)"
            )
            return
        await self._send(run, self._manifest(run), "offered")

    async def _on_reply(self, run: Run, r: wire.Reply) -> None:
        now = time.monotonic()
        run.heard_at, run.resends = now, 0
        st = r.st
        if st == "idle":
            if r.v:
                run.board_version = r.v
            if run.state == "probing":
                if run.art.mpy is not None and r.mpy is not None and r.mpy != run.art.mpy:
                    await self._finish(
                        run,
                        "failed",
                        f"the board loads .mpy version {r.mpy}, the update's bytecode is version"
                        f" {run.art.mpy}: "
                        "build it with the mpy-cross matching the board's MicroPython, or without --mpy",
                    )
                    return
                await self._offer(run)
            elif run.state in ("offered", "downloading"):
                self._m.resends.labels("board_idle").inc()
                await self._offer(run)  # it has nothing pending: it lost or never got the manifest
            elif r.v == run.art.version:
                await self._finish(run, "done", "", r.v)
            elif r.v is not None and now - run.phase_since > self.limits.resend_s:
                await self._finish(
                    run, "failed", f"after the switch the board runs {r.v}, not {run.art.version}", r.v
                )
        elif st in ("need", "bad"):
            if run.state not in ("probing", "offered", "downloading"):
                self._m.replies.labels("stale").inc()
                return
            if not (0 <= r.f < len(run.art.files) and 0 <= r.o < max(1, len(run.art.files[r.f][1]))):
                self._m.replies.labels("garbage").inc()
                self._limited.warning(
                    "ota-range",
                    "ota: %s asked for file %d offset %d: outside the update",
                    run.row.device,
                    r.f,
                    r.o,
                )
                return
            if st == "bad":
                run.bad += 1
                self._m.resends.labels("bad_chunk").inc()
                if run.bad > self.limits.max_bad_chunks:
                    self._m.bounds.labels("bad_chunks").inc()
                    await self._finish(
                        run, "failed", f"over {self.limits.max_bad_chunks} chunks arrived corrupted"
                    )
                    return
            if r.n is not None:
                run.chunk_bytes = min(r.n, wire.CHUNK_BYTES)
            data = run.art.files[r.f][1][r.o : r.o + run.chunk_bytes]
            chunk = (r.f, r.o, len(data))
            if st == "need" and chunk == run.in_flight and now - run.sent_at < self.limits.resend_s:
                self._m.replies.labels("duplicate").inc()  # answered already: again only after the timeout
                return
            run.in_flight = chunk
            run.done_bytes = sum(len(d) for _, d in run.art.files[: r.f]) + r.o
            self._m.chunks.inc()
            self._m.chunk_bytes.inc(len(data))
            await self._send(run, wire.chunk(run.uid, r.f, r.o, data), "downloading")
            if now - run.saved_at >= PROGRESS_EVERY_S:  # progress for `status`; the board knows its own
                run.saved_at = now
                await self._state.save(run.uid, run.state, run.done_bytes)
        elif st == "staged":
            if run.state in ("switching", "trial"):
                return
            run.done_bytes, run.pending = run.art.total, None
            run.state, run.phase_since, run.sent_at = "switching", now, now
            await self._state.save(run.uid, "switching", run.done_bytes)
            log.info("ota: %s staged update %s; it switches and reboots", run.row.device, run.uid)
        elif st == "trial":
            run.state, run.pending, run.sent_at = "trial", None, now
            await self._state.save(run.uid, "trial", run.art.total, board_version=r.v)
        elif st == "done":
            await self._finish(
                run, "done", "" if r.v in (None, run.art.version) else f"the board reports {r.v}", r.v
            )
        elif st == "rolled_back":
            await self._finish(run, "rolled_back", r.why or "the board rolled back", r.v)
        elif st == "failed":
            await self._finish(run, "failed", r.why or "refused by the board", r.v)

    async def _check_time(self, run: Run, now: float) -> None:
        lim = self.limits
        offline = run.row.device in self._offline  # the timers run; nothing is sent
        if run.state in ("switching", "trial"):
            if now - run.phase_since > lim.switch_s:
                await self._finish(
                    run, "failed", f"no verdict from the board within {lim.switch_s:.0f}s of the switch"
                )
                return
            if not offline and now - run.sent_at >= min(
                lim.resend_s * 2 ** (run.resends + 1), lim.resend_max_s
            ):
                run.resends += 1
                run.sent_at = now
                self._publish(self._topics.ota(run.row.device), wire.probe())  # what state are you in?
            return
        if now - run.heard_at > lim.stall_s:
            await self._finish(
                run,
                "failed",
                f"no answer from the board for {lim.stall_s:.0f}s (offline, or its firmware has no OTA"
                " support: provision it once with `iggy-edge device provision`)",
            )
            return
        due = run.sent_at + min(lim.resend_s * 2**run.resends, lim.resend_max_s) if run.sent_at else 0.0
        if run.pending is not None and now >= due and not offline:
            if run.sent_at:
                run.resends += 1
                self._m.resends.labels("timeout").inc()
            run.sent_at = now
            if not wire.is_chunk(run.pending):
                run.in_flight = None
            self._publish(self._topics.ota(run.row.device), run.pending)

    async def _finish(self, run: Run, outcome: str, reason: str, version: str | None = None) -> None:
        self._runs.pop(run.row.device, None)
        done_bytes = run.art.total if outcome == "done" else run.done_bytes
        await self._state.save(
            run.uid, outcome, done_bytes, board_version=version or run.board_version, reason=reason
        )
        self._m.finished.labels(outcome).inc()
        self._m.active.set(len(self._runs))
        level = logging.INFO if outcome == "done" else logging.WARNING
        log.log(
            level,
            "ota: update %s for %s: %s%s",
            run.uid,
            run.row.device,
            outcome,
            f" ({reason})" if reason else "",
        )
        if outcome in ("failed", "rolled_back"):
            why = await self._state.failures_passed(run.row.rollout)
            if why is not None:
                n = await self._state.stop_rollout(run.row.rollout, why)
                log.warning("ota: %s; %d queued update(s) cancelled", why, n)
        with contextlib.suppress(Exception):
            await self._state.finish_rollouts()
