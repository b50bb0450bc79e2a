"""`iggy-edge doctor`: check everything the agent depends on and say what to fix.

Checks, each bounded in time and independent of the others:

* config      the file parses and validates (with the service's secrets from
              /etc/iggy-edge/env when readable, as systemd would pass them)
* clock       the system time is plausible (a Pi without RTC boots in 1970
              until NTP syncs; message times and TTLs depend on it) and NTP
              synchronisation where systemd-timesyncd reports it
* disk        the buffer's file system has room for buffer.max_bytes
* broker      TCP reachability, then an MQTT CONNECT with the configured
              credentials under a separate client id (never the agent's: that
              would take over its persistent session)
* broker-listener, device-users, iggy-transport
              who holds the agent's listener, the names in the devices'
              password files, the Iggy password in clear
* iggy        reachability of every node (``iggy nodes`` when several are
              configured), login, the cluster's leader as the server tells
              it (``iggy cluster``), the topics the routes need and the
              user's permissions to send / create / poll (kind = "iggy" only)
* agent       whether a running agent answers on its health endpoint

Each check lives beside what it checks (checks.py lists the homes); this
module keeps the command, the order the checks run in and the rendering.

Exit status 0 when nothing failed (warnings allowed), 1 otherwise.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Final

import typer

from ..broker_checks import MOSQUITTO_CONF, check_broker, check_broker_config, check_device_users
from ..broker_listener import check_agent_listener
from ..checks import DEFAULT_ENV_FILE, Check
from ..clock_check import check_clock
from ..config_check import check_config, read_env_file
from ..httpd_check import check_agent
from ..store.check import check_disk
from ..uplink.iggy.check import check_iggy, check_iggy_transport
from .common import DEFAULT_CONFIG, ConfigOption

MARK: Final = {"ok": "✓", "warn": "!", "fail": "✗", "skip": "-"}
COLOUR: Final = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "white"}


def summary(checks: list[Check]) -> str:
    """The last line of doctor's text output: failures, warnings and whether
    the agent runs, never "all checks passed" when any of it is not so."""
    failed = sum(c.status == "fail" for c in checks)
    warned = sum(c.status == "warn" for c in checks)
    agent = next((c for c in checks if c.name == "agent"), None)
    warnings = f"{warned} warning{'s' if warned != 1 else ''}"
    if failed:
        line = f"{failed} problem{'s' if failed != 1 else ''}" + (f", {warnings}" if warned else "")
    elif warned:
        line = f"passed with {warnings}"
    else:
        line = "all checks passed"
    if agent is not None and agent.status == "skip" and agent.detail.startswith("not running"):
        line += "; the agent is not running"
    return line


async def run_checks(
    config: Path, env: Mapping[str, str], mosquitto_conf: Path = MOSQUITTO_CONF
) -> list[Check]:
    cfg, settings = check_config(config, env)
    checks = [cfg, check_clock()]
    if settings is None:
        checks.append(Check("broker", "skip", "needs a valid config"))
        checks.append(Check("iggy", "skip", "needs a valid config"))
        return checks
    checks.append(check_disk(settings))
    broker, iggy = await asyncio.gather(check_broker(settings), check_iggy(settings))
    checks.append(broker)
    checks.append(check_broker_config(settings, mosquitto_conf))
    checks.append(await asyncio.to_thread(check_agent_listener, settings))
    checks.append(check_device_users(settings, mosquitto_conf))
    checks.extend(iggy)
    transport = check_iggy_transport(settings)
    if transport is not None:
        checks.append(transport)
    checks.append(await asyncio.to_thread(check_agent, settings))
    return checks


def doctor(
    config: ConfigOption = DEFAULT_CONFIG,
    env_file: Annotated[
        Path,
        typer.Option(help="Secrets file the service reads (EnvironmentFile=); used when readable."),
    ] = DEFAULT_ENV_FILE,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable results.")] = False,
    mosquitto_conf: Annotated[
        Path, typer.Option(help="The local broker's config, read when mqtt.host is this machine.")
    ] = MOSQUITTO_CONF,
) -> None:
    """Check config, clock, disk, broker and its config, Iggy and permissions; print what to fix."""
    logging.getLogger("gmqtt").setLevel(logging.CRITICAL)  # its refusal warnings duplicate ours
    env = dict(os.environ)
    env_note: Check | None = None
    if env_file.exists():
        try:
            env = read_env_file(env_file) | env  # the caller's environment wins, as an override
        except PermissionError:
            env_note = Check(
                "secrets",
                "warn",
                f"{env_file} is not readable by this user",
                "run doctor with sudo to check with the service's credentials",
            )
        except (OSError, UnicodeDecodeError) as e:
            env_note = Check(
                "secrets", "fail", f"cannot read {env_file}: {e}", "fix the file (KEY=value lines)"
            )
    checks = asyncio.run(run_checks(config, env, mosquitto_conf))
    if env_note is not None:
        checks.insert(1, env_note)
    failed = [c for c in checks if c.status == "fail"]
    if as_json:
        typer.echo(json.dumps({"ok": not failed, "checks": [asdict(c) for c in checks]}))
    else:
        for c in checks:
            typer.secho(f"{MARK[c.status]} {c.name}: {c.detail}", fg=COLOUR[c.status])
            if c.fix and c.status in ("fail", "warn"):
                typer.echo(f"    fix: {c.fix}")
        typer.echo("\n" + summary(checks))
    if failed:
        raise typer.Exit(1)
