"""Entry point: `iggy-edge --help`.

Every command's module is imported only when that command runs (or when the
help lists it): `iggy-edge run` is the agent process, and it should not carry
rich, the X.509 library, `doctor`'s probes or the device provisioning for its
whole life.  The commands are still plain typer commands and groups; only the
moment their modules are imported moves (`_LazyCommands`).
tests/test_lean_agent.py checks the import set of `iggy-edge run`.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator, MutableMapping
from typing import Annotated, Any

import typer
from typer.core import TyperGroup

from .. import __version__


def _module(name: str) -> Any:
    return importlib.import_module(f"{__package__}.{name}")


@functools.cache  # the sub-app is module state: add its two commands once per process
def _config_app() -> typer.Typer:
    config_app: typer.Typer = _module("config_cmd").app
    command = _module("command")
    config_app.command("push")(command.config_push)
    config_app.command("republish")(command.config_republish)
    return config_app


def _register_config(app: typer.Typer) -> None:
    app.add_typer(_config_app(), name="config")


def _group(module: str) -> Callable[[typer.Typer], None]:
    """`iggy-edge <module>` is the typer app `app` of cli/<module>.py."""

    def register(app: typer.Typer) -> None:
        app.add_typer(_module(module).app, name=module)

    return register


def _command(module: str) -> Callable[[typer.Typer], None]:
    """`iggy-edge <module>` is the function of that name in cli/<module>.py."""

    def register(app: typer.Typer) -> None:
        app.command(module)(getattr(_module(module), module))

    return register


# name -> how to register it on a typer app; the order is the help's
# (typer lists single commands before groups).
_COMMANDS: dict[str, Callable[[typer.Typer], None]] = {
    "run": _command("run"),
    "demo": _command("demo"),
    "status": _command("status"),
    "doctor": _command("doctor"),
    "config": _register_config,
    "command": _group("command"),
    "buffer": _group("buffer"),
    "service": _group("service"),
    "device": _group("device"),
    "cloud": _group("cloud"),
}


def _load(name: str) -> Any:
    """The click command typer makes of `name`, built exactly as when it was
    registered on the main app (a one-command app of its own)."""
    holder = typer.Typer()
    _COMMANDS[name](holder)
    return typer.main.get_group(holder).commands[name]


class _LazyCommands(MutableMapping[str, Any]):
    """The group's name -> command table; a command is built (its module
    imported) the first time it is looked up."""

    def __init__(self, eager: MutableMapping[str, Any]) -> None:
        self._built: dict[str, Any] = dict(eager)

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            if name not in _COMMANDS:
                raise KeyError(name)
            self._built[name] = _load(name)
        return self._built[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._built[name] = command

    def __delitem__(self, name: str) -> None:
        del self._built[name]

    def __iter__(self) -> Iterator[str]:
        yield from _COMMANDS
        yield from (n for n in self._built if n not in _COMMANDS)

    def __len__(self) -> int:
        return len(_COMMANDS) + sum(1 for n in self._built if n not in _COMMANDS)


class _LazyGroup(TyperGroup):
    def __init__(self, **attrs: Any) -> None:
        super().__init__(**attrs)
        self.commands = _LazyCommands(self.commands)


app = typer.Typer(
    name="iggy-edge",
    help="Edge bridge: MQTT devices -> durable SQLite store-and-forward -> Apache Iggy.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    cls=_LazyGroup,
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
