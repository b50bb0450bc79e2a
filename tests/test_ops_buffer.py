"""`iggy-edge buffer peek|export|purge|dead-letters` on a real buffer file."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import exclusive, read_stats
from iggy_edge.cli.main import app
from iggy_edge.config import load_config
from iggy_edge.metrics import Metrics
from iggy_edge.records import Route
from iggy_edge.store import Incoming, Outbox, StoreError, open_database
from typer.testing import CliRunner

runner = CliRunner()


async def make_buffer(tmp_path: Path, records: int = 1200) -> Path:
    """A config and a buffer with `records` records and three dead letters."""
    config = tmp_path / "config.toml"
    config.write_text(
        f'gateway_id = "gw-buf"\nstate_dir = "{tmp_path / "state"}"\n[buffer]\nmax_payload_bytes = 64\n'
    )
    s = load_config(config, env={})
    box = await Outbox.open(s.buffer_path, s.buffer, s.gateway_id, Metrics())
    box.start()
    now = time.time_ns() // 1000
    futs = [
        box.submit(
            Incoming(
                Route("edge", "telemetry", f"d{i % 4}"),
                f"edge/d{i % 4}/up/env",
                1,
                False,
                now + i,
                b'{"seq": %d}' % i,
                i,
            )
        )
        for i in range(records - 1)
    ]
    futs.append(
        box.submit(
            Incoming(Route("edge", "telemetry", "bin"), "edge/bin/up/raw", 0, True, now, b"\xff\x00\xfe")
        )
    )
    for f in futs:
        await f
    await box.dead_letter(
        mqtt_topic="site/a1/temp",
        payload=b"21.5",
        qos=1,
        retain=False,
        reason="unroutable",
        detail="no route",
    )
    await box.dead_letter(
        mqtt_topic="site/a2/temp",
        payload=b"x" * 100,
        qos=1,
        retain=False,
        reason="unroutable",
        detail="no route",
    )
    await box.dead_letter(
        mqtt_topic="other/thing", payload=b"1", qos=0, retain=False, reason="unroutable", detail="no route"
    )
    await box.close()
    return config


async def test_peek_and_export(tmp_path: Path) -> None:
    config = await make_buffer(tmp_path)
    peek = runner.invoke(app, ["buffer", "peek", "-c", str(config), "-n", "3"])
    assert peek.exit_code == 0, peek.output
    lines = peek.stdout.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith("#1 ")
    assert "edge/telemetry key=d0" in lines[0]
    assert '{"seq": 0}' in lines[0]

    out = tmp_path / "out.jsonl"
    exp = runner.invoke(app, ["buffer", "export", "-c", str(config), "-o", str(out)])
    assert exp.exit_code == 0, exp.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 1200
    assert [r["seq"] for r in rows] == list(range(1, 1201))
    assert rows[5]["payload"] == '{"seq": 5}'
    assert rows[5]["device_seq"] == 5
    assert rows[-1]["payload_b64"] == "/wD+"  # not UTF-8: base64
    assert rows[-1]["retain"] is True
    assert "exported 1200 records" in exp.stderr
    assert "1200/1200" in exp.stderr  # the progress bar went to stderr

    to_stdout = runner.invoke(app, ["buffer", "export", "-c", str(config), "-n", "10"])
    assert to_stdout.exit_code == 0
    assert len([json.loads(x) for x in to_stdout.stdout.splitlines()]) == 10


async def test_purge_asks_refuses_while_open_and_counts(tmp_path: Path) -> None:
    config = await make_buffer(tmp_path, records=300)
    db = tmp_path / "state" / "buffer.db"

    declined = runner.invoke(app, ["buffer", "purge", "-c", str(config)], input="n\n")
    assert declined.exit_code == 1
    assert "Delete 300 records" in declined.stdout
    assert read_stats(db).records == 300

    # Another process holds the buffer open (as the running agent does): refused.
    holder = sqlite3.connect(db)
    holder.execute("SELECT count(*) FROM outbox").fetchone()
    try:
        busy = runner.invoke(app, ["buffer", "purge", "-c", str(config), "--yes"])
        assert busy.exit_code == 1
        assert "is the agent running?" in busy.stderr
        assert "systemctl stop iggy-edge" in busy.stderr
    finally:
        holder.close()
    assert read_stats(db).records == 300

    done = runner.invoke(app, ["buffer", "purge", "-c", str(config)], input="y\n")
    assert done.exit_code == 0, done.output
    assert "purged 300 records" in done.stdout
    st = read_stats(db)
    assert st.records == 0
    assert st.drops_by_reason["purged"] == 300
    assert st.dead_letters == 3  # kept without --dead-letters

    both = runner.invoke(app, ["buffer", "purge", "-c", str(config), "--yes", "--dead-letters"])
    assert both.exit_code == 0
    assert read_stats(db).dead_letters == 0


async def test_agent_cannot_open_the_buffer_during_maintenance(tmp_path: Path) -> None:
    await make_buffer(tmp_path, records=10)
    db = tmp_path / "state" / "buffer.db"
    with exclusive(db), pytest.raises(StoreError, match="locked"):
        await open_database(db)


async def test_dead_letters_list_and_replay_after_fixing_a_route(tmp_path: Path) -> None:
    config = await make_buffer(tmp_path, records=5)
    db = tmp_path / "state" / "buffer.db"
    listed = runner.invoke(app, ["buffer", "dead-letters", "-c", str(config)])
    assert listed.exit_code == 0, listed.output
    assert "site/a1/temp" in listed.stdout
    assert "unroutable" in listed.stdout
    as_json = runner.invoke(app, ["buffer", "dead-letters", "-c", str(config), "--json"])
    docs = [json.loads(line) for line in as_json.stdout.splitlines()]
    assert {d["mqtt_topic"] for d in docs} == {"site/a1/temp", "site/a2/temp", "other/thing"}

    # Nothing routes yet: replay keeps them all.
    same = runner.invoke(app, ["buffer", "dead-letters", "replay", "-c", str(config), "--yes"])
    assert same.exit_code == 0, same.output
    assert "replayed 0" in same.stdout
    assert "still dead: 2 unroutable" in same.stdout
    assert "still dead: 1 oversize" in same.stdout  # 100 bytes > max_payload_bytes 64
    # -c given to the group (before replay) is the config replay reads
    outer = runner.invoke(app, ["buffer", "dead-letters", "-c", str(config), "replay", "--yes"])
    assert outer.exit_code == 0, outer.output
    assert "still dead: 2 unroutable" in outer.stdout

    # Fix the route for site/...: the small one replays, the truncated one cannot.
    config.write_text(
        config.read_text()
        + '[[routes]]\nfilter = "site/+/#"\nstream = "edge"\ntopic = "site"\n'
        + '[[routes]]\nfilter = "edge/+/up/#"\nstream = "edge"\ntopic = "telemetry"\n'
    )
    config.write_text(config.read_text().replace("max_payload_bytes = 64", "max_payload_bytes = 1000"))
    fixed = runner.invoke(app, ["buffer", "dead-letters", "replay", "-c", str(config), "--yes"])
    assert fixed.exit_code == 0, fixed.output
    assert "replayed 1 dead letters" in fixed.stdout
    assert "still dead: 1 truncated" in fixed.stdout
    assert "still dead: 1 unroutable" in fixed.stdout
    st = read_stats(db)
    assert st.records == 6
    assert st.dead_letters == 2
    peek = runner.invoke(app, ["buffer", "peek", "-c", str(config), "-n", "10", "--json"])
    last = json.loads(peek.stdout.splitlines()[-1])
    assert (last["stream"], last["topic"], last["key"], last["payload"]) == ("edge", "site", "a1", "21.5")


async def test_missing_buffer_is_a_clear_error(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(f'gateway_id = "gw"\nstate_dir = "{tmp_path / "none"}"\n')
    for cmd in (
        ["peek"],
        ["export"],
        ["purge", "--yes"],
        ["dead-letters"],
        ["dead-letters", "replay", "--yes"],
    ):
        result = runner.invoke(app, ["buffer", *cmd, "-c", str(config)])
        assert result.exit_code == 1, cmd
        assert "no buffer database" in result.stderr, cmd


async def test_a_buffer_the_agent_is_still_creating_is_a_clear_error(tmp_path: Path) -> None:
    """The agent creates the file, then its tables: a read command in that
    moment says so (it printed `no such table: outbox_rows`)."""
    config = tmp_path / "config.toml"
    config.write_text(f'gateway_id = "gw"\nstate_dir = "{tmp_path / "state"}"\n')
    (tmp_path / "state").mkdir()
    sqlite3.connect(load_config(config, env={}).buffer_path).execute("PRAGMA journal_mode=WAL").close()
    for cmd in (["stats"], ["peek"], ["dead-letters"]):
        result = runner.invoke(app, ["buffer", *cmd, "-c", str(config)])
        assert result.exit_code == 1, cmd
        assert "no buffer tables yet (the agent is creating them; try again)" in result.stderr, cmd


@pytest.mark.parametrize(
    "command", [["stats"], ["peek"], ["dead-letters"], ["dead-letters", "--json"], ["export"]]
)
async def test_read_commands_on_a_damaged_file_print_a_clean_error(
    tmp_path: Path, command: list[str]
) -> None:
    config = await make_buffer(tmp_path, records=50)
    db = tmp_path / "state" / "buffer.db"
    db.write_bytes(b"this is not a database, just garbage from a bad SD card\x00" * 200)
    result = runner.invoke(app, ["buffer", *command, "-c", str(config)])
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "not a database" in result.output
    assert "Traceback" not in result.output
