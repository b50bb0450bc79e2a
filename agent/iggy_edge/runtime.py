"""Wires the stages together and owns their life cycle.

`build_agent(settings)` is the one place the whole agent is put together
from its configuration: the uplink and command source `[iggy] kind` asks
for (uplink/factory.py) and the stages below.  `iggy-edge run`, the demo
and the tests start an agent through it.

=============  ==========================  ===================================
stage          file                        meets the others at (stages.py)
=============  ==========================  ===================================
ingest         ingest.py                   Outbox.submit; `IngestObserver`
route          routing.py                  pure: Router.route
outbox         store/                      `OutboxReader`, `DeadLetterSink`
forward        forward.py                  `OutboxReader` -> `Uplink`
return path    downlink/ (component.py)    `ReturnPathHost`, `CommandSource`
updates        ota/ (component.py)         `UpdateHost` (up/ota from ingest)
metrics/health httpd.py, metrics.py        `HttpView`, Metrics
systemd        systemd.py                  `StatusView`
receipts       receipts.py                 `Publish` (Ingest.publish)
=============  ==========================  ===================================

One asyncio loop, one task group.  The stages are supervised
(supervisor.py): a stage that fails unexpectedly is logged with its
traceback and restarted with backoff, on every Python the package supports,
and /health is unhealthy while it fails; an orderly stop
(`Agent.stop()`, SIGTERM) stops ingest first so nothing new is acknowledged,
lets the forwarder finish the batch in flight, commits what is pending and
closes the database -- all within `shutdown_timeout_s`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from .config import Settings
from .devices import DeviceTable
from .forward import Forwarder
from .httpd import http_endpoint
from .ingest import Ingest
from .metrics import Metrics
from .receipts import Receipts
from .reload import Plan
from .reload import plan as plan_reload
from .routing import Router
from .stages import DeadLetterSink, Health, IngestObserver
from .store import Outbox, StoreError
from .supervisor import Supervisor
from .systemd import systemd_notify
from .timeouts import wait_for
from .uplink.factory import make_command_source, make_uplink, make_uplink_and_source
from .uplink.protocol import CommandSource, Uplink

log = logging.getLogger(__name__)

HOUSEKEEPING_INTERVAL_S = 5.0
EXPIRE_INTERVAL_S = 60.0


# Long-running components beside the stages (return path, HTTP endpoint,
# systemd notification): each is called with the running Agent and returns a
# coroutine that runs until cancelled.
Component = Callable[["Agent"], Awaitable[None]]


async def return_path(agent: Agent) -> None:
    """The return path (downlink/), imported only when there is a command
    source to read: an agent without one does not carry its modules."""
    if agent.command_source is None:
        log.info("return path off: no command source (iggy kind %r)", agent.settings.iggy.kind)
        return
    from .downlink import return_path as run  # noqa: PLC0415 - see the docstring

    await run(agent)


async def updates(agent: Agent) -> None:
    """Over-the-air updates of the boards (ota/): idle, and without an MQTT
    connection of its own, until an update is requested."""
    from .ota.component import run_updates  # noqa: PLC0415 - as return_path

    await run_updates(agent)


# What build_agent runs beside the stages; each returns at once when its
# settings turn it off (metrics.enabled, no $NOTIFY_SOCKET, no command source).
COMPONENTS: tuple[Component, ...] = (http_endpoint, systemd_notify, return_path, updates)

# Components that need no open buffer start before it is opened, so /health
# answers ("store failed") and systemd gets READY (after its capped wait) and
# watchdog pings while a full or failing disk keeps the buffer shut; the others
# (the return path) start with the stages.
BEFORE_STORE: frozenset[Component] = frozenset({http_endpoint, systemd_notify})


def build_agent(
    settings: Settings,
    *,
    uplink: Uplink | None = None,
    command_source: CommandSource | None = None,
    metrics: Metrics | None = None,
    shutdown_timeout_s: float = 10.0,
) -> Agent:
    """The whole agent from its settings.  `uplink` and `command_source`
    default to what ``[iggy] kind`` asks for; tests and benchmarks pass their
    own (a MemoryIggy's, a real server's)."""
    if uplink is None and command_source is None:
        uplink, command_source = make_uplink_and_source(settings)  # one connection for both
    return Agent(
        settings,
        uplink=uplink if uplink is not None else make_uplink(settings),
        command_source=command_source if command_source is not None else make_command_source(settings),
        metrics=metrics,
        components=COMPONENTS,
        shutdown_timeout_s=shutdown_timeout_s,
    )


class Agent:
    def __init__(
        self,
        settings: Settings,
        *,
        uplink: Uplink | None = None,
        command_source: CommandSource | None = None,
        metrics: Metrics | None = None,
        components: tuple[Component, ...] = (),
        shutdown_timeout_s: float = 10.0,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or Metrics()
        self.uplink = uplink
        self.command_source = command_source
        self.components = components
        self.shutdown_timeout_s = shutdown_timeout_s
        self.router = Router(settings.routes, settings.buffer.max_payload_bytes)
        self.outbox: Outbox | None = None
        self.ingest: Ingest | None = None
        self.forwarder: Forwarder | None = None
        # Every device heard from (devices.py): device list, /devices, the dashboard
        self.devices = DeviceTable(settings.topics)
        # Delivery receipts to the devices (receipts.py), on ingest's session:
        # made with it (Ingest.publish)
        self.receipts: Receipts | None = None
        self.ready = asyncio.Event()
        self._stop = asyncio.Event()
        # Called with the new settings after a reload (reload.py); a stage
        # that keeps settings of its own registers here
        self.reload_hooks: list[Callable[[Settings], None]] = []
        self._supervisor = Supervisor(self._stop, self.metrics)
        self._store_problem: str | None = None  # why the buffer cannot be opened yet

    def stop(self) -> None:
        self._stop.set()

    def reload(self, new: Settings) -> Plan:
        """Take what `new` changes that a running agent can (reload.py) and
        say what needs a restart; the stages see the new values from their
        next use on."""
        result = plan_reload(self.settings, new)
        if not result.live:
            return result
        self.settings = s = result.settings
        if any(c.key in ("routes", "buffer.max_payload_bytes") for c in result.live):
            self.router = Router(s.routes, s.buffer.max_payload_bytes)
            if self.ingest is not None:
                self.ingest.use_router(self.router)
        if self.outbox is not None:
            self.outbox.reconfigure(s.buffer)
        if self.forwarder is not None:
            self.forwarder.reconfigure(s.forward)
        if self.receipts is not None:
            self.receipts.reconfigure(s.receipts)
        for hook in self.reload_hooks:
            hook(s)
        return result

    # -- the views of stages.HttpView / StatusView ---------------------------

    @property
    def backlog_records(self) -> int:
        return self.outbox.records if self.outbox is not None else 0

    @property
    def buffer_instance(self) -> str | None:
        return None if self.outbox is None else str(self.outbox.epoch)

    def backlog_by_device(self) -> dict[str, tuple[int, int]]:
        return self.outbox.backlog_by_device() if self.outbox is not None else {}

    def unreceipted(self) -> dict[str, float]:
        return self.receipts.unreceipted() if self.receipts is not None else {}

    @property
    def dead_letters(self) -> DeadLetterSink:
        """The outbox's dead-letter table (stages.ReturnPathHost)."""
        if self.outbox is None:
            raise RuntimeError("the outbox is not open yet")
        return self.outbox

    def observe_ingest(self, observer: IngestObserver) -> Callable[[], None]:
        """See every committed ingest message until the returned function is
        called (stages.ReturnPathHost)."""
        if self.ingest is None:
            raise RuntimeError("ingest is not built yet")
        observers = self.ingest.observers
        observers.append(observer)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                observers.remove(observer)

        return remove

    def observe_ota(self, observer: Callable[[str, bytes], None]) -> Callable[[], None]:
        """See every ``up/ota`` message until the returned function is called
        (stages.UpdateHost)."""
        if self.ingest is None:
            raise RuntimeError("ingest is not built yet")
        observers = self.ingest.ota_observers
        observers.append(observer)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                observers.remove(observer)

        return remove

    def observe_reload(self, observer: Callable[[Settings], None]) -> Callable[[], None]:
        """Call `observer` after each reload (stages.ReturnPathHost)."""
        hooks = self.reload_hooks
        hooks.append(observer)

        def remove() -> None:
            with contextlib.suppress(ValueError):
                hooks.remove(observer)

        return remove

    def observe_session_lost(self, observer: Callable[[], None]) -> Callable[[], None]:
        """Call `observer` whenever ingest finds the broker forgot its session,
        at once if that already happened in this run (stages.ReturnPathHost)."""
        if self.ingest is None:
            raise RuntimeError("ingest is not built yet")
        observers = self.ingest.session_lost_observers
        observers.append(observer)
        if self.ingest.sessions_lost:
            observer()

        def remove() -> None:
            with contextlib.suppress(ValueError):
                observers.remove(observer)

        return remove

    async def wait_up(self, timeout: float) -> bool:
        """Wait until the outbox is open, the stages run and ingest has its
        MQTT session: True, or False when `timeout` passed first (the broker
        is away; ingest keeps retrying)."""
        deadline = time.monotonic() + timeout
        try:
            await wait_for(self.ready.wait(), timeout)  # the buffer may wait for a failing disk
            assert self.ingest is not None
            await wait_for(self.ingest.connected.wait(), max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return True

    def health(self) -> Health:
        ingest = "up" if self.ingest is not None and self.ingest.connected.is_set() else "down"
        broken = self.ingest is not None and self.ingest.store_broken
        if self.outbox is None:
            store = "opening" if self._store_problem is None else "failed"
        else:
            store = "failed" if broken else "ok"
        if self.uplink is None or self.forwarder is None:
            uplink = "none"
            uplink_ok = True
        elif self.forwarder.down_since is None:
            uplink = "up" if self.forwarder.up.is_set() else "starting"
            uplink_ok = True
        else:
            down_for = time.time() - self.forwarder.down_since
            uplink = f"down for {down_for:.0f}s"
            uplink_ok = down_for < self.settings.metrics.uplink_down_unhealthy_s
        attention = self.outbox.attention if self.outbox is not None else (self._store_problem or "")
        lost = 0 if self.ingest is None else self.ingest.sessions_lost
        healthy = ingest == "up" and store == "ok" and uplink_ok and not self._supervisor.failing()
        return Health(healthy, ingest, store, uplink, attention, lost, self._supervisor.states())

    async def run(self) -> None:
        early = [self._start_component(c) for c in self.components if c in BEFORE_STORE]
        try:
            await self._run_stages([c for c in self.components if c not in BEFORE_STORE])
        finally:
            for t in early:
                t.cancel()
            await asyncio.gather(*early, return_exceptions=True)

    def _start_component(self, comp: Component) -> asyncio.Task[None]:
        name = getattr(comp, "__name__", "component")
        return asyncio.create_task(self._supervisor.supervise(name, lambda: comp(self)), name=name)

    def _on_store_failure(self, err: StoreError | None) -> None:
        self._store_problem = None if err is None else f"buffer cannot be opened: {err}"

    async def _run_stages(self, components: list[Component]) -> None:
        s = self.settings
        outbox = await Outbox.open_when_possible(
            s.buffer_path,
            s.buffer,
            s.gateway_id,
            self.metrics,
            stop=self._stop,
            on_failure=self._on_store_failure,
        )
        if outbox is None:
            return  # stopped while the disk was failing; nothing was acknowledged
        self.outbox = outbox
        outbox.start()
        log.info(
            "outbox %s: %d records buffered (%d bytes), synchronous=%s, overflow=%s",
            s.buffer_path,
            outbox.records,
            outbox.bytes,
            s.buffer.synchronous,
            s.buffer.overflow,
        )
        self.ingest = ingest = Ingest(s, outbox, self.router, self.metrics)
        ingest.group_observers.append(self.devices.observe_group)
        receipts = None
        if s.receipts.enabled:
            receipts = self.receipts = Receipts(s.receipts, self.metrics, ingest.publish, s.topics)
            ingest.group_observers.append(receipts.observe_group)
            ingest.copy_observers.append(receipts.observe_copy)
        if self.uplink is not None:
            source = outbox if receipts is None or s.receipts.mode != "iggy" else receipts.confirm_tap(outbox)
            self.forwarder = Forwarder(source, self.uplink, s.forward, self.metrics)
        else:
            log.warning("no uplink configured (set IGGY_ADDRESS or [iggy] kind): records stay in the outbox")
        try:
            async with asyncio.TaskGroup() as tg:

                def stage(name: str, run: Callable[[], Awaitable[None]]) -> asyncio.Task[None]:
                    return tg.create_task(self._supervisor.supervise(name, run), name=name)

                ingest_task = stage("ingest", ingest.run)
                forward_task = None if self.forwarder is None else stage("forward", self.forwarder.run)
                others = [stage("housekeeping", self._housekeeping)]
                if receipts is not None:
                    others.append(stage("receipts", receipts.run))
                for comp in components:
                    name = getattr(comp, "__name__", "component")
                    others.append(stage(name, lambda c=comp: c(self)))  # type: ignore[misc]
                self.ready.set()
                await self._stop.wait()
                await self._shutdown(ingest_task, forward_task, others)
        finally:
            await outbox.close()
            if self.uplink is not None:
                with contextlib.suppress(Exception):  # closing a broken connection must not mask the exit
                    await self.uplink.close()
            log.info("stopped; %d records remain buffered", outbox.records)

    async def _shutdown(
        self,
        ingest_task: asyncio.Task[None],
        forward_task: asyncio.Task[None] | None,
        others: list[asyncio.Task[None]],
    ) -> None:
        deadline = time.monotonic() + self.shutdown_timeout_s
        assert self.ingest is not None
        log.info("stopping: ingest first, then the batch in flight")
        await self.ingest.stop(drain_timeout=max(0.1, (deadline - time.monotonic()) / 2))
        ingest_task.cancel()
        if forward_task is not None and self.forwarder is not None:
            self.forwarder.stop()
            try:
                await wait_for(asyncio.shield(forward_task), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("forwarder did not finish its batch in time; it stays buffered")
                forward_task.cancel()
        for t in others:
            t.cancel()

    async def _housekeeping(self) -> None:
        assert self.outbox is not None
        last_expire = 0.0
        while True:
            await self.outbox.refresh_age_gauge()
            if time.monotonic() - last_expire >= EXPIRE_INTERVAL_S:
                await self.outbox.expire()
                last_expire = time.monotonic()
            await asyncio.sleep(HOUSEKEEPING_INTERVAL_S)
