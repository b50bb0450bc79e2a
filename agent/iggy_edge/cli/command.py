"""`iggy-edge command send|list` and `iggy-edge config push`: the return path
from an operator's seat.

`send` and `push` write into Iggy exactly what the cloud side would: the
gateway's return-path topic (``edge-rp-<n>/return.<gateway>``, partition 0),
with the ``kind`` header saying ``command`` or ``config``.  They never create
the topic (``iggy-edge cloud provision-gateway`` does).  They need a real
server (``[iggy] kind = "iggy"`` or IGGY_ADDRESS): with ``kind = "memory"``
the store lives inside the agent's process and another process cannot
reach it.  `list` reads the agent's
buffer database read-only; it works while the agent runs.

`config republish` marks configs in the agent's buffer database for the
running agent to publish again (it picks them up within a second, or at its
next start).  It does not publish itself: the agent's one deliver connection
stays the only publisher of ``down/config``, so a restore can never land
after, and so replace, a newer config the agent is publishing at that
moment, and the CLI needs no broker credentials.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import sqlite3
from pathlib import Path
from typing import Annotated, Any

import typer

from ..config import Settings
from ..device_ids import gateway_id_problem
from ..downlink.commands import (
    Command,
    DesiredConfig,
    InvalidCommand,
    make_command,
    make_config,
    printable,
    return_topic_of,
)
from ..inbox_admin import read_commands, read_configs, read_offsets, request_republish
from ..uplink.iggy import send_command
from ..uplink.protocol import UplinkError
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit

app = typer.Typer(help="Send commands to devices through Iggy and see their states.", no_args_is_help=True)


def _publish(settings: Settings, gateway: str | None, msg: Command | DesiredConfig) -> dict[str, Any]:
    if settings.iggy.kind != "iggy":
        raise fail(
            f'iggy kind is "{settings.iggy.kind}": sending needs a real Iggy server ([iggy] kind = "iggy" '
            "or IGGY_ADDRESS). A memory Iggy lives inside the agent process and cannot be reached from here.",
            2,
        )
    gateway = gateway or settings.gateway_id
    problem = gateway_id_problem(gateway)
    if problem is not None:
        raise fail(f"--gateway: {problem}", 2)
    rt = return_topic_of(gateway, settings.downlink)
    iggy = settings.iggy.model_copy(update={"create_missing": False})  # provisioning's job, not ours
    try:
        offset = asyncio.run(send_command(iggy, rt.stream, rt.topic, rt.partition, msg.wire(), msg.headers()))
    except UplinkError as e:
        hint = ""
        if "does not exist" in str(e):
            hint = f" (provision the gateway first: iggy-edge cloud provision-gateway --gateway {gateway})"
        raise fail(f"not sent: {e}{hint}") from None
    return {"stream": rt.stream, "topic": rt.topic, "partition": rt.partition, "offset": offset}


GatewayOption = Annotated[
    str | None,
    typer.Option("--gateway", "-g", help="The gateway serving the device (default: the config's gateway_id)"),
]


@app.command("send")
def send(
    device: Annotated[str, typer.Option("--device", "-d", help="Target device id.")],
    name: Annotated[str, typer.Option("--name", help="Command name.")],
    args: Annotated[str, typer.Option("--args", help="Arguments as a JSON object.")] = "{}",
    ttl: Annotated[
        float | None,
        typer.Option("--ttl", min=0.001, help="Seconds until it expires (default downlink.default_ttl_s)."),
    ] = None,
    command_id: Annotated[str | None, typer.Option("--id", help="Command id (default: random).")] = None,
    gateway: GatewayOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was sent as one JSON object.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Write a command for DEVICE into Iggy, as the cloud side would; prints its id."""
    settings = load_or_exit(config)
    try:
        parsed_args = json.loads(args)
    except json.JSONDecodeError as e:
        raise fail(f"--args is not JSON: {e}", 2) from None
    if not isinstance(parsed_args, dict):
        raise fail("--args must be a JSON object", 2)
    try:
        cmd = make_command(
            device,
            name,
            parsed_args,
            ttl_s=ttl if ttl is not None else settings.downlink.default_ttl_s,
            command_id=command_id,
        )
    except InvalidCommand as e:
        raise fail(str(e), 2) from None
    where = _publish(settings, gateway, cmd)
    if as_json:
        typer.echo(json.dumps({"id": cmd.id, "device": device, "expires_at": cmd.expires_at, **where}))
        return
    expires = _when(cmd.expires_at)
    typer.echo(f"sent command {cmd.id} ({printable(name)}) for {device}: {_where(where)}; expires {expires}")
    typer.echo(f"follow it with: iggy-edge command list --device {device}")


def _where(where: dict[str, Any]) -> str:
    return f"{where['stream']}/{where['topic']} partition {where['partition']}, offset {where['offset']}"


def _when(ts: float) -> str:
    try:
        return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S")
    except (OverflowError, OSError, ValueError):  # a time no calendar holds (rows the parser refuses now)
        return f"{ts:.0f}"


@app.command("list")
def list_commands(
    limit: Annotated[int, typer.Option("--limit", "-n", min=1, help="How many, newest first.")] = 20,
    device: Annotated[str | None, typer.Option("--device", "-d", help="Only this device.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Recent commands and their states (received, delivered, acked, expired, failed)."""
    settings = load_or_exit(config)
    try:
        rows = read_commands(settings.buffer_path, limit=limit, device=device)
        offsets = read_offsets(settings.buffer_path)
    except FileNotFoundError as e:
        raise fail(str(e)) from None
    if as_json:
        for r in rows:
            typer.echo(json.dumps(r.as_dict()))
        return
    if not rows:
        typer.echo("no commands")
    else:
        typer.echo(f"{'ID':<18} {'DEVICE':<16} {'NAME':<16} {'STATE':<10} {'UPDATED':<19} RESULT / DETAIL")
        for r in rows:
            # Ids, names and the device's error text come from the cloud side
            # and the devices: escaped, so no escape sequence reaches the terminal.
            cid, dev, name, state = (printable(v) for v in (r.id, r.device, r.name, r.state))
            typer.echo(
                f"{cid:<18} {dev:<16} {name:<16} {state:<10} {_when(r.updated_at):<19} {printable(r.detail)}"
            )
    for stream, topic, partition, last, mirrored in offsets:
        lag = "" if mirrored == last else f" (server has {mirrored})"
        typer.echo(f"offset {stream}/{topic}/{partition}: {last}{lag}")


def config_push(
    file: Annotated[
        Path,
        typer.Argument(
            metavar="FILE", help="Desired configuration: a JSON object.", exists=True, dir_okay=False
        ),
    ],
    device: Annotated[str, typer.Option("--device", "-d", help="Target device id.")],
    config_id: Annotated[
        str | None, typer.Option("--id", help="Config id/version (default: random).")
    ] = None,
    gateway: GatewayOption = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print what was sent as one JSON object.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Send FILE as DEVICE's desired configuration (published retained to the device)."""
    settings = load_or_exit(config)
    try:
        desired = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"{file}: not readable JSON: {e}", 2) from None
    if not isinstance(desired, dict):
        raise fail(f"{file}: must hold a JSON object", 2)
    try:
        cfg = make_config(device, desired, config_id=config_id)
    except InvalidCommand as e:
        raise fail(str(e), 2) from None
    where = _publish(settings, gateway, cfg)
    if as_json:
        typer.echo(json.dumps({"id": cfg.id, "device": device, **where}))
    else:
        typer.echo(f"sent config {printable(cfg.id)} for {device}: {_where(where)}")


def config_republish(
    device: Annotated[
        str | None, typer.Option("--device", "-d", help="Only this device (default: every device).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the outcome as one JSON object.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Publish the newest desired config of every device (or DEVICE) again, retained.

    For a broker that lost its retained messages.  The running agent does it,
    in device order, at most downlink.republish_rate per second; a config
    still waiting for delivery goes out anyway and is not counted here.
    """
    settings = load_or_exit(config)
    try:
        marked = request_republish(settings.buffer_path, device)
        rows = read_configs(settings.buffer_path)
    except FileNotFoundError as e:
        raise fail(str(e)) from None
    except sqlite3.Error as e:
        raise fail(f"cannot mark configs in {settings.buffer_path}: {e}") from None
    if device is not None and not any(r[0] == device for r in rows):
        raise fail(f"no desired config for device {device!r} in {settings.buffer_path}")
    waiting = [r[0] for r in rows if r[2] == "received" and device in (None, r[0])]
    if as_json:
        typer.echo(json.dumps({"marked": marked, "device": device, "still_due": waiting}))
        return
    typer.echo(f"marked {marked} config(s) for the running agent to publish again (it does within a second)")
    if waiting:
        typer.echo(f"not yet delivered, going out anyway: {', '.join(printable(d) for d in waiting)}")
