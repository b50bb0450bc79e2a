"""`iggy-edge run`: the agent itself (what the systemd unit starts)."""

from __future__ import annotations

import asyncio
import logging
import signal

from ..config import Settings
from ..downlink import return_path
from ..httpd import http_endpoint
from ..logs import setup_logging
from ..runtime import Agent, Component
from ..store import StoreError
from ..systemd import systemd_notify
from ..uplink.factory import make_command_source, make_uplink
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit

log = logging.getLogger("iggy_edge")

# Components that run beside the stages (HTTP metrics/health, return path)
# register themselves here; see runtime.Component.
EXTRA_COMPONENTS: list[Component] = [http_endpoint, systemd_notify, return_path]


def build_agent(settings: Settings) -> Agent:
    return Agent(
        settings,
        uplink=make_uplink(settings),
        command_source=make_command_source(settings),
        components=tuple(EXTRA_COMPONENTS),
    )


async def run_agent(agent: Agent) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop)
    try:
        await agent.run()
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


def run(config: ConfigOption = DEFAULT_CONFIG) -> None:
    """Run the agent: MQTT in, SQLite store-and-forward, batched Iggy out. Stops cleanly on SIGTERM."""
    settings = load_or_exit(config)
    secrets = [p.get_secret_value() for p in (settings.mqtt.password, settings.iggy.password) if p]
    setup_logging(settings.logging.level, settings.logging.format, secrets)
    log.info("iggy-edge starting: gateway %s, config %s", settings.gateway_id, config)
    try:
        asyncio.run(run_agent(build_agent(settings)))
    except StoreError as e:  # the buffer cannot be opened and waiting will not fix it
        log.error("cannot start: %s", e)
        raise fail(f"cannot start: {e}") from None
