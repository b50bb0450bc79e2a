"""`iggy-edge service install|uninstall`: the systemd service for pip installs.

The Debian package ships packaging/systemd/iggy-edge.service; this writes the
same unit (service_unit.py: `UNIT` is that file, kept identical by a test)
with ExecStart pointing at *this* installation's `iggy-edge`, creates the
service user and directories, and enables the unit.  `--dry-run` prints every step
instead of doing it; `--root DIR` writes the files under DIR (an image being
built, or a test) and skips what needs a live system (user, systemctl).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer

from ..service_unit import SERVICE_USER, STATE_DIR, UNIT_NAME, Step, install_steps, uninstall_steps, unit_path
from .common import DEFAULT_CONFIG, fail

app = typer.Typer(help="Install or remove the systemd service (for pip installs).", no_args_is_help=True)


def current_executable() -> str:
    """This installation's `iggy-edge` script (next to the running Python)."""
    beside = Path(sys.executable).parent / "iggy-edge"
    if beside.exists():
        return str(beside.absolute())
    found = shutil.which("iggy-edge")
    if found is None:
        raise typer.BadParameter("cannot find the iggy-edge executable; pass --executable")
    return str(Path(found).absolute())


def _preflight(dry_run: bool, root: Path | None) -> None:
    if dry_run or root is not None:
        return
    if os.geteuid() != 0:
        raise fail(
            "installing a system service needs root: run it with sudo (--dry-run shows what it would do)"
        )
    if not Path("/run/systemd/system").is_dir():
        raise fail(
            "systemd is not running on this machine (no /run/systemd/system): nothing to install "
            "into. Run the agent another way (iggy-edge run -c CONFIG) or use --root DIR for an image."
        )


def _execute(steps: list[Step], dry_run: bool) -> None:
    for step in steps:
        if dry_run:
            typer.echo(f"would {step.describe}")
            continue
        typer.echo(step.describe)
        try:
            step.run()
        except (OSError, RuntimeError) as e:
            raise fail(str(e)) from None


@app.command("install")
def install(
    config: Annotated[
        Path, typer.Option("--config", "-c", help="Config the service runs with.")
    ] = DEFAULT_CONFIG,
    executable: Annotated[
        str | None, typer.Option(help="iggy-edge executable (default: this installation's).")
    ] = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Print the steps and the unit; change nothing.")
    ] = False,
    enable: Annotated[bool, typer.Option(help="Enable at boot.")] = True,
    start: Annotated[bool, typer.Option(help="Start (or restart) it now.")] = False,
    root: Annotated[
        Path | None,
        typer.Option(help="Write files under this directory; no user, no systemctl (images, tests)."),
    ] = None,
) -> None:
    """Install the systemd service: unit, service user and directories; enable it.

    Writes the unit for this installation, creates the service user and its
    directories, reloads systemd and enables the service.
    """
    _preflight(dry_run, root)
    exe = executable or current_executable()
    config = config.absolute()
    steps, path, unit = install_steps(exe, config, root, enable=enable, start=start)
    live = root is None
    _execute(steps, dry_run)
    if dry_run:
        typer.echo(f"\n--- {path} ---\n{unit}")
        return
    typer.secho(f"installed {UNIT_NAME}", fg=typer.colors.GREEN)
    if live and not start:
        typer.echo(
            f"next: edit {config}, run 'iggy-edge doctor -c {config}', then 'systemctl start iggy-edge'"
        )


@app.command("uninstall")
def uninstall(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Print the steps; change nothing.")] = False,
    root: Annotated[Path | None, typer.Option(help="Remove from this directory tree; no systemctl.")] = None,
) -> None:
    """Stop and disable the service and remove its unit.

    Keeps the config, the secrets, the buffer (/var/lib/iggy-edge) and the user.
    """
    _preflight(dry_run, root)
    path = unit_path(root)
    if not path.exists() and not dry_run:
        typer.secho(
            f"error: {path} does not exist (installed by the Debian package? use apt remove)", err=True
        )
        raise typer.Exit(1)
    _execute(uninstall_steps(root), dry_run)
    if not dry_run:
        typer.echo(
            f"removed {UNIT_NAME}; kept /etc/iggy-edge, {STATE_DIR} (the buffer) and the user {SERVICE_USER}"
        )
