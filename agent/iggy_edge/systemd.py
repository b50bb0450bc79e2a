"""Readiness and watchdog notification to systemd (``Type=notify``).

The sd_notify protocol is one datagram per message on the unix socket named
by ``$NOTIFY_SOCKET`` (a path, or ``@name`` for the abstract namespace), so a
few lines replace libsystemd:

* ``READY=1`` once the agent has opened its buffer, started its stages and
  ingest has its MQTT session (`Agent.wait_up`), so ``systemctl start``
  returns only when the agent runs and units ordered after it see a working
  gateway.  A broker that is away at boot delays READY by at most
  `READY_WAIT_S` (then the status line says "ingest down"): well inside the
  unit's TimeoutStartSec=60, so systemd never kills an agent that is
  draining its backlog only because the broker is late;
* ``WATCHDOG=1`` every half of ``$WATCHDOG_USEC`` from a task on the agent's
  event loop: if the loop wedges (a blocking call, a deadlock), the pings
  stop and systemd restarts the service after ``WatchdogSec``;
* ``STOPPING=1`` when the component is cancelled at shutdown;
* ``STATUS=...`` a one-line summary (``systemctl status`` shows it).

Outside systemd (no ``$NOTIFY_SOCKET``) every call is a no-op.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from .stages import StatusView

log = logging.getLogger(__name__)

READY_WAIT_S: Final = 20.0


class Notifier:
    def __init__(self, env: Mapping[str, str] | None = None) -> None:
        env = os.environ if env is None else env
        addr = env.get("NOTIFY_SOCKET", "")
        self._address = "\0" + addr[1:] if addr.startswith("@") else addr
        self.watchdog_interval_s: float | None = None
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        if usec.isdigit() and int(usec) > 0 and (not pid or pid == str(os.getpid())):
            self.watchdog_interval_s = int(usec) / 2e6

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *fields: str) -> bool:
        """Send one message (``KEY=value`` lines); False when not under systemd
        or the socket is gone (never raises: notification is best effort)."""
        if not self._address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.sendto("\n".join(fields).encode(), self._address)
        except OSError as e:
            log.warning("sd_notify to %r failed: %s", self._address, e)
            return False
        return True


def _status_line(agent: StatusView) -> str:
    h = agent.health()
    return (
        f"STATUS=ingest {h.ingest}, store {h.store}, uplink {h.uplink}, "
        f"backlog {agent.backlog_records} records"
    )


async def systemd_notify(
    agent: StatusView, notifier: Notifier | None = None, *, ready_wait_s: float = READY_WAIT_S
) -> None:
    """runtime.Component: READY=1 once the stages are up (or after
    `ready_wait_s` without an MQTT session), then watchdog pings (and a
    status line) until cancelled, then STOPPING=1."""
    n = notifier or Notifier()
    if not n.enabled:
        return
    up = await agent.wait_up(ready_wait_s)
    n.notify("READY=1", _status_line(agent))
    log.info(
        "told systemd we are ready%s%s",
        "" if up else f" (no MQTT session after {ready_wait_s:.0f}s; ingest keeps trying)",
        f"; watchdog ping every {n.watchdog_interval_s:.1f}s" if n.watchdog_interval_s else "",
    )
    interval = n.watchdog_interval_s or 10.0
    try:
        while True:
            await asyncio.sleep(interval)
            fields = [_status_line(agent)]
            if n.watchdog_interval_s:
                fields.insert(0, "WATCHDOG=1")
            n.notify(*fields)
    finally:
        n.notify("STOPPING=1")
