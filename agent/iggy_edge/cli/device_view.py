"""`iggy-edge device list`: every device this gateway has heard from, from
the running agent's ``/devices`` (devices.py, dashboard.py), stalest first.

The listing is the agent's memory since it started (the buffer keeps
records, not devices): after a restart a device shows up again with its
next message.
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import typer

from ..config import Settings
from ..downlink.commands import printable
from ..httpd import local_url
from ..scrape import NotOurs, scrape

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd]?)")
_UNIT = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """``90``, ``90s``, ``10m``, ``2h``, ``1d`` -> seconds (typer callback)."""
    m = _DURATION.fullmatch(text.strip())
    if m is None:
        raise typer.BadParameter(f"{text!r} is not a duration (e.g. 90s, 10m, 2h, 1d)")
    return float(m[1]) * _UNIT[m[2]]


def fetch_devices(settings: Settings, timeout: float = 5.0) -> dict[str, Any]:
    """The agent's /devices, after checking it is this gateway's agent
    (raises OSError when nothing answers, NotOurs when someone else does)."""
    url = local_url(settings.metrics.listen)
    scrape(url, settings, timeout=timeout)
    with urllib.request.urlopen(f"{url}/devices", timeout=timeout) as resp:  # noqa: S310 - a local URL
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 90:
        return f"{seconds:.0f}s"
    if seconds < 5400:
        return f"{seconds / 60:.0f}m"
    if seconds < 172_800:
        return f"{seconds / 3600:.1f}h"
    return f"{seconds / 86400:.1f}d"


def _command(row: dict[str, Any]) -> str:
    cmd = row.get("last_command")
    if not cmd:
        return "-"
    return printable(f"{cmd['name']} {cmd['state']}")


def _dead(row: dict[str, Any]) -> str:
    dead = row.get("dead_letters") or {}
    return printable(", ".join(f"{k} {v}" for k, v in sorted(dead.items()))) or "-"


def render(doc: dict[str, Any], *, device: str | None = None) -> str:
    rows = doc["devices"]
    if device is not None:
        return "\n".join(_detail(r) for r in rows) or f"device {printable(device)!r}: not heard from"
    if not rows:
        return "no device heard from since the agent started"
    stale = sum(1 for r in rows if r["stale"])
    lines = [
        f"{len(rows)} device(s), {stale} stale (silent over {_ago(doc['stale_after_s'])}), stalest first",
        f"{'DEVICE':<24} {'STATUS':<8} {'SILENT':>6} {'READINGS':>9} {'RATE/S':>7} {'BUFFERED':>9} "
        f"{'SHARE':>6} {'UNRCPT':>6} {'APP':<12} {'LAST COMMAND':<20} DEAD LETTERS",
    ]
    for r in rows:
        share = r.get("buffer_share")
        lines.append(
            f"{printable(r['device']):<24} {printable(r['status'] or '-'):<8} {_ago(r['silent_s']):>6} "
            f"{r['readings']:>9} {r['rate_per_s']:>7.2f} {r.get('buffered', 0):>9} "
            f"{'-' if share is None else f'{100 * share:.0f}%':>6} {_ago(r.get('unreceipted_age_s')):>6} "
            f"{printable(r.get('app_v') or '-'):<12} {_command(r):<20} {_dead(r)}"
            + ("  STALE" if r["stale"] else "")
        )
    return "\n".join(lines)


def _detail(r: dict[str, Any]) -> str:
    since = r.get("status_since")
    status = printable(r["status"] or "-") + (
        "" if since is None else f" since {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(since))}"
    )
    version = " / ".join(printable(v) for v in (r.get("lib"), r.get("fw")) if v) or "-"
    fields = [
        ("device", printable(r["device"]) + ("  (STALE)" if r["stale"] else "")),
        ("status", status),
        ("last seen", f"{_ago(r['silent_s'])} ago"),
        (
            "readings",
            f"{r['readings']} ({r['bytes']} bytes) since the agent started, {r['rate_per_s']:.2f}/s now",
        ),
        ("buffered", f"{r.get('buffered', 0)} records ({r.get('buffered_bytes', 0)} bytes)"),
        ("unreceipted", _ago(r.get("unreceipted_age_s"))),
        ("dead letters", _dead(r)),
        ("last command", _command(r)),
        ("version", version),
        ("app version", printable(r.get("app_v") or "-")),
    ]
    return "\n".join(f"{k:<13} {v}" for k, v in fields)


def show_devices(
    settings: Settings, *, as_json: bool, stale: float | None = None, device: str | None = None
) -> None:
    url = local_url(settings.metrics.listen)
    try:
        doc = fetch_devices(settings)
    except NotOurs as e:
        typer.echo(f"error: {url} is not this gateway's agent: {e}", err=True)
        raise typer.Exit(4) from None
    except (OSError, urllib.error.URLError) as e:
        typer.echo(f"error: the agent does not answer at {url} ({e}): is it running?", err=True)
        raise typer.Exit(3) from None
    rows = doc["devices"]
    if stale is not None:
        rows = [r for r in rows if r["silent_s"] > stale]
    if device is not None:
        rows = [r for r in rows if r["device"] == device]
    doc = doc | {"devices": rows}
    if as_json:
        typer.echo(json.dumps(doc, indent=2))
    else:
        typer.echo(render(doc, device=device))
