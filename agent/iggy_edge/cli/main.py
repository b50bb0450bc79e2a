"""Entry point: `iggy-edge --help`."""

from __future__ import annotations

from typing import Annotated

import typer

from .. import __version__
from . import buffer, command, config_cmd, demo, device, doctor, run, service, status

app = typer.Typer(
    name="iggy-edge",
    help="Edge bridge: MQTT devices -> durable SQLite store-and-forward -> Apache Iggy.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"iggy-edge {__version__}")
        raise typer.Exit


@app.callback()
def main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """iggy-edge: run the agent, check its config, look into its buffer."""


app.command("run")(run.run)
app.command("demo")(demo.demo)
config_cmd.app.command("push")(command.config_push)
config_cmd.app.command("republish")(command.config_republish)
app.add_typer(config_cmd.app, name="config")
app.add_typer(command.app, name="command")
app.add_typer(buffer.app, name="buffer")
app.command("status")(status.status)
app.command("doctor")(doctor.doctor)
app.add_typer(service.app, name="service")
app.add_typer(device.app, name="device")
