"""`iggy-edge cloud provision-gateway`: the cloud side's one-time set-up of a
gateway on the Iggy server (cloud/provision.py does the work)."""

from __future__ import annotations

import asyncio
import json
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from ..cloud.provision import Provisioned, provision_gateways
from ..device_ids import gateway_id_problem
from ..uplink.protocol import UplinkError
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit

app = typer.Typer(
    help="The cloud side's Iggy set-up for gateways (run with admin Iggy credentials).",
    no_args_is_help=True,
)


def _write_credentials(path: Path, provisioned: Provisioned) -> None:
    """Write the ``[iggy]`` table to `path` (mode 0600), keeping an ``[mqtt]``
    table the file already has."""
    keep = ""
    if path.exists():
        try:
            old = tomllib.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
            raise fail(f"{path}: cannot read it to keep its [mqtt] table: {e}") from None
        mqtt = old.get("mqtt")
        if isinstance(mqtt, dict):
            keep = "[mqtt]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in mqtt.items()) + "\n"
    text = keep + provisioned.credentials_toml()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    path.chmod(0o600)


@app.command("provision-gateway")
def provision(
    gateway: Annotated[
        list[str] | None,
        typer.Option(
            "--gateway", "-g", metavar="ID", help="A gateway's id (its gateway_id); repeat it for several."
        ),
    ] = None,
    gateways_file: Annotated[
        Path | None,
        typer.Option(
            "--gateways-file",
            help="A file of gateway ids, one a line (# comments, blank lines skipped): a fleet at once.",
            dir_okay=False,
            exists=True,
        ),
    ] = None,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            "-o",
            help="Write the gateway's credentials file here (mode 0600; an \\[mqtt] table in it is kept). "
            "Without it the credentials are printed.  One gateway only.",
            dir_okay=False,
        ),
    ] = None,
    out_dir: Annotated[
        Path | None,
        typer.Option(
            "--out-dir",
            help="Several gateways: write each one's credentials file to DIR/<gateway>.toml (mode 0600).",
            file_okay=False,
        ),
    ] = None,
    username: Annotated[
        str | None,
        typer.Option("--username", help="Iggy user name (default gw-<gateway>); one gateway only."),
    ] = None,
    rotate: Annotated[
        bool, typer.Option("--rotate", help="Give an existing user a new password (its sessions end).")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the outcome as JSON, one object a gateway (a line each).")
    ] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Create GATEWAY's return-path topic and a least-privileged Iggy user for it.

    Run it with ADMIN Iggy credentials (\\[iggy] username, IGGY_PASSWORD): it
    creates the shared route topics if missing, the gateway's return-path
    topic (stream edge-rp-<n>, topic return.<gateway>, one partition) and an
    Iggy user allowed only to read that topic (and store its offset) and to
    send to the route topics, plus to read the gateway's topics of the old
    two-topic scheme when they exist, and a personal access token of that
    user (the gateway's credential: a token login is cheap for the server, a
    password login an Argon2 hash). The gateway then runs with that user
    and needs no right to create anything. Naming comes from the config's
    \\[downlink] section: use the fleet's values. Running it again only sets
    the permissions again; --rotate issues a new password.

    For a fleet, give every gateway in one run (-g repeated, or
    --gateways-file) with --out-dir: topics, users and tokens are made in
    three passes, which keeps the server's memory flat where one run per
    gateway leaves about 20 MB on the leader for each (docs/scaling.md).

    Example: IGGY_USERNAME=admin IGGY_PASSWORD=... iggy-edge cloud
    provision-gateway -c cloud.toml -g gw-17 -o gw-17-credentials.toml
    """
    settings = load_or_exit(config)
    ids = _gateway_ids(gateway or [], gateways_file)
    if len(ids) > 1 and (out is not None or username is not None):
        raise fail("--out and --username name one gateway's file and user: use --out-dir for several", 2)
    if out is not None and out_dir is not None:
        raise fail("--out or --out-dir, not both", 2)
    if settings.iggy.kind != "iggy":
        raise fail(f'iggy kind is "{settings.iggy.kind}": provisioning needs a real Iggy server', 2)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    todo: list[str | tuple[str, str]] = [(ids[0], username)] if username else list(ids)
    try:
        done = asyncio.run(provision_gateways(settings, todo, rotate=rotate, progress=_progress(len(ids))))
    except UplinkError as e:
        raise fail(
            f"not provisioned: {e} (no credentials were written; a user made before the error has a"
            " password nobody was given: run it again with --rotate for those gateways)"
        ) from None
    for one in done:
        path = out_dir / f"{one.gateway_id}.toml" if out_dir is not None else out
        if path is not None and one.password is not None:
            _write_credentials(path, one)
        _report(one, path, as_json)


def _gateway_ids(given: list[str], path: Path | None) -> list[str]:
    """The gateways named on the command line and in `path`, in order, each
    once; exits 2 on a bad id or none at all."""
    ids = list(given)
    if path is not None:
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise fail(f"--gateways-file {path}: {e}", 2) from None
        ids += [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not ids:
        raise fail("name the gateway(s): --gateway ID (repeatable) or --gateways-file FILE", 2)
    for gw in ids:
        problem = gateway_id_problem(gw)
        if problem is not None:
            raise fail(f"gateway {gw!r}: {problem}", 2)
    return list(dict.fromkeys(ids))


def _progress(total: int) -> Callable[[str, int, int], None] | None:
    """For a fleet: a line on stderr at every tenth of each pass."""
    if total < 20:
        return None
    step = max(1, total // 10)

    def tell(stage: str, done: int, of: int) -> None:
        if done % step == 0 or done == of:
            typer.echo(f"provisioning: {stage} {done}/{of}", err=True)

    return tell


def _report(done: Provisioned, out: Path | None, as_json: bool) -> None:
    if as_json:
        shown = done.summary()
        if out is None and done.password is not None:
            shown["password"] = done.password
            shown["token"] = done.token
        shown["credentials_file"] = None if out is None or done.password is None else str(out)
        typer.echo(json.dumps(shown))
        return
    what = "created" if done.created_topic else "exists"
    typer.echo(f"return-path topic {done.return_stream}/{done.return_topic} ({what}, one partition)")
    typer.echo(f"user {done.username}: may poll that topic and send to {', '.join(done.send_topics)}")
    if done.legacy_topics:
        typer.echo(f"  and read out the old topics {', '.join(done.legacy_topics)} (migration)")
    if done.password is None:
        typer.echo("the user existed: password unchanged (--rotate for a new one)")
    elif out is not None:
        typer.echo(f"credentials written to {out}: set credentials_file in the gateway's config")
    else:
        typer.echo("gateway credentials file ([iggy] table; keep it secret):")
        typer.echo(done.credentials_toml(), nl=False)
