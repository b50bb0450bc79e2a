"""`iggy-edge device credentials add|rotate|revoke|list`: the devices' MQTT
users in the gateway's Mosquitto password file.

The library is provision/credentials.py (the file, mosquitto_passwd, the
reload); this module parses the options and prints.  A password is printed
only when it was generated here, once.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from ..provision.credentials import DEVICES_PASSWD, CredentialsError, Reload, change, revoke_user, users
from .common import fail

app = typer.Typer(
    help="Devices' MQTT users on this gateway (Mosquitto password file, reloaded).", no_args_is_help=True
)


def _report_password(device_id: str, password: str, generated: bool) -> None:
    if generated:
        typer.echo(
            f"generated MQTT password for {device_id} (shown once, not stored in clear on the gateway; "
            f'put it in the board\'s config.local.json as "password"):\n{password}'
        )


# -- commands -------------------------------------------------------------------------
PasswdOpt = Annotated[
    Path,
    typer.Option(
        "--passwd-file",
        envvar="IGGY_EDGE_DEVICES_PASSWD",
        help="Mosquitto password file of the device listener.",
    ),
]
PasswordEnvOpt = Annotated[
    str | None,
    typer.Option(
        help="Environment variable holding the password (otherwise one is generated and shown once)."
    ),
]
PidOpt = Annotated[int | None, typer.Option(help="Reload by SIGHUP to this Mosquitto pid.")]
PidFileOpt = Annotated[Path | None, typer.Option(help="Reload by SIGHUP to the pid in this file.")]
NoReloadOpt = Annotated[bool, typer.Option("--no-reload", help="Change the file only; reload yourself.")]


def _how(broker_pid: int | None, pid_file: Path | None, no_reload: bool) -> Reload | None:
    return None if no_reload else Reload(broker_pid=broker_pid, pid_file=pid_file)


def _set(
    device_id: str, passwd_file: Path, password_env: str | None, how: Reload | None, *, rotate: bool
) -> None:
    try:
        done, password = change(passwd_file, device_id, password_env, how, rotate=rotate)
    except CredentialsError as e:
        raise fail(str(e)) from None
    typer.echo(done)
    _report_password(device_id, password, password_env is None)


@app.command()
def add(
    device_id: Annotated[str, typer.Argument(metavar="DEVICE_ID", help="Device id = MQTT user name.")],
    passwd_file: PasswdOpt = DEVICES_PASSWD,
    password_env: PasswordEnvOpt = None,
    broker_pid: PidOpt = None,
    pid_file: PidFileOpt = None,
    no_reload: NoReloadOpt = False,
) -> None:
    """Give a device an MQTT user and password; Mosquitto reloads (no restart)."""
    _set(device_id, passwd_file, password_env, _how(broker_pid, pid_file, no_reload), rotate=False)


@app.command()
def rotate(
    device_id: Annotated[str, typer.Argument(metavar="DEVICE_ID", help="Device id = MQTT user name.")],
    passwd_file: PasswdOpt = DEVICES_PASSWD,
    password_env: PasswordEnvOpt = None,
    broker_pid: PidOpt = None,
    pid_file: PidFileOpt = None,
    no_reload: NoReloadOpt = False,
) -> None:
    """Replace a device's password (the board needs the new one: re-provision it)."""
    _set(device_id, passwd_file, password_env, _how(broker_pid, pid_file, no_reload), rotate=True)


@app.command()
def revoke(
    device_id: Annotated[str, typer.Argument(metavar="DEVICE_ID", help="Device id = MQTT user name.")],
    passwd_file: PasswdOpt = DEVICES_PASSWD,
    broker_pid: PidOpt = None,
    pid_file: PidFileOpt = None,
    no_reload: NoReloadOpt = False,
) -> None:
    """Remove a device's MQTT user; at the reload Mosquitto disconnects it."""
    try:
        done = revoke_user(passwd_file, device_id, _how(broker_pid, pid_file, no_reload))
    except CredentialsError as e:
        raise fail(str(e)) from None
    typer.echo(done)


@app.command("list")
def list_users(
    passwd_file: PasswdOpt = DEVICES_PASSWD,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON document: the file and its users.")
    ] = False,
) -> None:
    """Device users in the password file (names only; passwords are hashed)."""
    try:
        names = users(passwd_file)
    except CredentialsError as e:
        raise fail(str(e)) from None
    if as_json:
        typer.echo(json.dumps({"passwd_file": str(passwd_file), "users": names}))
        return
    if not names:
        typer.echo(f"no device credentials in {passwd_file}: add one with `iggy-edge device credentials add`")
        return
    for name in names:
        typer.echo(name)
