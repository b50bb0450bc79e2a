"""The command line: help, version, buffer stats, and the demo smoke test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from iggy_edge import __version__
from iggy_edge.cli.main import app
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from typer.testing import CliRunner

AGENT = str(Path(sys.executable).with_name("iggy-edge"))
runner = CliRunner()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([AGENT, *args], capture_output=True, text=True, timeout=60, check=False)


def test_help_lists_the_commands() -> None:
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    for command in ("run", "config", "buffer", "demo"):
        assert command in result.stdout


def test_version() -> None:
    result = cli("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"iggy-edge {__version__}"


async def make_buffer(tmp_path: Path) -> Path:
    """A buffer with 3 records, 2 dropped by drop_oldest, and 2 dead letters."""
    db = tmp_path / "state" / "buffer.db"
    box = await Outbox.open(db, BufferSettings(max_records=3, commit_interval_ms=0), "gw-cli", Metrics())
    box.start()
    try:
        for i in range(5):
            await box.submit(
                Incoming(
                    Route("edge", "telemetry", "dev-cli"),
                    "edge/dev-cli/up/env",
                    1,
                    False,
                    1,
                    b'{"seq":%d}' % i,
                )
            )
        await box.dead_letter(
            mqtt_topic="x/y", payload=b"p", qos=1, retain=False, reason="unroutable", detail="d"
        )
        await box.dead_letter(
            mqtt_topic="edge/d/up/e", payload=b"p" * 9, qos=1, retain=False, reason="oversize", detail="d"
        )
    finally:
        await box.close()
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'gateway_id = "gw-cli"\nstate_dir = "{tmp_path / "state"}"\n[buffer]\nmax_records = 3\n')
    return cfg


async def test_buffer_stats_text_and_json(tmp_path: Path) -> None:
    cfg = await make_buffer(tmp_path)
    result = runner.invoke(app, ["buffer", "stats", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "backlog       3 records" in out
    assert "limits 3 records" in out
    assert "dead letters  2 (oversize: 1, unroutable: 1)" in out
    assert "dropped       buffer_full_oldest: 2" in out
    assert "oldest record" in out
    result = runner.invoke(app, ["buffer", "stats", "--json", "-c", str(cfg)])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["records"] == 3
    assert data["newest_seq"] == 5
    assert data["dead_letters"] == 2
    assert data["dead_letters_by_reason"] == {"oversize": 1, "unroutable": 1}
    assert data["drops_by_reason"] == {"buffer_full_oldest": 2}
    assert data["oldest_age_s"] > 0


def test_buffer_stats_without_a_buffer_fails_clearly(tmp_path: Path) -> None:
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'gateway_id = "g"\nstate_dir = "{tmp_path / "none"}"\n')
    result = runner.invoke(app, ["buffer", "stats", "-c", str(cfg)])
    assert result.exit_code == 1
    assert "no buffer database" in result.stderr


def test_demo_smoke(tmp_path: Path) -> None:
    """`iggy-edge demo` starts its own Mosquitto, sensors and the agent; the
    live figures must move (no uplink configured: the backlog grows)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
    result = subprocess.run(
        [
            AGENT,
            "demo",
            "--duration",
            "3",
            "--sensors",
            "3",
            "--rate",
            "5",
            "--state-dir",
            str(tmp_path / "demo"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "no uplink" in result.stdout or "none configured" in result.stdout
    rows = [line.split() for line in result.stdout.splitlines() if line.strip().split(" ")[0].endswith("s")]
    rows = [r for r in rows if len(r) >= 6 and r[0][:-1].isdigit()]
    assert len(rows) >= 2, result.stdout
    published, ingested, buffered = (int(float(rows[-1][i])) for i in (1, 2, 3))
    first_ingested = int(float(rows[0][2]))
    assert ingested > first_ingested > 0
    assert buffered > 0
    assert published > 0
    assert (tmp_path / "demo" / "buffer.db").exists()


def test_config_example_prints_a_config_that_checks(tmp_path: Path) -> None:
    result = cli("config", "example")
    assert result.returncode == 0, result.stderr
    assert "gateway_id" in result.stdout
    path = tmp_path / "config.toml"
    path.write_text(result.stdout)
    checked = cli("config", "check", str(path))
    assert checked.returncode == 0, checked.stderr


def test_packaged_config_checks() -> None:
    packaged = Path(__file__).parent.parent / "packaging" / "config" / "config.toml"
    result = cli("config", "check", str(packaged))
    assert result.returncode == 0, result.stderr
