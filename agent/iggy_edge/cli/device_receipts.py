"""`iggy-edge device list`, gateway part: the devices still holding readings
this gateway has not receipted yet (receipts.py), read from the running
agent's /metrics (`iggy_edge_receipts_unreceipted_age_seconds{device}`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from ..config import ConfigError, load_config
from ..httpd import local_url
from .status import NotOurs, scrape

AGE_METRIC = "iggy_edge_receipts_unreceipted_age_seconds"


def show_unreceipted(config: Path, *, explicit: bool, as_json: bool) -> None:
    """Print the gateway's view.  Without an explicit ``-c`` only the human
    listing tries the installed config, and says nothing when that fails (a
    laptop provisioning boards); ``--json`` adds gateway lines only with -c."""
    if as_json and not explicit:
        return
    if not config.exists():
        if explicit:
            typer.echo(f"receipts: no config at {config}: not shown", err=True)
        return
    try:
        settings = load_config(config)
    except ConfigError as e:
        if explicit:
            typer.echo(f"receipts: {e.source}: configuration is not valid: not shown", err=True)
        return
    url = local_url(settings.metrics.listen)
    try:
        snap = scrape(url, settings, timeout=2.0)
    except (OSError, NotOurs) as e:
        if explicit:
            typer.echo(f"receipts: the agent does not answer at {url} ({e}): not shown", err=True)
        return
    held = snap.labelled(AGE_METRIC)
    if as_json:
        for dev, age in sorted(held.items()):
            typer.echo(json.dumps({"gateway_device": dev, "unreceipted_age_s": round(age, 3)}))
        return
    if not settings.receipts.enabled:
        typer.echo(f"\nGATEWAY {url}: receipts are off ([receipts] enabled = false)")
        return
    if not held:
        typer.echo(f"\nGATEWAY {url}: no device holds readings waiting for a receipt")
        return
    typer.echo(f"\nGATEWAY {url}: {len(held)} device(s) hold readings not receipted yet")
    typer.echo(f"{'DEVICE':<32} OLDEST UNRECEIPTED")
    for dev, age in sorted(held.items(), key=lambda kv: -kv[1]):
        typer.echo(f"{dev:<32} {age:.1f} s")
