"""Choose the uplink and the command source from settings (``[iggy] kind``).

=========  ======================================  ==============================
kind       uplink                                  command source
=========  ======================================  ==============================
"iggy"     IggyUplink (real server)                IggyCommandSource (same client)
"file"     FileUplink(``file_path``)               None (a file has no return path)
"memory"   the process-wide MemoryIggy's uplink    the same MemoryIggy's source
"none"     None (records stay in the outbox)       None
=========  ======================================  ==============================

``memory`` has to be asked for explicitly (it is never a fallback): it keeps
everything in this process's memory and loses it at exit.  Both views share
`shared_memory_iggy()`, so a test or the demo can publish commands to the
agent and inspect what it forwarded.

`make_uplink_and_source` (what the agent uses) gives a real server's
uplink and command source one connection between them, first made after
``iggy.start_jitter_s`` (uplink/iggy/connection.py: each connection is a
login and a heartbeat for the server; the SDK queues concurrent calls on
one connection).  `make_uplink` / `make_command_source` give each its own.

Each kind's module is imported only when that kind is chosen: the Iggy SDK
(a native library, about 6.5 MB resident) stays out of an agent that does
not use it, and the in-memory Iggy out of every real agent.
"""

from __future__ import annotations

from typing import Final

from ..config import Settings
from .protocol import CommandSource, Uplink

# The SDK's ping interval on the connection the return poll shares: the poll
# is a request every ``downlink.poll_interval_s``, which the server counts as
# liveness and which keeps NATs' and firewalls' state, so a ping would only
# add to the one request a second a gateway makes at rest (issue 23).  Not
# off altogether: the SDK has no "never", and an hour costs nothing.
POLLED_HEARTBEAT_S: Final = 3600.0


def consumer_name(settings: Settings) -> str:
    """Name under which the gateway's command offsets are kept on the server."""
    return f"iggy-edge-{settings.gateway_id}"


def make_uplink(settings: Settings) -> Uplink | None:
    iggy = settings.iggy
    if iggy.kind == "iggy":
        from .iggy import IggyUplink  # noqa: PLC0415 - only the chosen kind (docstring)

        topics = [(r.stream, r.topic) for r in settings.routes]
        return IggyUplink(iggy, settings.gateway_id, topics=topics)
    if iggy.kind == "file":
        if iggy.file_path is None:  # config validation requires it; keep mypy honest
            raise ValueError("iggy.file_path is required when kind = 'file'")
        from .file import FileUplink  # noqa: PLC0415 - only the chosen kind (docstring)

        return FileUplink(iggy.file_path, partitions=iggy.partitions)
    if iggy.kind == "memory":
        from .memory import shared_memory_iggy  # noqa: PLC0415 - only the chosen kind (docstring)

        return shared_memory_iggy().uplink()
    return None


def make_command_source(settings: Settings) -> CommandSource | None:
    iggy = settings.iggy
    if not settings.downlink.enabled:
        return None
    if iggy.kind == "iggy":
        from .iggy import IggyCommandSource  # noqa: PLC0415 - only the chosen kind (docstring)

        return IggyCommandSource(iggy, settings.gateway_id, consumer_name(settings))
    if iggy.kind == "memory":
        from ..downlink.commands import return_topic  # noqa: PLC0415 - as the kind's module
        from .memory import shared_memory_iggy  # noqa: PLC0415 - only the chosen kind (docstring)

        memory, rt = shared_memory_iggy(), return_topic(settings)
        memory.create_topic(rt.stream, rt.topic, 1)  # in-process, it is its own cloud side: provisioned
        return memory.command_source(consumer_name(settings))
    return None


def make_uplink_and_source(settings: Settings) -> tuple[Uplink | None, CommandSource | None]:
    """The agent's uplink and command source; for a real server sharing one
    connection (module docstring)."""
    iggy = settings.iggy
    if iggy.kind != "iggy":
        return make_uplink(settings), make_command_source(settings)
    from .iggy import IggyCommandSource, IggyUplink  # noqa: PLC0415 - only the chosen kind (docstring)
    from .iggy.connection import Connection  # noqa: PLC0415 - only the chosen kind (docstring)

    polled = settings.downlink.enabled and settings.downlink.poll_interval_s < iggy.heartbeat_interval_s
    conn = Connection(
        iggy,
        "gateway",
        start_jitter=iggy.start_jitter_s,
        heartbeat_s=max(POLLED_HEARTBEAT_S, iggy.heartbeat_interval_s) if polled else None,
    )
    topics = [(r.stream, r.topic) for r in settings.routes]
    uplink = IggyUplink(iggy, settings.gateway_id, topics=topics, connection=conn)
    if not settings.downlink.enabled:
        return uplink, None
    return uplink, IggyCommandSource(
        iggy, settings.gateway_id, consumer_name(settings), connection=conn.share()
    )
