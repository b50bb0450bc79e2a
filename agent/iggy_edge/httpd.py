"""Prometheus and health endpoint: a tiny asyncio HTTP/1.0 server.

Routes (GET or HEAD only):

=============  ==============================================================
``/metrics``   the agent's private registry (`Metrics.registry`) in the
               Prometheus text exposition format, plus ``iggy_edge_agent_*``
               (info, start time, health) computed at scrape time
``/health``    JSON from `Agent.health()`; 200 when healthy, 503 when not
``/``          a two-line index
=============  ==============================================================

Why not aiohttp or prometheus_client's own server: the latter runs in a
thread (and `Agent.health()` belongs to the loop), the former is a large
dependency for two read-only routes.  Every connection is bounded: the
request head must arrive within `REQUEST_TIMEOUT_S` and fit in
`MAX_REQUEST_BYTES`, and the connection closes after one response.

The endpoint binds to `MetricsSettings.listen` (``127.0.0.1:9108`` by
default): figures and health are not secret, but a gateway should not offer
them to its whole network unless the operator says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Final

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily, Metric

from . import __version__
from .config import parse_listen

if TYPE_CHECKING:
    from .runtime import Agent

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S: Final = 5.0
MAX_REQUEST_BYTES: Final = 8192
REASONS: Final = {
    200: "OK",
    404: "Not Found",
    405: "Method Not Allowed",
    400: "Bad Request",
    503: "Service Unavailable",
}


def local_url(listen: str) -> str:
    """The URL a local client uses to reach an endpoint bound to `listen`."""
    host, port = parse_listen(listen)
    host = {"0.0.0.0": "127.0.0.1", "::": "::1"}.get(host, host)  # noqa: S104 - a client address
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _AgentCollector:
    """Figures that only exist at scrape time: build info, start time, health."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

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

    def describe(self) -> Iterator[Metric]:
        return iter(())  # computed at scrape time; no registration-time collect()


class MetricsServer:
    """Serves one agent's figures; `start()` binds, `close()` stops."""

    def __init__(self, agent: Agent, listen: str) -> None:
        self._agent = agent
        self._host, self._port = parse_listen(listen)
        self._server: asyncio.Server | None = None
        self._collector = _AgentCollector(agent)
        agent.metrics.registry.register(self._collector)

    @property
    def port(self) -> int:
        """The bound port (useful when listen asked for port 0)."""
        if self._server is None or not self._server.sockets:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._handle, self._host, self._port, limit=MAX_REQUEST_BYTES
        )
        log.info("metrics and health on http://%s:%d/metrics and /health", self._host, self.port)

    async def close(self) -> None:
        with contextlib.suppress(KeyError):  # unregistered already
            self._agent.metrics.registry.unregister(self._collector)
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            writer.close()
            return
        try:
            status, ctype, body = self._respond(head)
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
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except (ConnectionError, TimeoutError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError, TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)

    def _respond(self, head: bytes) -> tuple[int, str, bytes]:
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
                "version": __version__,
                "uptime_s": round(time.time() - self._agent.metrics.started_at, 1),
            }
            return (200 if health.healthy else 503), "application/json", json.dumps(doc).encode() + b"\n"
        if path == "/":
            return 200, "text/plain", b"iggy-edge: /metrics (Prometheus), /health (JSON)\n"
        return 404, "text/plain", b"not found\n"


async def http_endpoint(agent: Agent) -> None:
    """runtime.Component: serve /metrics and /health until cancelled."""
    if not agent.settings.metrics.enabled:
        return
    server = MetricsServer(agent, agent.settings.metrics.listen)
    await server.start()
    try:
        await asyncio.Event().wait()  # until cancelled at shutdown
    finally:
        await server.close()
