"""Prometheus and health endpoint: a tiny asyncio HTTP/1.0 server.

Routes (GET or HEAD only):

=============  ==============================================================
``/metrics``   the agent's private registry (`Metrics.registry`) in the
               Prometheus text exposition format, plus ``iggy_edge_agent_*``
               (info, start time, health) computed at scrape time
``/health``    JSON from the agent's `health()` (stages.HttpView); 200 when healthy, 503 when not
``/``          the dashboard (dashboard.py: one self-contained page), which
               reads ``/api/overview`` and ``/devices`` (JSON)
=============  ==============================================================

Why not aiohttp or prometheus_client's own server: the latter runs in a
thread (and `Agent.health()` belongs to the loop), the former is a large
dependency for two read-only routes.  Every connection is bounded: the
request head must arrive within `REQUEST_TIMEOUT_S` and fit in
`MAX_REQUEST_BYTES`, and the connection closes after one response.

Bounded under a flood: at most `MAX_CONNECTIONS` connections are open at
once.  At the cap, a new connection whose request is already there or
arrives within `HEAD_GRACE_S` (a real scrape sends it right after
connecting) takes the
place of the oldest connection still waiting for its request (an idle or
slow client); a new connection that sends nothing in that time, or finds
every slot busy answering, is closed unanswered (so is one arriving while
`MAX_CONNECTIONS` others are in their grace period).  Each is counted
(``iggy_edge_http_connections_dropped_total{reason}``) and logged,
rate-limited.  So 1,100 idle local connections cost the agent at most
`MAX_CONNECTIONS` file descriptors, /health keeps answering, and ingest's
MQTT reconnects still find descriptors free.

/health names whose figures these are (``gateway``, ``buffer`` path and the
buffer's ``instance`` id, random per database file) so `iggy-edge status`
can tell this gateway's agent from another process holding the port.

The endpoint binds to `MetricsSettings.listen` (``127.0.0.1:9108`` by
default): figures and health are not secret, but a gateway should not offer
them to its whole network unless the operator says so.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import fcntl
import json
import logging
import termios
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric

from . import __version__, dashboard
from .backoff import backoff_delay
from .config import parse_listen
from .logs import RateLimitedLog
from .timeouts import wait_for

if TYPE_CHECKING:
    from .stages import HttpView

log = logging.getLogger(__name__)
limited = RateLimitedLog(log)

REQUEST_TIMEOUT_S: Final = 5.0
MAX_REQUEST_BYTES: Final = 8192
MAX_CONNECTIONS: Final = 64
# asyncio accepts up to `backlog` connections per loop iteration, each a file
# descriptor until its handler runs: keep the burst near the cap.
LISTEN_BACKLOG: Final = MAX_CONNECTIONS
# At the cap, how long a new connection may take to send its request.
HEAD_GRACE_S: Final = 0.05
DROP_REASONS: Final = ("evicted_idle", "refused_idle", "refused_busy")
REASONS: Final = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
}


def _json(doc: object) -> bytes:
    return json.dumps(doc).encode() + b"\n"


def local_url(listen: str) -> str:
    """The URL a local client uses to reach an endpoint bound to `listen`."""
    host, port = parse_listen(listen)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a client address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _request_waiting(writer: asyncio.StreamWriter) -> bool:
    """Whether the client's bytes already wait in the kernel (FIONREAD; the
    handler runs before the loop first reads the socket).  False when unknown."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return False
    pending = array.array("i", [0])
    try:
        fcntl.ioctl(sock.fileno(), termios.FIONREAD, pending)
    except OSError:
        return False
    return pending[0] > 0


class _AgentCollector:
    """Figures that only exist at scrape time: build info, start time, health."""

    def __init__(self, agent: HttpView, server: MetricsServer) -> None:
        self._agent = agent
        self._server = server

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        info = InfoMetricFamily("iggy_edge_agent", "Agent version and gateway id")
        info.add_metric([], {"version": __version__, "gateway": agent.settings.gateway_id})
        yield info
        yield GaugeMetricFamily(
            "iggy_edge_agent_start_time_seconds",
            "Unix time the agent started",
            value=agent.metrics.started_at,
        )
        health = agent.health()
        yield GaugeMetricFamily(
            "iggy_edge_agent_healthy", "1 when /health answers 200", value=1.0 if health.healthy else 0.0
        )
        parts = GaugeMetricFamily(
            "iggy_edge_agent_component_ok", "1 when the component is fine", labels=["component"]
        )
        parts.add_metric(["ingest"], 1.0 if health.ingest == "up" else 0.0)
        parts.add_metric(["store"], 1.0 if health.store == "ok" else 0.0)
        parts.add_metric(["uplink"], 1.0 if health.uplink in ("up", "none") else 0.0)
        yield parts
        stages = GaugeMetricFamily(
            "iggy_edge_agent_stage_failing",
            "1 while a stage failed less than a minute ago (restarting, or in a crash loop)",
            labels=["stage"],
        )
        for name, text in health.stages.items():
            stages.add_metric([name], 1.0 if text.startswith("failing") else 0.0)
        yield stages
        bounds = agent.settings.buffer
        yield GaugeMetricFamily(
            "iggy_edge_store_limit_bytes", "buffer.max_bytes: the backlog's bound", value=bounds.max_bytes
        )
        yield GaugeMetricFamily(
            "iggy_edge_store_limit_records",
            "buffer.max_records: the backlog's bound",
            value=bounds.max_records,
        )
        yield GaugeMetricFamily(
            "iggy_edge_devices_seen", "Devices heard from (devices.py)", value=len(agent.devices)
        )
        yield GaugeMetricFamily(
            "iggy_edge_devices_stale",
            "Devices silent longer than metrics.device_stale_s",
            value=agent.devices.stale(agent.settings.metrics.device_stale_s),
        )
        yield CounterMetricFamily(
            "iggy_edge_devices_forgotten",
            "Devices forgotten because the device table was full",
            value=agent.devices.forgotten,
        )
        server = self._server
        yield GaugeMetricFamily(
            "iggy_edge_http_connections_open",
            "Open connections to the metrics/health endpoint",
            value=len(server.open_connections),
        )
        dropped = CounterMetricFamily(
            "iggy_edge_http_connections_dropped",
            f"Connections closed unanswered because {MAX_CONNECTIONS} were open",
            labels=["reason"],
        )
        for reason in DROP_REASONS:
            dropped.add_metric([reason], server.dropped[reason])
        yield dropped

    def describe(self) -> Iterator[Metric]:
        return iter(())  # computed at scrape time; no registration-time collect()


class MetricsServer:
    """Serves one agent's figures; `start()` binds, `close()` stops."""

    def __init__(self, agent: HttpView, listen: str) -> None:
        self._agent = agent
        self._host, self._port = parse_listen(listen)
        self._server: asyncio.Server | None = None
        self._collector = _AgentCollector(agent, self)
        # Every open connection, and (in arrival order) those still waiting
        # for their request head: the eviction candidates.
        self.open_connections: set[asyncio.StreamWriter] = set()
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self.dropped = dict.fromkeys(DROP_REASONS, 0)
        self._graced = 0
        self.samples = dashboard.Samples(agent.metrics)  # the dashboard's last hour
        agent.metrics.registry.register(self._collector)

    @property
    def port(self) -> int:
        """The bound port (useful when listen asked for port 0)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def bound_addresses(self) -> list[tuple[str, int]]:
        """(host, port) of every socket the server listens on."""
        if self._server is None:
            return []
        return [(str(a[0]), int(a[1])) for a in (sock.getsockname() for sock in self._server.sockets)]

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=MAX_REQUEST_BYTES, backlog=LISTEN_BACKLOG
        )
        log.info(
            "metrics, health and the dashboard on http://%s:%d/ (/metrics, /health, /devices)",
            self._host,
            self.port,
        )

    async def close(self) -> None:
        with contextlib.suppress(KeyError):  # unregistered already
            self._agent.metrics.registry.unregister(self._collector)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = None
        if len(self.open_connections) >= MAX_CONNECTIONS and not _request_waiting(writer):
            # At the cap: only a client that sends its request at once may
            # take an idle connection's place; at most MAX_CONNECTIONS more
            # wait for that chance.
            if self._graced >= MAX_CONNECTIONS:
                self._drop("refused_idle", writer)
                return
            self._graced += 1
            try:
                head = await wait_for(reader.readuntil(b"\r\n\r\n"), HEAD_GRACE_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                self._drop("refused_idle", writer)
                return
            finally:
                self._graced -= 1
        if len(self.open_connections) >= MAX_CONNECTIONS:
            victim = next(iter(self._waiting), None)
            if victim is None:
                self._drop("refused_busy", writer)
                return
            self._drop("evicted_idle", victim)
        self.open_connections.add(writer)
        if head is None:
            self._waiting[writer] = None
        try:
            await self._serve(reader, writer, head)
        finally:
            self._waiting.pop(writer, None)
            self.open_connections.discard(writer)

    def _drop(self, reason: str, writer: asyncio.StreamWriter) -> None:
        self.dropped[reason] += 1
        self._waiting.pop(writer, None)
        self.open_connections.discard(writer)
        writer.transport.abort()
        limited.warning(
            "http-cap",
            "metrics/health endpoint: %d connections open (the cap); closed one unanswered (%s)",
            MAX_CONNECTIONS,
            reason,
        )

    async def _serve(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes | None
    ) -> None:
        if head is None:
            try:
                head = await wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
                writer.transport.abort()
                return
        self._waiting.pop(writer, None)
        try:
            status, ctype, body = await self._respond(head)
            method = head.split(b" ", 1)[0]
            writer.write(
                (
                    f"HTTP/1.0 {status} {REASONS.get(status, 'Error')}\r\n"
                    f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                    "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
                ).encode()
            )
            if method != b"HEAD":
                writer.write(body)
            await wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await wait_for(writer.wait_closed(), 1.0)

    async def _respond(self, head: bytes) -> tuple[int, str, bytes]:
        try:
            method, target, _ = head.split(b"\r\n", 1)[0].decode("ascii").split(" ", 2)
        except (UnicodeDecodeError, ValueError):
            return 400, "text/plain", b"bad request\n"
        if method not in ("GET", "HEAD"):
            return 405, "text/plain", b"only GET and HEAD\n"
        path = target.split("?", 1)[0]
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self._agent.metrics.registry)
        if path == "/health":
            health = self._agent.health()
            doc = health.as_dict() | {
                "gateway": self._agent.settings.gateway_id,
                "buffer": str(self._agent.settings.buffer_path.absolute()),
                "instance": self._agent.buffer_instance,
                "version": __version__,
                "uptime_s": round(time.time() - self._agent.metrics.started_at, 1),
            }
            return (200 if health.healthy else 503), "application/json", _json(doc)
        if path == "/":
            return 200, "text/html; charset=utf-8", dashboard.PAGE
        if path == "/api/overview":
            return 200, "application/json", _json(dashboard.overview(self._agent, self.samples))
        if path == "/devices":
            return 200, "application/json", _json(await dashboard.devices_doc(self._agent))
        return 404, "text/plain", b"not found\n"


async def http_endpoint(agent: HttpView) -> None:
    """runtime.Component: serve /metrics and /health until cancelled."""
    if not agent.settings.metrics.enabled:
        return
    attempt = 0
    while True:
        server = MetricsServer(agent, agent.settings.metrics.listen)
        try:
            await server.start()
        except OSError as e:
            # Another process holds the port, or the address is not this
            # machine's: say so (no traceback), keep the agent running, retry.
            await server.close()
            delay = backoff_delay(attempt, 1.0, 60.0)
            attempt += 1
            limited.error(
                "http-bind",
                "cannot serve /metrics and /health on %s: %s; retrying (in %.0fs)",
                agent.settings.metrics.listen,
                e.strerror or e,
                delay,
            )
            await asyncio.sleep(delay)
            continue
        try:
            await server.samples.run()  # the dashboard's samples, until cancelled at shutdown
        finally:
            await server.close()
