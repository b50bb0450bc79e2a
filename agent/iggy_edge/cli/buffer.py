"""`iggy-edge buffer ...`: look into the outbox of a (running or stopped) agent."""

from __future__ import annotations

import datetime
import json
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from ..buffer_admin import (
    ack_salvage,
    count_rows,
    exclusive,
    iter_records,
    read_stats,
)
from ..buffer_admin import purge as store_purge
from ..store import StoreError
from .common import DEFAULT_CONFIG, ConfigOption, LimitOption, YesOption, fail, load_or_exit
from .dead_letters import dead_app
from .progress import progress

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
        raise fail(str(e)) from None
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
        f"dead letters  {st.dead_letters}, {st.dead_letter_bytes / 1e6:.2f} MB accounted "
        f"(limits {settings.buffer.max_dead_letters}, {settings.buffer.max_dead_letter_bytes / 1e6:.0f} MB)"
        + (
            " (" + ", ".join(f"{k}: {v}" for k, v in sorted(st.dead_letters_by_reason.items())) + ")"
            if st.dead_letters
            else ""
        )
    )
    drops = ", ".join(f"{k}: {v}" for k, v in sorted(st.drops_by_reason.items()) if v)
    typer.echo(f"dropped       {drops or 'none'}")
    for ev in st.recovery:
        state = "acknowledged" if ev.acknowledged else "NOT acknowledged (iggy-edge buffer ack-salvage)"
        when = datetime.datetime.fromtimestamp(ev.at).isoformat(timespec="seconds")
        if ev.kind == "salvaged":
            typer.secho(
                f"salvaged      {when}: damaged buffer moved aside to {ev.aside};"
                f" {ev.salvaged} records salvaged,"
                f" {ev.unreadable} unreadable, {ev.dead_letters} to dead letters ({ev.detail}); {state}",
                fg=None if ev.acknowledged else typer.colors.YELLOW,
            )
        else:
            typer.secho(
                f"damaged WAL   {when}: copied to {ev.aside}; up to {ev.frames_lost} frames of recent commits"
                f" may be missing ({ev.detail}); {state}",
                fg=None if ev.acknowledged else typer.colors.YELLOW,
            )


@app.command("ack-salvage")
def ack_salvage_cmd(config: ConfigOption = DEFAULT_CONFIG) -> None:
    """Acknowledge a salvaged buffer (or a damaged WAL copied aside): health stops showing it.

    Look at `buffer stats` first; the moved file stays where it is for inspection.
    """
    settings = load_or_exit(config)
    try:
        n = ack_salvage(settings.buffer_path)
    except StoreError as e:
        raise fail(str(e)) from None
    typer.echo(f"acknowledged {n} recovery event(s)" if n else "nothing to acknowledge")


# -- peek, export, purge (ops; dead letters: dead_letters.py) -----------------------------------


def _short(payload: bytes, width: int = 60) -> str:
    try:
        text = payload.decode("utf-8")
    except UnicodeDecodeError:
        text = "0x" + payload[: width // 2].hex()
    text = text.replace("\n", "\\n")
    return text if len(text) <= width else text[: width - 3] + "..."


@app.command("peek")
def peek(
    config: ConfigOption = DEFAULT_CONFIG,
    limit: LimitOption = 10,
    as_json: Annotated[bool, typer.Option("--json", help="JSON lines, as export writes them.")] = False,
) -> None:
    """Show the oldest records in the outbox (the next ones to be forwarded)."""
    settings = load_or_exit(config)
    try:
        records = list(iter_records(settings.buffer_path, limit=limit))
    except StoreError as e:
        raise fail(str(e)) from None
    if as_json:
        for r in records:
            typer.echo(json.dumps(r.as_json()))
        return
    if not records:
        typer.echo("outbox is empty")
        return
    now = time.time()
    for r in records:
        age = max(0.0, now - r.received_us / 1e6)
        typer.echo(
            f"#{r.seq:<8} {age:8.1f}s ago  {r.stream}/{r.topic} key={r.key}  "
            f"{r.mqtt_topic} qos{r.qos}  {len(r.payload)}B  {_short(r.payload)}"
        )


@app.command("export")
def export(
    config: ConfigOption = DEFAULT_CONFIG,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="File to write (default: standard output).")
    ] = None,
    limit: Annotated[int | None, typer.Option("--limit", "-n", min=1, help="At most this many.")] = None,
) -> None:
    """Write the outbox as JSON lines (oldest first), e.g. to rescue data before a purge.

    Each line has seq, stream, topic, key, mqtt_topic, qos, retain, received_us,
    device_seq and the payload as text (`payload`) or base64 (`payload_b64`).
    Safe while the agent runs (a consistent read per page; records forwarded
    meanwhile may or may not appear).
    """
    settings = load_or_exit(config)
    path = settings.buffer_path
    try:
        total = count_rows(path, "outbox")
        if limit is not None:
            total = min(total, limit)
        out = output.open("w", encoding="utf-8") if output is not None else sys.stdout
        written = 0
        try:
            with progress() as bar:
                task = bar.add_task("exporting", total=total)
                for r in iter_records(path, limit=limit):
                    out.write(json.dumps(r.as_json()) + "\n")
                    written += 1
                    if written % 500 == 0:
                        bar.update(task, completed=min(written, total))
                bar.update(task, completed=written, total=max(total, written))
        finally:
            if output is not None:
                out.close()
    except StoreError as e:
        raise fail(str(e)) from None
    except OSError as e:
        raise fail(f"cannot write {output}: {e}") from None
    typer.echo(f"exported {written} records" + (f" to {output}" if output else ""), err=True)


@app.command("purge")
def purge_cmd(
    config: ConfigOption = DEFAULT_CONFIG,
    yes: YesOption = False,
    dead_letters: Annotated[
        bool, typer.Option("--dead-letters", help="Delete the dead letters too.")
    ] = False,
) -> None:
    """Delete every record waiting in the outbox (they will never reach Iggy).

    Needs the agent stopped (systemctl stop iggy-edge): the command takes the
    buffer exclusively and refuses while another process has it open; an agent
    started meanwhile fails to open the buffer until the purge is done.
    Consider `buffer export` first.  Purged records are counted in `buffer stats`
    under dropped: purged.
    """
    settings = load_or_exit(config)
    path = settings.buffer_path
    try:
        records = count_rows(path, "outbox")
        dead = count_rows(path, "dead_letters") if dead_letters else 0
        with exclusive(path) as conn:
            what = f"{records} records" + (f" and {dead} dead letters" if dead_letters else "")
            if not yes and not typer.confirm(f"Delete {what} from {path}? They cannot be recovered."):
                raise fail("nothing deleted", 1)
            with progress() as bar:
                task = bar.add_task("purging", total=records)
                deleted, dead_deleted = store_purge(
                    conn, dead_letters=dead_letters, progress=lambda n: bar.advance(task, n)
                )
    except StoreError as e:
        raise fail(str(e)) from None
    typer.echo(f"purged {deleted} records" + (f" and {dead_deleted} dead letters" if dead_letters else ""))


app.add_typer(dead_app, name="dead-letters")  # listed after the commands, as before
