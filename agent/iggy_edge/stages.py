"""The interfaces the stages meet at.

`runtime.build_agent` wires the stages together; each stage sees of the
others only what it names here, so a stage can be tested against a small
stand-in and the outbox can change shape behind these methods:

=================  ==========================  ==============================
interface          implemented by              used by
=================  ==========================  ==============================
`OutboxReader`     store.Outbox                forward.Forwarder
`DeadLetterSink`   store.Outbox                downlink.poll.ReturnPoll
`IngestObserver`   downlink AckListener        ingest (committed messages)
`ReturnPathHost`   runtime.Agent               downlink.component.return_path
`UpdateHost`       runtime.Agent               ota.component.run_updates
`StatusView`       runtime.Agent               systemd.systemd_notify
`HttpView`         runtime.Agent               httpd, dashboard
`Publish`          ingest.Ingest.publish       receipts.Receipts
=================  ==========================  ==============================

No component reaches through the agent into another stage (its outbox,
ingest's client): what it needs is named here.

The uplink side has its own in uplink/protocol.py (`Uplink`,
`CommandSource`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Protocol

from .config import Settings
from .devices import DeviceTable
from .metrics import Metrics
from .records import OutboundRecord
from .uplink.protocol import CommandSource

# Called with (topic, payload) for every message once its record is
# committed, before the acknowledgement.  Must be quick and must not raise.
IngestObserver = Callable[[str, bytes], None]

# publish(topic, payload, retain) at QoS0 on ingest's MQTT session -> False
# when it could not go out now (no session); what receipts publish through.
Publish = Callable[[str, bytes, bool], bool]


@dataclass(frozen=True)
class Health:
    """What /health, `status` and systemd's status line report.  A new part
    is a new field (with a default, so older constructors keep working):
    `as_dict` and the JSON follow the fields."""

    healthy: bool
    ingest: str
    store: str
    uplink: str
    attention: str = ""  # e.g. a damaged buffer moved aside, until acknowledged (store/recovery.py)
    # Connects where the broker had forgotten the agent's session (ingest.py)
    mqtt_sessions_lost: int = 0
    # Each supervised stage: "running", "failing (...)" or "ended" (supervisor.py)
    stages: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class StatusView(Protocol):
    """What systemd's notification needs of the running agent."""

    def health(self) -> Health: ...

    @property
    def backlog_records(self) -> int:
        """Records buffered (0 while the buffer is not open)."""

    async def wait_up(self, timeout: float) -> bool:
        """True once the stages run and ingest has its MQTT session; False
        when `timeout` passed first."""


class HttpView(StatusView, Protocol):
    """What /metrics, /health, /devices and /api/overview need."""

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def devices(self) -> DeviceTable: ...

    @property
    def buffer_instance(self) -> str | None:
        """The open buffer's epoch (tells this buffer from another), or None."""

    def backlog_by_device(self) -> dict[str, tuple[int, int]]:
        """Records and accounted bytes buffered, per device holding any."""

    def unreceipted(self) -> dict[str, float]:
        """Devices holding readings not receipted yet, with the age of the oldest."""


class OutboxReader(Protocol):
    """The forwarder's view of the outbox: read the oldest records, delete
    what Iggy confirmed."""

    @property
    def records(self) -> int:
        """Records waiting to be forwarded."""

    @property
    def bytes(self) -> int:
        """Their bytes as the outbox accounts them (payload, topic, row overhead)."""

    async def wait_for_data(self, timeout: float | None = None) -> bool:
        """True as soon as a record waits; False after `timeout` without one."""

    async def wait_for_more(self, timeout: float | None = None) -> bool:
        """True once a commit added records since the last `read_batch`
        began; False after `timeout` without one."""

    async def read_batch(self, max_records: int, max_bytes: int, after: int = 0) -> list[OutboundRecord]:
        """The oldest records with seq > `after`, in seq order, up to the
        limits (at least one when any waits)."""

    async def confirm(self, batch: Sequence[OutboundRecord], confirmed: frozenset[int] | None = None) -> int:
        """Delete exactly the records of `batch` (any set, adjacent or not),
        or only its `confirmed` seqs; the count deleted."""


class DeadLetterSink(Protocol):
    """Where a message that cannot be used goes, with its reason."""

    async def dead_letter(
        self,
        *,
        mqtt_topic: str | bytes,
        payload: bytes,
        qos: int,
        retain: bool,
        reason: str,
        detail: str,
        received_us: int | None = None,
    ) -> None:
        """Store it durably (committed before returning)."""


class StageHost(Protocol):
    """What every stage that watches ingest needs from the running agent."""

    @property
    def settings(self) -> Settings: ...

    @property
    def metrics(self) -> Metrics: ...

    def observe_ingest(self, observer: IngestObserver) -> Callable[[], None]:
        """Call `observer` for every committed ingest message until the
        returned function is called."""


class ReturnPathHost(StageHost, Protocol):
    """What the return path needs from the running agent."""

    @property
    def command_source(self) -> CommandSource | None: ...

    @property
    def dead_letters(self) -> DeadLetterSink: ...

    def observe_reload(self, observer: Callable[[Settings], None]) -> Callable[[], None]:
        """Call `observer` with the new settings after each reload (reload.py),
        until the returned function is called."""

    def observe_session_lost(self, observer: Callable[[], None]) -> Callable[[], None]:
        """Call `observer` (quick, never raising) whenever the broker turns
        out to have lost the agent's MQTT session (and so, most likely, its
        retained messages), until the returned function is called."""


# Called with (device, payload) for every message on a board's ``up/ota``
# (acknowledged at once, never stored).  Must be quick and must not raise.
OtaObserver = Callable[[str, bytes], None]


class UpdateHost(StageHost, Protocol):
    """What the board updater (ota/) needs from the running agent (its
    `observe_ingest`: a board's status turning ``online``)."""

    def observe_ota(self, observer: OtaObserver) -> Callable[[], None]:
        """Call `observer` for every ``up/ota`` message ingest takes, until
        the returned function is called."""
