"""Helpers shared by the CLI commands: loading config with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from ..config import ConfigError, Settings, load_config

DEFAULT_CONFIG = Path("/etc/iggy-edge/config.toml")

ConfigOption = Annotated[
    Path,
    typer.Option(
        "--config",
        "-c",
        help="Agent configuration (TOML). Secrets come from IGGY_PASSWORD / IGGY_EDGE_MQTT_PASSWORD "
        "or a credentials_file, never from the command line.",
        envvar="IGGY_EDGE_CONFIG",
    ),
]

LimitOption = Annotated[int, typer.Option("--limit", "-n", min=1, help="How many records.")]
YesOption = Annotated[bool, typer.Option("--yes", "-y", help="Do not ask for confirmation.")]


def fail(message: str, code: int = 1) -> typer.Exit:
    """Print `error: message` in red on stderr; return the Exit to raise."""
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    return typer.Exit(code)


def load_or_exit(path: Path) -> Settings:
    """Load the config; on any problem print every key at fault and exit 2."""
    try:
        return load_config(path)
    except ConfigError as e:
        typer.secho(f"error: {e.source}: configuration is not valid:", fg=typer.colors.RED, err=True)
        for key, msg in e.problems:
            typer.echo(f"  {key}: {msg}", err=True)
        raise typer.Exit(2) from None
