"""`iggy-edge device update`: over-the-air updates of the boards' app
(docs/ota.md).

The command builds the artifact here (ota/build.py: mpy-cross, sha256s),
keeps it in the gateway's ``ota.db`` and queues one update per board; the
running agent does the rest (it picks the request up within a second) and
this command follows the progress until every board finished (or
``--no-wait``).  `status` shows every board's update; `cancel` aborts.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.error
from pathlib import Path
from typing import Annotated, Any

import typer

from ..device_ids import device_id_problem
from ..downlink.commands import printable
from ..ota import requests as req
from ..ota.artifact import MAX_ARTIFACT_BYTES, ArtifactError
from ..provision import ProvisionError, sources
from ..scrape import NotOurs
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit
from .device_view import fetch_devices

app = typer.Typer(no_args_is_help=False, invoke_without_command=True)

POLL_S = 0.5
FAILED = ("rolled_back", "failed", "cancelled")

DeviceOption = Annotated[
    list[str] | None, typer.Option("--device", "-d", help="A board to update (repeat for several).")
]


def _kb(n: int | None) -> str:
    return "-" if n is None else f"{n / 1024:.1f} kB"


def _progress(r: dict[str, Any]) -> str:
    total = r.get("total") or 0
    done = r.get("done_bytes") or 0
    return f"{100 * done // total}%" if total else "-"


def _line(r: dict[str, Any]) -> str:
    reason = f"  {printable(r['reason'])}" if r.get("reason") else ""
    board = printable(r.get("board_version") or "-")
    return (
        f"{printable(r['device']):<24} {r['state']:<12} {_progress(r):>5} {_kb(r.get('total')):>9} "
        f"{printable(r.get('version') or '-'):<26} {board:<20}{reason}"
    )


HEADER = f"{'DEVICE':<24} {'STATE':<12} {'DONE':>5} {'SIZE':>9} {'UPDATE':<26} {'BOARD RUNS':<20} REASON"


def _all_devices(settings: Any) -> list[str]:
    try:
        doc = fetch_devices(settings)
    except NotOurs as e:
        raise fail(f"the agent's endpoint is not this gateway's agent: {e}", 4) from None
    except (OSError, urllib.error.URLError) as e:
        raise fail(f"--all needs the running agent's device list ({e}): is it running?", 3) from None
    return sorted(r["device"] for r in doc["devices"])


@app.callback()
def update(
    ctx: typer.Context,
    device: DeviceOption = None,
    all_devices: Annotated[
        bool, typer.Option("--all", help="Every board the running agent has heard from (`device list`).")
    ] = False,
    example: Annotated[
        str | None, typer.Option(help="Firmware example folder to install (env_sensor, actuator, ...).")
    ] = None,
    app_dir: Annotated[
        Path | None, typer.Option("--app", help="Your own app: a directory with main.py and its modules.")
    ] = None,
    with_library: Annotated[
        bool, typer.Option("--with-library", help="Also send the iggy_device library (to the slot's lib/).")
    ] = False,
    mpy: Annotated[
        bool,
        typer.Option(
            "--mpy/--no-mpy",
            help="Compile .py (not main.py) to .mpy with mpy-cross; a board refuses .mpy it cannot load.",
        ),
    ] = True,
    app_version: Annotated[
        str | None, typer.Option(help="The version the board reports (default: NAME-<8 hex of the files>).")
    ] = None,
    canary: Annotated[
        int | None,
        typer.Option(
            min=0,
            help="Boards updated first; the rest once they all finished (default 1 for several; 0: all).",
        ),
    ] = None,
    max_failures: Annotated[
        int,
        typer.Option(
            min=0, help="Failed boards a rollout tolerates; past it, the boards not started are cancelled."
        ),
    ] = 0,
    wait: Annotated[
        bool, typer.Option("--wait/--no-wait", help="Follow the progress until every board finished.")
    ] = True,
    timeout: Annotated[
        float, typer.Option(min=1, help="Stop following after this many seconds (the update goes on).")
    ] = 3600,
    source_root: Annotated[
        Path | None, typer.Option(help="Where device/ and firmware_examples/ are (default: found).")
    ] = None,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Update the boards' app over the air, through their MQTT session, and follow the progress.

    Examples: `iggy-edge device update -d dev-1 --example env_sensor`;
    `iggy-edge device update --all --app ./myapp --with-library --canary 2`.
    The agent must be running: it sends the update over each board's MQTT
    session, resuming after reconnects and restarts.
    """
    if ctx.invoked_subcommand is not None:
        return
    if not device and not all_devices:
        typer.echo(ctx.get_help())
        raise fail("name the boards: --device D (repeatable) or --all", 2)
    settings = load_or_exit(config)
    devices = _all_devices(settings) if all_devices else list(dict.fromkeys(device or []))
    for d in devices:
        if device_id_problem(d) is not None:
            raise fail(f"--device {printable(d)!r}: {device_id_problem(d)}", 2)
    if not devices:
        raise fail("the agent has heard from no board yet", 1)
    from ..ota.build import build  # noqa: PLC0415 - provisioning tools only for this command

    typer.echo(f"building the update from {example or app_dir} ...", nl=False)
    try:
        root = sources.source_root(source_root)
        art = build(
            root, example=example, app_dir=app_dir, with_library=with_library, mpy=mpy, version=app_version
        )
    except (ArtifactError, ProvisionError) as e:
        typer.echo(" failed")
        raise fail(str(e), 2) from None
    typer.echo(
        f" {len(art.files)} files, {art.total} bytes (bound {MAX_ARTIFACT_BYTES}), version {art.version}, "
        f"sha256 {art.id[:16]}..."
    )
    n = 1 if canary is None and len(devices) > 1 else (canary or 0)
    waves = [devices[:n], devices[n:]] if 0 < n < len(devices) else [devices]
    path = req.db_path(settings.state_dir)
    try:
        conn = req.connect(path)
        try:
            req.put_artifact(conn, art)
            done = req.request(conn, art.id, waves, max_failures=max_failures)
        finally:
            conn.close()
    except req.BoardBusy as e:
        raise fail(str(e), 1) from None
    except (sqlite3.Error, OSError) as e:
        raise fail(f"cannot write {path}: {e} (run it as the agent's user, or with sudo)", 1) from None
    plan = (
        f"canary {', '.join(waves[0])}, then {len(waves[1])} more" if len(waves) > 1 else ", ".join(devices)
    )
    typer.echo(f"queued rollout {done.rollout}: {plan} (at most {max_failures} failure(s))")
    if not wait:
        typer.echo("follow it with `iggy-edge device update status`")
        return
    raise typer.Exit(_follow(path, done, timeout))


def _follow(path: Path, done: req.Requested, timeout: float) -> int:
    """Print each board's progress until all finished; the exit code."""
    shown: dict[str, tuple[str, str]] = {}
    deadline = time.monotonic() + timeout
    ids = set(done.updates.values())
    warned = False
    while True:
        try:
            conn = req.connect_ro(path)
            try:
                found = [r for r in req.rows(conn, limit=req.MAX_DEVICES_PER_REQUEST * 2) if r["id"] in ids]
            finally:
                conn.close()
        except sqlite3.Error:
            found = []
        for r in sorted(found, key=lambda x: x["device"]):
            key = (r["state"], _progress(r)[:-2] if r["state"] == "downloading" else "")
            if shown.get(r["device"]) != key:
                shown[r["device"]] = key
                typer.echo(_line(r))
        if found and all(r["state"] in req.TERMINAL for r in found):
            bad = [r for r in found if r["state"] in FAILED]
            typer.echo(
                f"{len(found) - len(bad)} of {len(found)} board(s) updated"
                + (f", {len(bad)} not" if bad else "")
            )
            return 1 if bad else 0
        if (
            not warned
            and found
            and all(r["state"] == "queued" for r in found)
            and time.monotonic() > deadline - timeout + 5
        ):
            typer.echo("still queued after 5 s: is the agent running (`iggy-edge status`)?")
            warned = True
        if time.monotonic() > deadline:
            typer.echo("stopped following (the update goes on): see `iggy-edge device update status`")
            return 3
        time.sleep(POLL_S)


@app.command()
def status(
    device: DeviceOption = None,
    history: Annotated[bool, typer.Option("--history", help="Finished updates too (newest first).")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Every board's update: state, progress, versions and why it ended (newest per board)."""
    settings = load_or_exit(config)
    try:
        conn = req.connect_ro(req.db_path(settings.state_dir))
        try:
            found = req.rows(conn, limit=5000)
        finally:
            conn.close()
    except FileNotFoundError as e:
        typer.echo(str(e))
        return
    if device:
        found = [r for r in found if r["device"] in device]
    if not history:
        newest: dict[str, dict[str, Any]] = {}
        for r in found:
            newest.setdefault(r["device"], r)
        found = sorted(newest.values(), key=lambda r: r["device"])
    if as_json:
        typer.echo(json.dumps({"updates": found}, indent=2))
        return
    typer.echo(HEADER)
    for r in found:
        typer.echo(_line(r))


@app.command()
def cancel(
    device: DeviceOption = None,
    all_devices: Annotated[bool, typer.Option("--all", help="Every update in progress.")] = False,
    config: ConfigOption = DEFAULT_CONFIG,
) -> None:
    """Abort updates in progress (the agent sends the board an abort; too late once a board switched)."""
    if not device and not all_devices:
        raise fail("name the boards: --device D (repeatable) or --all", 2)
    settings = load_or_exit(config)
    conn = req.connect(req.db_path(settings.state_dir))
    try:
        n = req.cancel(conn, None if all_devices else list(device or []))
    finally:
        conn.close()
    typer.echo(f"{n} update(s) to cancel; the agent aborts them within a second")
