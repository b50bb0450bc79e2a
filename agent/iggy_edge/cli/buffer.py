"""`iggy-edge buffer ...`: look into the outbox of a (running or stopped) agent."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ..store import StoreError, read_stats
from .common import DEFAULT_CONFIG, ConfigOption, load_or_exit

app = typer.Typer(help="Inspect the store-and-forward buffer.", no_args_is_help=True)


@app.command("stats")
def stats(
    config: ConfigOption = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Backlog, oldest record age, dead letters and drops by reason."""
    settings = load_or_exit(config)
    try:
        st = read_stats(settings.buffer_path)
    except StoreError as e:
        typer.secho(f"error: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(1) from None
    data = st.as_dict()
    if as_json:
        typer.echo(json.dumps(data))
        return
    age = data["oldest_age_s"]
    typer.echo(f"buffer        {settings.buffer_path} ({st.file_bytes / 1e6:.1f} MB on disk)")
    typer.echo(
        f"backlog       {st.records} records, {st.bytes / 1e6:.2f} MB accounted "
        f"(limits {settings.buffer.max_records} records, {settings.buffer.max_bytes / 1e6:.0f} MB)"
    )
    typer.echo(f"oldest record {'-' if age is None else f'{age:.1f}s old'}")
    typer.echo(
        f"dead letters  {st.dead_letters}"
        + (
            " (" + ", ".join(f"{k}: {v}" for k, v in sorted(st.dead_letters_by_reason.items())) + ")"
            if st.dead_letters
            else ""
        )
    )
    drops = ", ".join(f"{k}: {v}" for k, v in sorted(st.drops_by_reason.items()) if v)
    typer.echo(f"dropped       {drops or 'none'}")
