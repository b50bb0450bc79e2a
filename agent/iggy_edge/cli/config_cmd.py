"""`iggy-edge config ...`: validate configuration."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from ..config import Settings
from ..reload import plan
from .common import load_or_exit

app = typer.Typer(help="Validate and inspect configuration.", no_args_is_help=True)


@app.command("check")
def check(
    file: Annotated[Path, typer.Argument(help="Configuration file to validate.")],
    show: Annotated[
        bool, typer.Option("--show", help="Print the effective settings (secrets masked).")
    ] = False,
    against: Annotated[
        Path | None,
        typer.Option(
            "--against",
            metavar="RUNNING",
            help="The file the agent runs on: say which of FILE's changes a reload (systemctl reload"
            " iggy-edge) takes and which need a restart.",
        ),
    ] = None,
) -> None:
    """Validate FILE; report every problem with its key and exit non-zero when there is one."""
    settings = load_or_exit(file)
    if against is not None:
        _reload_plan(load_or_exit(against), settings, file, against)
    if show:
        typer.echo(json.dumps(settings.model_dump(mode="json"), indent=2))
    routes = ", ".join(f"{r.filter} -> {r.stream}/{r.topic}" for r in settings.routes)
    typer.secho(f"{file}: ok", fg=typer.colors.GREEN)
    typer.echo(f"  gateway {settings.gateway_id}, broker {settings.mqtt.host}:{settings.mqtt.port}")
    where = f" {settings.iggy.where}" if settings.iggy.kind == "iggy" else ""
    typer.echo(f"  uplink {settings.iggy.kind}{where}")
    b = settings.buffer
    typer.echo(f"  buffer {settings.buffer_path} ({b.overflow}, synchronous={b.synchronous})")
    typer.echo(f"  routes: {routes}")


@app.command("example")
def example() -> None:
    """Print the annotated example configuration (every key, its default and meaning).

    Start a new gateway with:  iggy-edge config example > config.toml
    """
    text = resources.files("iggy_edge").joinpath("examples/config.toml").read_text()
    typer.echo(text, nl=False)


def _reload_plan(running: Settings, new: Settings, file: Path, against: Path) -> None:
    result = plan(running, new)
    if not result.changed:
        typer.echo(f"{file}: no changes against {against}")
    for title, changes in (("a reload takes", result.live), ("needs a restart", result.restart)):
        if changes:
            typer.echo(f"{title} ({len(changes)}):")
            for c in changes:
                typer.echo(f"  {c}")
