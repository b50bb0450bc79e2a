"""`iggy-edge buffer dead-letters [replay]`: the messages that could not be
routed, listed with their reason, or routed again after fixing a route."""

from __future__ import annotations

import base64
import datetime
import json
from pathlib import Path
from typing import Annotated

import typer

from ..buffer_admin import count_rows, exclusive, read_dead_letters, replay_dead_letters
from ..routing import Router
from ..store import StoreError
from .common import DEFAULT_CONFIG, ConfigOption, LimitOption, YesOption, fail, load_or_exit
from .progress import progress

dead_app = typer.Typer(
    help="Messages that could not be routed (list, or replay after fixing a route).",
    invoke_without_command=True,
)


@dead_app.callback()
def dead_letters_list(
    ctx: typer.Context,
    config: ConfigOption = DEFAULT_CONFIG,
    limit: LimitOption = 20,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines.")] = False,
) -> None:
    """List the newest dead letters with their reason (default action)."""
    if ctx.invoked_subcommand is not None:
        return
    settings = load_or_exit(config)
    try:
        letters = read_dead_letters(settings.buffer_path, limit)
    except StoreError as e:
        raise fail(str(e)) from None
    if as_json:
        for d in letters:
            typer.echo(
                json.dumps(
                    {
                        "id": d.id,
                        "received_us": d.received_us,
                        "mqtt_topic": d.mqtt_topic.decode("utf-8", "replace"),
                        "qos": d.qos,
                        "retain": d.retain,
                        "reason": d.reason,
                        "detail": d.detail,
                        "payload_size": d.payload_size,
                        "payload_b64": base64.b64encode(d.payload).decode("ascii"),
                    }
                )
            )
        return
    if not letters:
        typer.echo("no dead letters")
        return
    for d in letters:
        when = datetime.datetime.fromtimestamp(d.received_us / 1e6).isoformat(timespec="seconds")
        typer.echo(
            f"#{d.id:<6} {when}  {d.reason:<14} {d.mqtt_topic.decode('utf-8', 'replace')!r}  "
            f"{d.payload_size}B  {d.detail}"
        )


def _group_config(ctx: typer.Context, config: Path) -> Path:
    """`dead-letters -c X replay`: the group's -c applies unless replay has its own."""
    source = ctx.get_parameter_source("config")  # typer vendors click: compare by name
    if source is not None and source.name == "DEFAULT" and ctx.parent is not None:
        outer = ctx.parent.params.get("config")
        if isinstance(outer, Path):
            return outer
    return config


@dead_app.command("replay")
def dead_letters_replay(
    ctx: typer.Context, config: ConfigOption = DEFAULT_CONFIG, yes: YesOption = False
) -> None:
    """Route the dead letters again with the current [\\[routes]]; those that route go to the outbox.

    They keep their original receive time and order; the rest stay dead letters.

    Fix the route in the config first; needs the agent stopped (like purge).
    """
    config = _group_config(ctx, config)
    settings = load_or_exit(config)
    path = settings.buffer_path
    router = Router(settings.routes, settings.buffer.max_payload_bytes)
    try:
        total = count_rows(path, "dead_letters")
        if total == 0:
            typer.echo("no dead letters")
            return
        with exclusive(path) as conn:
            if not yes and not typer.confirm(
                f"Route {total} dead letters again with the routes in {config}?"
            ):
                raise fail("nothing replayed", 1)
            with progress() as bar:
                task = bar.add_task("replaying", total=total)
                result = replay_dead_letters(
                    conn, router, settings.buffer, progress=lambda n: bar.advance(task, n)
                )
    except StoreError as e:
        raise fail(str(e)) from None
    typer.echo(f"replayed {result.replayed} dead letters into the outbox")
    for reason, n in sorted(result.still_dead.items()):
        advice = {
            "unroutable": "no [[routes]] filter matches their topic",
            "oversize": "larger than buffer.max_payload_bytes",
            "truncated": "payload was cut when dead-lettered; cannot be replayed",
            "invalid_topic": "topic is not valid UTF-8 / has wildcards",
        }.get(reason, "")
        typer.echo(f"  still dead: {n} {reason}" + (f" ({advice})" if advice else ""))
    if result.no_room:
        typer.secho(
            f"  {result.no_room} not replayed: the outbox is at its bounds (buffer.max_records/max_bytes)",
            fg=typer.colors.YELLOW,
        )
