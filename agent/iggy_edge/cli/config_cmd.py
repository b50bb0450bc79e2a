"""`iggy-edge config ...`: validate configuration."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Annotated, Any, Final

import typer

from ..config import ConfigError, Settings, load_config, passwords_in_file
from ..reload import plan
from .common import load_or_exit

KEY_IN_MAIN_FILE_ADVICE: Final = (
    "a password in the main config file; put it in /etc/iggy-edge/env (IGGY_EDGE_MQTT_PASSWORD, "
    "IGGY_PASSWORD) or a credentials_file (mode 0600) and remove it here"
)

app = typer.Typer(help="Validate and inspect configuration.", no_args_is_help=True)


@app.command("check")
def check(
    file: Annotated[Path, typer.Argument(metavar="FILE", help="Configuration file to validate.")],
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
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON document: ok, problems, warnings (and the reload plan).")
    ] = False,
) -> None:
    """Validate FILE; report every problem with its key and exit non-zero when there is one."""
    if as_json:
        _check_json(file, against, show)
        return
    settings = load_or_exit(file)
    if against is not None:
        _reload_plan(load_or_exit(against), settings, file, against)
    if show:
        typer.echo(json.dumps(settings.model_dump(mode="json"), indent=2))
    routes = ", ".join(f"{r.filter} -> {r.stream}/{r.topic}" for r in settings.routes)
    for key in passwords_in_file(file):
        typer.secho(f"warning: {key}: {KEY_IN_MAIN_FILE_ADVICE}", fg=typer.colors.YELLOW, err=True)
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


def _check_json(file: Path, against: Path | None, show: bool) -> None:
    """`config check --json`: one document, exit 2 when FILE (or RUNNING) is not valid."""
    doc: dict[str, Any] = {"file": str(file), "ok": False, "problems": [], "warnings": []}
    try:
        settings = load_config(file)
        running = load_config(against) if against is not None else None
    except ConfigError as e:
        doc["problems"] = [{"source": e.source, "key": k, "message": m} for k, m in e.problems]
        typer.echo(json.dumps(doc))
        raise typer.Exit(2) from None
    doc["ok"] = True
    doc["warnings"] = [{"key": k, "message": KEY_IN_MAIN_FILE_ADVICE} for k in passwords_in_file(file)]
    doc["gateway_id"] = settings.gateway_id
    doc["broker"] = f"{settings.mqtt.host}:{settings.mqtt.port}"
    doc["uplink"] = settings.iggy.where if settings.iggy.kind == "iggy" else settings.iggy.kind
    doc["buffer"] = str(settings.buffer_path)
    doc["routes"] = [{"filter": r.filter, "stream": r.stream, "topic": r.topic} for r in settings.routes]
    if running is not None:
        result = plan(running, settings)
        doc["reload"] = {"live": [str(c) for c in result.live], "restart": [str(c) for c in result.restart]}
    if show:
        doc["settings"] = settings.model_dump(mode="json")
    typer.echo(json.dumps(doc))
