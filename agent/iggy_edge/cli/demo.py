"""`iggy-edge demo`: the whole pipeline on one machine, with live figures.

Starts a private Mosquitto on a free port (unless a broker is configured),
a few simulated sensors, and the agent.  With IGGY_ADDRESS (and
IGGY_USERNAME / IGGY_PASSWORD) set it forwards to that Iggy server.  Without
them, when `iggy-server` is on PATH, it starts a private one (`PrivateIggy`: a
temporary data directory, a free loopback port, root credentials made up for
the run, stopped and removed on exit, Ctrl-C included) and the live table
shows what that server holds; otherwise it says how to get forwarding and
the backlog grows in the outbox.

The agent reaches a single Iggy node through a `TcpRelay`, so the demo can
cut the uplink and heal it (`--cut-uplink-after S` for `--cut-for` seconds,
or the ``c`` key): the buffer fills and drains while the table goes on.  A
row is printed every second whatever the uplink does (what the private
server holds is read back in the background, ``?`` while that read is
stale).  Ctrl-C stops everything, prints the summary and exits 130; the
temporary directory is removed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Annotated

import typer

from ..config import ConfigError, parse_config
from ..demo import Plan, run_demo
from ..httpd import local_url
from ..local_services import PrivateIggy, ServiceError, free_port, start_mosquitto
from ..logs import setup_logging
from .common import fail

NO_IGGY_HINT = (
    "uplink    none configured: records stay in the outbox; watch the backlog grow.\n"
    "          To forward, set IGGY_ADDRESS, IGGY_USERNAME, IGGY_PASSWORD, or\n"
    "          put iggy-server 0.9.x on PATH and the demo starts a private one\n"
    "          (build it from apache/iggy, tag server-0.9.0-edge.5:\n"
    "          cargo build --release -p server --bin iggy-server)"
)


def demo(
    sensors: Annotated[int, typer.Option(min=1, max=1000, help="Simulated sensors.")] = 5,
    rate: Annotated[float, typer.Option(min=0.1, max=1000, help="Readings per second per sensor.")] = 2.0,
    duration: Annotated[float, typer.Option(help="Stop after this many seconds (0 = until Ctrl-C).")] = 0.0,
    cut_uplink_after: Annotated[
        float,
        typer.Option(
            help="Cut the link to Iggy after this many seconds and heal it --cut-for seconds later,"
            " to watch the buffer fill and drain (0 = never; the c key toggles it too)."
        ),
    ] = 0.0,
    cut_for: Annotated[float, typer.Option(min=1, help="How long --cut-uplink-after cuts the link.")] = 15.0,
    state_dir: Annotated[
        Path | None,
        typer.Option(help="Where the demo keeps its buffer (default: a fresh temp dir, removed on exit)."),
    ] = None,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="Show the agent's log.")] = False,
) -> None:
    """Run a local broker, simulated sensors and the agent, and show live figures."""
    setup_logging("INFO" if verbose else "WARNING")
    workdir = state_dir or Path(tempfile.mkdtemp(prefix="iggy-edge-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    broker: subprocess.Popen[bytes] | None = None
    host = os.environ.get("IGGY_EDGE_MQTT_HOST")
    port = int(os.environ.get("IGGY_EDGE_MQTT_PORT", "1883"))
    env = dict(os.environ)
    env.pop("IGGY_EDGE_MQTT_HOST", None)
    env.pop("IGGY_EDGE_MQTT_PORT", None)
    iggy: PrivateIggy | None = None
    interrupted = False
    try:
        if host is None:
            try:
                broker, port = start_mosquitto(workdir)
            except ServiceError as e:
                raise fail(str(e)) from None
            host = "127.0.0.1"
            typer.echo(f"broker    started a private Mosquitto on {host}:{port}")
        else:
            typer.echo(f"broker    using {host}:{port}")
        raw = {
            "gateway_id": "demo-gw",
            "state_dir": str(workdir),
            "mqtt": {"host": host, "port": port},
            "metrics": {"listen": f"127.0.0.1:{free_port()}"},
        }
        try:
            settings = parse_config(raw, source="demo", env=env)
            binary = shutil.which("iggy-server")
            if settings.iggy.kind != "iggy" and binary is not None:
                iggy = PrivateIggy(binary)
                typer.echo(f"iggy      starting a private iggy-server ({binary}) on {iggy.address} ...")
                iggy.start()
                env.update(
                    {
                        "IGGY_ADDRESS": iggy.address,
                        "IGGY_USERNAME": iggy.USERNAME,
                        "IGGY_PASSWORD": iggy.password,
                    }
                )
                settings = parse_config(raw, source="demo", env=env)
        except ConfigError as e:
            raise fail(str(e), 2) from None
        except ServiceError as e:
            raise fail(str(e)) from None
        if iggy is not None:
            typer.echo(
                f"uplink    the private Iggy at {iggy.address} (data in {iggy.datadir}, removed on exit)"
            )
        elif settings.iggy.kind == "iggy":
            typer.echo(f"uplink    Iggy at {settings.iggy.address} as {settings.iggy.username}")
        else:
            typer.secho(NO_IGGY_HINT, fg=typer.colors.YELLOW)
        typer.echo(f"buffer    {settings.buffer_path}")
        typer.echo(f"dashboard {local_url(settings.metrics.listen)}/  (open it in a browser)")
        readings = settings.topics.up("<device>", "env")
        typer.echo(f"sensors   {sensors} x {rate}/s on {readings} (Ctrl-C to stop)")
        plan = Plan(sensors, rate, duration, cut_uplink_after, cut_for)
        try:
            interrupted = asyncio.run(run_demo(settings, host, port, plan, iggy, typer.echo))
        except KeyboardInterrupt:  # Ctrl-C before the demo's own handler was installed
            interrupted = True
        except ServiceError as e:
            raise fail(str(e)) from None
    finally:
        if iggy is not None:
            iggy.stop()
        if broker is not None:
            broker.terminate()
            broker.wait(10)
        if state_dir is None:
            shutil.rmtree(workdir, ignore_errors=True)
    if interrupted:
        raise typer.Exit(130)  # what a shell reports for a command ended by Ctrl-C
