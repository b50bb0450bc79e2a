"""Inbox and command formats: pure parsing, and the SQLite transactions."""

from __future__ import annotations

import json
import sqlite3
import time
from pathlib import Path

import pytest
from iggy_edge.config import ConfigError, parse_config
from iggy_edge.downlink.commands import (
    Ack,
    CommandState,
    InvalidCommand,
    deliver_client_id,
    legacy_topics,
    make_command,
    make_config,
    parse_ack,
    parse_command,
    return_topic,
    return_topic_of,
    stream_shard,
)
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.inbox_admin import read_commands, read_offsets

from tests.support.downlink import downlink_settings

pytestmark = pytest.mark.unit

NOW = 1_700_000_000.0


def cmd_bytes(**doc: object) -> bytes:
    return json.dumps(doc).encode()


def test_addressing_is_per_gateway(tmp_path: Path) -> None:
    s = downlink_settings(tmp_path)
    rt = return_topic(s)
    assert (rt.stream, rt.topic, rt.partition) == (
        f"edge-rp-{stream_shard('gw-test', 8)}",
        "return.gw-test",
        0,
    )
    assert legacy_topics("gw-test", s.downlink) == ("commands.gw-test", "config.gw-test")
    assert deliver_client_id(s) == "iggy-edge-gw-test-deliver"


def test_return_streams_are_a_stable_hash_of_the_gateway_id(tmp_path: Path) -> None:
    """The cloud side and every gateway compute the same stream; at 10,000
    gateways no stream of the default 8 comes near Iggy's 4,096 topics."""
    s = downlink_settings(tmp_path)
    assert stream_shard("gw-test", 8) == stream_shard("gw-test", 8)
    assert return_topic_of("gw-test", s.downlink) == return_topic(s)
    counts: dict[int, int] = {}
    for i in range(10_000):
        n = stream_shard(f"gw-{i:05d}", 8)
        counts[n] = counts.get(n, 0) + 1
    assert sorted(counts) == list(range(8))
    assert max(counts.values()) < 1_400  # 1,250 each on average
    assert max(counts.values()) < 4_096


def test_parse_command_defaults_and_limits() -> None:
    c = parse_command(cmd_bytes(id="a", device="d1", name="n"), now=NOW, default_ttl_s=60)
    assert (c.args, c.created_at, c.expires_at) == ({}, NOW, NOW + 60)
    c = parse_command(
        cmd_bytes(id="a", device="d1", name="n", args={"x": 1}, created_at=5, expires_at=9),
        now=NOW,
        default_ttl_s=60,
    )
    assert (c.args, c.created_at, c.expires_at) == ({"x": 1}, 5.0, 9.0)
    assert c.expired(NOW)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"\xff\xfe", "not JSON"),
        (b"{", "not JSON"),
        (b'"text"', "JSON object"),
        (cmd_bytes(device="d", name="n"), "'id'"),
        (cmd_bytes(id="x" * 65, device="d", name="n"), "'id'"),
        (cmd_bytes(id="a", device="d/e", name="n"), "topic level"),
        (cmd_bytes(id="a", device="+", name="n"), "topic level"),
        (cmd_bytes(id="a", device="d", name=""), "'name'"),
        (cmd_bytes(id="a", device="d", name="n", args="x"), "'args'"),
        (cmd_bytes(id="a", device="d", name="n", expires_at=True), "'expires_at'"),
        (cmd_bytes(id="a", device="d", name="n", created_at=-1), "'created_at'"),
    ],
)
def test_parse_command_rejects(payload: bytes, why: str) -> None:
    with pytest.raises(InvalidCommand, match=why):
        parse_command(payload, now=NOW, default_ttl_s=60)


def test_parse_ack() -> None:
    assert parse_ack(b'{"id":"a","status":"ok","result":1}') == Ack("a", "ok", None, "1")
    assert parse_ack(b'{"id":"a","status":"error","error":"boom"}') == Ack("a", "error", "boom")
    assert Ack("a", "error", None).state is CommandState.FAILED
    assert Ack("a", "expired", None).state is CommandState.EXPIRED
    assert Ack("a", "ok", None).state is CommandState.ACKED
    for junk in (b"x", b"[]", b'{"id":1,"status":"ok"}', b'{"id":"a"}'):
        assert parse_ack(junk) is None


def test_downlink_settings_validate_names(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(
            {"gateway_id": "g", "downlink": {"commands_topic": "a b", "command_topic": "edge/x/down/cmd"}},
            env={},
        )
    keys = {k for k, _ in e.value.problems}
    assert keys == {"downlink.commands_topic", "downlink.command_topic"}


async def test_offset_and_commands_commit_together_or_not_at_all(tmp_path: Path) -> None:
    """A failure inside the transaction (here: a trigger on the offset table,
    standing in for a crash or a full disk at that point) leaves neither the
    commands nor the offset: the poll re-reads the same messages."""
    s = downlink_settings(tmp_path)
    inbox = await Inbox.open(s.buffer_path, s)
    try:
        a, b = make_command("d1", "x"), make_command("d1", "y")
        await inbox.store_polled("edge", "commands.gw-test", 0, 0, [(a, "t/0@0")])
        with sqlite3.connect(s.buffer_path) as c:
            c.execute(
                "CREATE TRIGGER fail_offset BEFORE UPDATE ON downlink_offsets"
                " BEGIN SELECT RAISE(ABORT, 'disk gone'); END"
            )
        with pytest.raises(sqlite3.IntegrityError, match="disk gone"):
            await inbox.store_polled("edge", "commands.gw-test", 0, 1, [(b, "t/0@1")])
        assert [r.id for r in read_commands(s.buffer_path)] == [a.id]
        assert read_offsets(s.buffer_path) == [("edge", "commands.gw-test", 0, 0, None)]
        with sqlite3.connect(s.buffer_path) as c:
            c.execute("DROP TRIGGER fail_offset")
        got = await inbox.store_polled("edge", "commands.gw-test", 0, 1, [(b, "t/0@1")])
        assert (got.new, got.duplicates) == (1, 0)
        assert read_offsets(s.buffer_path)[0][3] == 1
    finally:
        await inbox.close()


async def test_state_transitions_are_guarded(tmp_path: Path) -> None:
    s = downlink_settings(tmp_path)
    inbox = await Inbox.open(s.buffer_path, s)
    try:
        a, b, old = (
            make_command("d1", "a"),
            make_command("d1", "b"),
            make_command("d1", "o", now=NOW, ttl_s=1),
        )
        got = await inbox.store_polled("edge", "t", 0, 2, [(a, "s"), (b, "s"), (old, "s")])
        assert (got.new, got.expired) == (3, 1)
        assert [c.id for c in await inbox.due_commands(10)] == [a.id, b.id]
        assert await inbox.finish([(a.id, CommandState.DELIVERED, "")]) == [(a.id, CommandState.DELIVERED)]
        # Only `received` rows leave `received`: a second delivery record is a no-op.
        assert await inbox.finish([(a.id, CommandState.DELIVERED, "")]) == []
        assert (await inbox.apply_acks([("d1", Ack(a.id, "ok", None))])).done == [(a.id, CommandState.ACKED)]
        # A late ack cannot revive an expired command.
        assert (await inbox.apply_acks([("d1", Ack(old.id, "ok", None))])).done == []
        assert await inbox.waiting() == 1
        again = await inbox.store_polled("edge", "t", 0, 3, [(a, "s")])
        assert (again.new, again.duplicates) == (0, 1)
        assert {r.id: r.state for r in read_commands(s.buffer_path)} == {
            a.id: "acked",
            b.id: "received",
            old.id: "expired",
        }
        # History: finished rows older than history_s are forgotten, waiting ones never.
        assert await inbox.prune(now=time.time() + s.downlink.history_s + 1) == 2
        assert [r.id for r in read_commands(s.buffer_path)] == [b.id]
    finally:
        await inbox.close()


async def test_config_keeps_only_the_newest_and_ignores_identical_resends(tmp_path: Path) -> None:
    s = downlink_settings(tmp_path)
    inbox = await Inbox.open(s.buffer_path, s)
    try:
        c1 = make_config("d1", {"p": 1}, config_id="v1")
        c2 = make_config("d1", {"p": 2}, config_id="v2")
        await inbox.store_polled("edge", "config.gw-test", 0, 1, configs=[(c1, "s"), (c2, "s")])
        due = await inbox.due_configs(10)
        assert [(c.id, json.loads(c.payload)) for c in due] == [("v2", {"p": 2})]
        await inbox.finish_configs([(due[0], "delivered", "")])
        assert await inbox.due_configs(10) == []
        got = await inbox.store_polled("edge", "config.gw-test", 0, 2, configs=[(c2, "s")])
        assert got.configs == 0
        assert await inbox.due_configs(10) == []
    finally:
        await inbox.close()
