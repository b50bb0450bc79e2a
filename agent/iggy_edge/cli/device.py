"""`iggy-edge device ...`: put the device library and an example on a board,
with its identity.

The work is the provision package's (agent/iggy_edge/provision/): the
sources, the staging directory, the mpremote plan and its runner, the serial
ports, flashing and the Mosquitto password file.  These commands parse the
options, call it, and print.  Secrets (the WiFi password, the board's MQTT
password) come from an environment variable or, for the WiFi password, a
hidden prompt; never from the command line, never logged.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from .. import ca_paths
from ..provision import ProvisionError, ports, sources
from ..provision import credentials as creds
from ..provision.plan import copy_to_board
from ..provision.staging import BOARD_CA_FILE, prepare
from . import device_credentials, device_flash, update
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit
from .device_view import parse_duration, show_devices

app = typer.Typer(help="Provision MicroPython boards (ESP32) with the device library.", no_args_is_help=True)
app.add_typer(device_credentials.app, name="credentials")
app.add_typer(update.app, name="update")
ca_app = typer.Typer(help="The gateway's certificate authority for TLS to the boards.", no_args_is_help=True)
app.add_typer(ca_app, name="ca")


def wifi_password(env_var: str | None) -> str:
    if env_var:
        value = os.environ.get(env_var)
        if not value:
            raise ProvisionError(f"WiFi password missing: environment variable {env_var} is not set")
        return value
    if sys.stdin.isatty():
        value = typer.prompt("WiFi password", hide_input=True)
        if value:
            return str(value)
    raise ProvisionError(
        "WiFi password missing: pass --wifi-password-env VAR (the name of an environment variable "
        "holding it) or run interactively to be prompted"
    )


# -- commands ----------------------------------------------------------------------
@app.command()
def provision(
    port: Annotated[str, typer.Option(help="Serial port of the board, e.g. /dev/ttyUSB0.")],
    example: Annotated[str, typer.Option(help="Firmware example folder (env_sensor, actuator, ...).")],
    device_id: Annotated[str, typer.Option(help="Device id: MQTT user, client id and topic level.")],
    wifi_ssid: Annotated[str, typer.Option(help="WiFi network name.")],
    broker: Annotated[str, typer.Option(help="MQTT broker host the board connects to.")],
    broker_port: Annotated[
        int | None, typer.Option(help="MQTT broker port (default 1883, 8883 with --tls).")
    ] = None,
    wifi_password_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding the WiFi password (otherwise a hidden prompt)."),
    ] = None,
    mqtt_user: Annotated[
        str | None, typer.Option(help="The board's MQTT user (default: the device id).")
    ] = None,
    mqtt_password_env: Annotated[
        str | None,
        typer.Option(
            help="Environment variable holding the board's MQTT password (otherwise one is generated)."
        ),
    ] = None,
    register: Annotated[
        bool,
        typer.Option(
            help="Register the MQTT user in this gateway's Mosquitto password file and reload it "
            "(--no-register when provisioning from another machine)."
        ),
    ] = True,
    passwd_file: device_credentials.PasswdOpt = creds.DEVICES_PASSWD,
    broker_pid: device_credentials.PidOpt = None,
    pid_file: device_credentials.PidFileOpt = None,
    tls: Annotated[
        bool, typer.Option("--tls", help="Connect with TLS and verify the gateway with its CA certificate.")
    ] = False,
    ca_cert: Annotated[
        Path, typer.Option(help="The gateway CA certificate (DER) copied to the board with --tls.")
    ] = ca_paths.CA_DIR / BOARD_CA_FILE,
    mpy: Annotated[
        bool, typer.Option("--mpy", help="Copy bytecode compiled by mpy-cross (saves RAM).")
    ] = False,
    source_root_opt: Annotated[
        Path | None, typer.Option("--source-root", help="Checkout holding device/ and firmware_examples/.")
    ] = None,
) -> None:
    """Copy the library, example, config and credentials to a board; register its MQTT user here."""
    try:
        root = sources.source_root(source_root_opt)
        wifi = wifi_password(wifi_password_env)  # before any slow step
        with tempfile.TemporaryDirectory(prefix="iggy-edge-provision-") as tmp:
            staged = prepare(
                root,
                example,
                Path(tmp),
                device_id=device_id,
                wifi_ssid=wifi_ssid,
                wifi_password=wifi,
                broker=broker,
                broker_port=broker_port,
                mqtt_user=mqtt_user,
                mqtt_password_env=mqtt_password_env,
                tls=tls,
                ca_cert=ca_cert,
                mpy=mpy,
            )
            mpremote = sources.tool("mpremote")
            ports.check_port(port)
            if register:
                creds.users(passwd_file)  # fail now if the password file is not where expected
            copy_to_board(mpremote, port, staged, Path(tmp), echo=typer.echo)
        ident = staged.identity
        if register:
            how = creds.Reload(broker_pid=broker_pid, pid_file=pid_file)
            typer.echo(creds.register(passwd_file, ident.user, ident.password, how, replace=True))
        elif ident.generated:
            typer.echo(
                f"register the board on the gateway: iggy-edge device credentials add {ident.user} "
                "--password-env VAR (VAR holding the password below)"
            )
    except (ProvisionError, creds.CredentialsError) as e:
        raise fail(str(e)) from None
    if ident.generated:
        typer.echo(
            f"generated MQTT password for {ident.user} (shown once; it is on the board in "
            f"config.local.json):\n{ident.password}"
        )
    typer.echo(
        f"provisioned {device_id} ({example}) on {port}: {len(staged.files)} files verified, "
        "safe mode left and the board reset: it runs now; check it with "
        "`iggy-edge status` (its telemetry) and `iggy-edge device credentials list`"
    )


app.command("flash")(device_flash.flash_cmd)


@ca_app.command("init")
def ca_init(
    san: Annotated[
        list[str],
        typer.Option(help="A name or IP address the boards use for the broker (repeatable)."),
    ],
    gateway: Annotated[str, typer.Option(help="Gateway name in the CA's subject.")] = "gateway",
    ca_dir: Annotated[Path, typer.Option(help="Where the CA key and certificate live.")] = ca_paths.CA_DIR,
    server_cert: Annotated[
        Path, typer.Option(help="The broker's certificate (Mosquitto certfile).")
    ] = ca_paths.SERVER_CERT,
    server_key: Annotated[
        Path, typer.Option(help="The broker's key (Mosquitto keyfile).")
    ] = ca_paths.SERVER_KEY,
    renew_server: Annotated[
        bool, typer.Option(help="Issue a new server certificate with exactly these names.")
    ] = False,
) -> None:
    """Create the gateway CA (first use) and the broker's TLS certificate."""
    import grp  # noqa: PLC0415 - POSIX only, needed here alone

    from .. import gateway_ca  # noqa: PLC0415 - cryptography only for the commands that need it

    try:
        gid: int | None = grp.getgrnam("mosquitto").gr_gid
    except KeyError:
        gid = None
    paths = ca_paths.CaPaths(ca_dir=ca_dir, server_cert=server_cert, server_key=server_key)
    try:
        result = gateway_ca.init(paths, gateway, san, renew_server=renew_server, key_gid=gid)
    except (gateway_ca.CaError, PermissionError) as e:
        raise fail(str(e) if isinstance(e, gateway_ca.CaError) else f"{e}: run it with sudo") from None
    typer.echo(
        ("created the gateway CA in " if result.created_ca else "the gateway CA in ")
        + f"{ca_dir} ({'new' if result.created_ca else 'kept'}; the board copy is {paths.ca_der})"
    )
    if result.issued_server:
        typer.echo(f"issued {server_cert} and {server_key} for: {', '.join(result.names)}")
        typer.echo(
            "enable the TLS listener (the commented 8883 block in /etc/mosquitto/conf.d/iggy-edge.conf) "
            "and restart mosquitto; then provision boards with --tls"
        )
    else:
        typer.echo(f"{server_cert} already covers: {', '.join(result.names)}")


@app.command("list")
def list_devices(
    config: ConfigOption = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="The agent's /devices document.")] = False,
    stale: Annotated[
        str | None,
        typer.Option(
            "--stale", metavar="DURATION", help="Only devices silent longer than this (90s, 10m, 2h, 1d)."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", "-d", help="Only this device, in detail.")] = None,
) -> None:
    """Every device this gateway has heard from, stalest first (from the running agent)."""
    settings = load_or_exit(config)
    show_devices(
        settings, as_json=as_json, stale=None if stale is None else parse_duration(stale), device=device
    )


@app.command("ports")
def list_ports(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """List serial ports; the USB-serial bridges ESP32 boards use are marked."""
    try:
        found = ports.serial_ports()
    except ProvisionError as e:
        raise fail(str(e)) from None
    if as_json:
        for p in found:
            doc = {k: (None if v == "None" else v) for k, v in p.__dict__.items()}
            typer.echo(json.dumps({**doc, "bridge": p.bridge}))
    elif not found:
        typer.echo("no serial ports found: plug the board in (and check the USB cable carries data)")
    else:
        typer.echo(f"{'PORT':<16} {'VID:PID':<10} {'BOARD?':<28} DESCRIPTION")
        for p in found:
            desc = " ".join(x for x in (p.manufacturer, p.product) if x != "None")
            typer.echo(f"{p.device:<16} {p.vid_pid:<10} {p.bridge or '-':<28} {desc}")
