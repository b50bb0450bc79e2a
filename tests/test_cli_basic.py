"""The command line: help, version, buffer stats, and the demo smoke test."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from iggy_edge import __version__
from iggy_edge.cli.main import app
from iggy_edge.config import BufferSettings
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox
from typer.testing import CliRunner

from tests.support.demo import AGENT, DEMO_ARGS, demo_env, demo_rows, path_without_iggy_server, port_open
from tests.support.iggy_server import SKIP_REASON

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
    assert re.search(r"dead letters  2, .*\(oversize: 1, unroutable: 1\)", out), out
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
    live figures must move.  Without iggy-server on PATH and no uplink
    configured the backlog grows, and the demo says how to forward."""
    result = subprocess.run(
        [AGENT, *DEMO_ARGS, "--duration", "3", "--state-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=60,
        env=demo_env(path_without_iggy_server()),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert "none configured" in result.stdout
    assert "put iggy-server 0.9.x" in result.stdout
    assert "on PATH and the demo starts a private one" in result.stdout
    rows = demo_rows(result.stdout)
    assert len(rows) >= 2, result.stdout
    published, ingested, buffered = (int(float(rows[-1][i])) for i in (1, 2, 3))
    first_ingested = int(float(rows[0][2]))
    assert ingested > first_ingested > 0
    assert buffered > 0
    assert published > 0
    assert rows[-1][5:7] == ["0", "-"]  # nothing forwarded, no Iggy to look at
    assert (tmp_path / "demo" / "buffer.db").exists()


def private_iggy(stdout: str) -> tuple[str, Path]:
    """The private server's address and data directory, as the demo says them."""
    m = re.search(r"the private Iggy at (\S+) \(data in (\S+), removed on exit\)", stdout)
    assert m, stdout
    return m[1], Path(m[2])


@pytest.mark.iggy
def test_demo_forwards_to_a_private_iggy_server(tmp_path: Path) -> None:
    if shutil.which("iggy-server") is None:
        pytest.skip(SKIP_REASON)
    result = subprocess.run(
        [AGENT, *DEMO_ARGS, "--duration", "4", "--state-dir", str(tmp_path / "demo")],
        capture_output=True,
        text=True,
        timeout=120,
        env=demo_env(os.environ.get("PATH", "")),
        check=False,
    )
    assert result.returncode == 0, result.stderr
    address, datadir = private_iggy(result.stdout)
    rows = demo_rows(result.stdout)
    assert len(rows) >= 2, result.stdout
    published, forwarded, held = int(rows[-1][1]), int(rows[-1][4]), int(rows[-1][6])
    assert rows[-1][7] == "up"
    assert 0 < held <= forwarded  # read back from the server: records reached Iggy
    assert held > int(rows[0][6])
    assert published > 0
    assert not datadir.exists()  # removed on exit
    assert not port_open(address)


@pytest.mark.iggy
def test_demo_ctrl_c_stops_and_removes_its_iggy_server(tmp_path: Path) -> None:
    if shutil.which("iggy-server") is None:
        pytest.skip(SKIP_REASON)
    proc = subprocess.Popen(
        [AGENT, *DEMO_ARGS, "--state-dir", str(tmp_path / "demo")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=demo_env(os.environ.get("PATH", "")),
    )
    try:
        assert proc.stdout is not None
        seen = ""
        for line in proc.stdout:  # until the live table shows a record in Iggy
            seen += line
            rows = demo_rows(line)
            if rows and rows[0][6].isdigit() and int(rows[0][6]) > 0:
                break
        else:
            pytest.fail(f"the demo ended before a record reached Iggy:\n{seen}{proc.stderr}")
        address, datadir = private_iggy(seen)
        assert datadir.exists()
        assert port_open(address)
        proc.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err  # a command ended by Ctrl-C
    assert not datadir.exists()
    assert not port_open(address)


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
