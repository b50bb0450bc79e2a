"""`iggy-edge run`: the agent itself (what the systemd unit starts)."""

from __future__ import annotations

import asyncio
import logging
import platform
import signal

from .. import __version__
from ..logs import install_loop_exception_handler, setup_logging
from ..runtime import Agent, build_agent
from ..store import StoreError
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit

log = logging.getLogger("iggy_edge")


async def run_agent(agent: Agent) -> None:
    """Run `agent` until SIGTERM / SIGINT (which stop it in order)."""
    loop = asyncio.get_running_loop()
    install_loop_exception_handler(loop)
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
    public = [settings.mqtt.username, settings.iggy.username, settings.gateway_id, settings.mqtt_client_id]
    setup_logging(settings.logging.level, settings.logging.format, secrets, public)
    log.info(
        "iggy-edge %s starting: gateway %s, config %s, Python %s",
        __version__,
        settings.gateway_id,
        config,
        platform.python_version(),
    )
    try:
        asyncio.run(run_agent(build_agent(settings)))
    except StoreError as e:  # the buffer cannot be opened and waiting will not fix it
        log.error("cannot start: %s", e)
        raise fail(f"cannot start: {e}") from None
