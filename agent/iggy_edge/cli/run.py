"""`iggy-edge run`: the agent itself (what the systemd unit starts)."""

from __future__ import annotations

import asyncio
import logging
import platform
import signal
from pathlib import Path

from .. import __version__
from ..config import ConfigError, load_config
from ..logs import install_loop_exception_handler, setup_logging
from ..runtime import Agent, build_agent
from ..store import StoreError
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit

log = logging.getLogger("iggy_edge")


def reload_config(agent: Agent, path: Path) -> None:
    """SIGHUP: read `path` again and take what a running agent can
    (reload.py); a file that does not validate changes nothing."""
    try:
        new = load_config(path)
    except ConfigError as e:
        log.error("reload refused, running on the previous configuration: %s", e)
        return
    result = agent.reload(new)
    if not result.changed:
        log.info("reload: %s has no changes", path)
        return
    if result.live:
        logging.getLogger().setLevel(agent.settings.logging.level)
        log.warning("reload: applied %s", "; ".join(map(str, result.live)))
    if result.restart:
        log.warning(
            "reload: these need a restart and were NOT applied (systemctl restart iggy-edge): %s",
            "; ".join(map(str, result.restart)),
        )


async def run_agent(agent: Agent, config: Path | None = None) -> None:
    """Run `agent` until SIGTERM / SIGINT (which stop it in order); SIGHUP
    reloads `config` when given."""
    loop = asyncio.get_running_loop()
    install_loop_exception_handler(loop)
    signals = [signal.SIGTERM, signal.SIGINT]
    for sig in signals:
        loop.add_signal_handler(sig, agent.stop)
    if config is not None:
        loop.add_signal_handler(signal.SIGHUP, reload_config, agent, config)
        signals.append(signal.SIGHUP)
    try:
        await agent.run()
    finally:
        for sig in signals:
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
        asyncio.run(run_agent(build_agent(settings), config))
    except StoreError as e:  # the buffer cannot be opened and waiting will not fix it
        log.error("cannot start: %s", e)
        raise fail(f"cannot start: {e}") from None
