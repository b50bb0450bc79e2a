"""`iggy-edge status`: what the running agent is doing, from its /metrics and /health.

The figures are the ones Prometheus scrapes (one source of truth).  When no
agent answers, the buffer is read from SQLite instead, so an operator still
sees the backlog of a stopped agent.

The endpoint must be this gateway's: /health names the gateway, the buffer
path and the buffer's instance id (random per database file), and status
compares them with its config and the database, so another process holding
the port (or another gateway's agent) is reported as not ours, never as a
healthy agent.

With stdout not a terminal (a pipe, a file, cron) there is no live view:
status prints one snapshot, as with --once.  In the live view `q` (when
stdin is a terminal) or Ctrl-C ends it.

The dead letters line shows what the buffer file holds ("stored") beside the
counters, which count only since the agent started.

Exit status (for scripts): 0 running and healthy, 1 running but unhealthy,
3 not running (as `systemctl status`), 4 something else answers at the
endpoint (not this gateway's agent).
"""

from __future__ import annotations

import json
import os
import select
import sys
import termios
import time
import tty
from types import TracebackType
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table

from ..buffer_admin import read_stats
from ..httpd import local_url
from ..scrape import NotOurs, figures, scrape, stored
from ..store import StoreError
from .common import DEFAULT_CONFIG, ConfigOption, load_or_exit

EXIT_UNHEALTHY = 1
EXIT_NOT_RUNNING = 3
EXIT_NOT_OURS = 4


def _nonzero(d: dict[str, int]) -> str:
    shown = ", ".join(f"{k} {v}" for k, v in sorted(d.items()) if v)
    return shown or "none"


def render(f: dict[str, Any], source: str) -> Table:
    h = f["health"]
    title = (
        f"iggy-edge {h.get('gateway', '')} -- "
        + ("[green]healthy[/]" if f["healthy"] else "[red]UNHEALTHY[/]")
        + f"  (up {h.get('uptime_s', 0):.0f}s, {source})"
    )
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column(style="bold")
    t.add_column()
    ing, st, fw, dl = f["ingest"], f["store"], f["forward"], f["downlink"]
    rates = f.get("rates", {})

    def rate(key: str) -> str:
        return f"  ({rates[key]:.1f}/s)" if key in rates else ""

    t.add_row(
        "ingest",
        f"{h.get('ingest', '?')}, {ing['messages']} messages{rate('ingest_per_s')}, "
        f"{ing['reconnects']} reconnects"
        + (f", [red]{ing['sessions_lost']} MQTT sessions lost[/]" if ing["sessions_lost"] else ""),
    )
    t.add_row("store", f"{h.get('store', '?')}, {st['committed']} committed, {st['errors']} errors")
    t.add_row(
        "backlog",
        f"{st['backlog_records']} records, {st['backlog_bytes'] / 1e6:.2f} MB, "
        f"oldest {st['oldest_age_s']:.0f}s",
    )
    t.add_row("uplink", f"{h.get('uplink', '?')}")
    stages = h.get("stages")
    if isinstance(stages, dict) and stages:
        failing = [f"{n} {text}" for n, text in sorted(stages.items()) if str(text).startswith("failing")]
        t.add_row("stages", "[red]" + escape("; ".join(failing)) + "[/]" if failing else "all running")
    mean = fw["mean_send_ms"]
    t.add_row(
        "forwarded",
        f"{fw['records']} records{rate('forward_per_s')} in {fw['batches']} batches"
        + (f", mean send {mean} ms" if mean is not None else ""),
    )
    t.add_row("send errors", _nonzero(fw["errors"]) + f"; ambiguous retries {fw['ambiguous_retries']}")
    t.add_row("dropped", _nonzero(st["dropped"]))
    stored = f.get("stored")
    held = (
        f"stored {stored['dead_letters']} ({_nonzero(stored['dead_letters_by_reason'])}); since start "
        if stored is not None
        else ""
    )
    t.add_row(
        "dead letters",
        held
        + _nonzero(st["dead_letters"])
        + f"; {st['dead_letter_bytes'] / 1e6:.2f} MB; devices {st['devices']}",
    )
    t.add_row("commands", _nonzero(dl["commands"]) + f"; inbox {dl['inbox_records']}")
    return t


def status(
    config: ConfigOption = DEFAULT_CONFIG,
    url: Annotated[
        str | None, typer.Option(help="Agent endpoint (default: http://<metrics.listen> from the config).")
    ] = None,
    interval: Annotated[
        float, typer.Option("--interval", "-i", min=0.2, help="Seconds between refreshes.")
    ] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON document (implies --once).")] = False,
) -> None:
    """Live view of the running agent (ingest, backlog, uplink, drops, dead letters, commands); q quits."""
    settings = load_or_exit(config)
    if url is None:
        url = local_url(settings.metrics.listen)
    url = url.rstrip("/")
    try:
        snap = scrape(url, settings)
    except NotOurs as e:
        _not_ours(url, str(e), as_json)
        raise typer.Exit(EXIT_NOT_OURS) from None
    except OSError as e:
        _not_running(settings.buffer_path, url, e, as_json)
        raise typer.Exit(EXIT_NOT_RUNNING) from None
    if as_json or once or not sys.stdout.isatty():
        f = figures(snap) | stored(settings)
        if as_json:
            typer.echo(json.dumps(f | {"agent": "running", "url": url}))
        else:
            Console().print(render(f, url))
        raise typer.Exit(0 if snap.healthy else EXIT_UNHEALTHY)
    prev = snap
    try:
        first = render(figures(snap) | stored(settings), url)
        with QuitKey() as keys, Live(first, auto_refresh=False) as live:
            while not keys.pressed_within(interval):
                try:
                    snap = scrape(url, settings)
                except (OSError, NotOurs) as e:
                    live.update(Table(title=f"[red]agent stopped answering at {url}: {e}[/]"), refresh=True)
                    continue
                live.update(render(figures(snap, prev) | stored(settings), url), refresh=True)
                prev = snap
    except KeyboardInterrupt:
        pass


class QuitKey:
    """`q` ends the live view when stdin is a terminal (read in cbreak mode,
    the terminal's settings restored on exit); otherwise only Ctrl-C does."""

    def __init__(self) -> None:
        self._fd: int | None = None  # watched for keys
        self._saved: tuple[int, list[Any]] | None = None  # restored on exit

    def __enter__(self) -> QuitKey:
        if sys.stdin.isatty():
            fd = sys.stdin.fileno()
            self._saved = (fd, termios.tcgetattr(fd))
            tty.setcbreak(fd)
            self._fd = fd
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._saved is not None:
            termios.tcsetattr(self._saved[0], termios.TCSADRAIN, self._saved[1])

    def pressed_within(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds; True when `q` was pressed."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            if self._fd is None:
                time.sleep(left)
                return False
            ready, _, _ = select.select([self._fd], [], [], left)
            if ready:
                key = os.read(self._fd, 1)
                if key in (b"q", b"Q"):
                    return True
                if not key:  # end of input: stop watching it
                    self._fd = None
        return False


def _not_ours(url: str, why: str, as_json: bool) -> None:
    if as_json:
        typer.echo(json.dumps({"agent": "not ours", "url": url, "error": why}))
        return
    typer.secho(f"agent: something else answers at {url}: {why}", fg=typer.colors.RED)
    typer.echo("       is another process holding metrics.listen? (ss -ltnp; journalctl -u iggy-edge)")


def _not_running(path: Any, url: str, error: Exception, as_json: bool) -> None:
    try:
        buffer: dict[str, Any] | None = read_stats(path).as_dict()
        buffer_error = None
    except StoreError as e:
        buffer, buffer_error = None, str(e)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "agent": "not running",
                    "url": url,
                    "error": str(error),
                    "buffer": buffer,
                    "buffer_error": buffer_error,
                }
            )
        )
        return
    typer.secho(f"agent: not running (nothing answers at {url}: {error})", fg=typer.colors.YELLOW)
    typer.echo("       start it with: systemctl start iggy-edge   (logs: journalctl -u iggy-edge)")
    if buffer is None:
        typer.echo(f"buffer: {buffer_error}")
        return
    age = buffer["oldest_age_s"]
    typer.echo(
        f"buffer: {buffer['records']} records, {buffer['bytes'] / 1e6:.2f} MB waiting"
        + ("" if age is None else f", oldest {age:.0f}s")
        + f"; dead letters {buffer['dead_letters']}; dropped {_nonzero(buffer['drops_by_reason'])}"
    )
