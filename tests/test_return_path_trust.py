"""The return path's trust boundary (issue 18): nothing the cloud side puts
into the gateway's Iggy topics, and nothing a device publishes on its ack
topic, stops the return path or acts for another device.

Real Mosquitto, the real agent, MemoryIggy as the command source (our
boundary: it stands for the Iggy server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from iggy_edge.buffer_admin import read_dead_letters
from iggy_edge.cli.main import app
from iggy_edge.downlink import poll as poll_module
from iggy_edge.downlink.commands import (
    INVALID_COMMAND,
    MAX_TIME,
    Ack,
    Command,
    CommandState,
    InvalidCommand,
    make_command,
    make_config,
    parse_ack,
    parse_command,
    read_command,
)
from iggy_edge.downlink.component import ACK_WRONG_DEVICE
from iggy_edge.downlink.inbox import Inbox
from iggy_edge.downlink.inbox_rows import RowRefused
from iggy_edge.downlink.poll import TOO_MANY_CONFIG_DEVICES
from iggy_edge.inbox_admin import read_commands, read_configs
from iggy_edge.provision.credentials import CredentialsError, check_device_id
from iggy_edge.uplink.memory import MemoryIggy
from typer.testing import CliRunner

from tests.support.agent import wait_subscribed
from tests.support.broker import Broker
from tests.support.downlink import downlink_settings
from tests.support.return_path import (
    device,
    poll_harness,
    publish,
    running,
    send,
    send_raw,
    states,
    stored_offset,
)
from tests.support.wait import async_wait_until


def command_doc(**fields: object) -> dict[str, object]:
    return {"id": "poison", "device": "dev-1", "name": "n", **fields}


def raw(doc: dict[str, object]) -> bytes:
    return json.dumps(doc).encode()


# What reproduced issue 18 item 1: each of these raised out of the poll (on
# the inbox insert or in json) and the partition's offset never advanced.
POISON = {
    "surrogate device": b'{"id": "p1", "device": "\\ud800", "name": "n"}',
    "surrogate in args": b'{"id": "p2", "device": "dev-1", "name": "n", "args": {"k": "\\udfff"}}',
    "surrogate id": b'{"id": "\\ud800x", "device": "dev-1", "name": "n"}',
    "args nested 100,000 deep": b'{"id": "p3", "device": "dev-1", "name": "n", "args": {"a": '
    + b"[" * 100_000
    + b"]" * 100_000
    + b"}}",
    "5,001-digit integer": b'{"id": "p4", "device": "dev-1", "name": "n", "args": {"n": '
    + b"7" * 5001
    + b"}}",
    "expires_at 1 and 400 zeros": b'{"id": "p5", "device": "dev-1", "name": "n", "expires_at": 1'
    + b"0" * 400
    + b"}",
    "expires_at 1e400": b'{"id": "p6", "device": "dev-1", "name": "n", "expires_at": 1e400}',
    "expires_at past year 9999": raw(command_doc(id="p7", expires_at=MAX_TIME + 1)),
    "NaN in args": b'{"id": "p8", "device": "dev-1", "name": "n", "args": {"x": NaN}}',
    "not UTF-8": b'{"id": "p9", "device": "dev-1", "name": "\xff\xfe"}',
    "args 40 deep": raw(command_doc(id="p10", args=json.loads('{"a":' * 40 + "1" + "}" * 40))),
}


async def test_poison_commands_are_dead_lettered_and_the_next_one_is_delivered(
    tmp_path: Path, broker: Broker
) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with device(broker) as dev, running(settings, iggy) as r:
        for payload in POISON.values():
            send_raw(iggy, settings, payload)
        good = make_command("dev-1", "after-the-poison")
        last = send(iggy, settings, good)
        await async_wait_until(lambda: dev.ids() == [good.id], what="the good command still arrives")
        dead = read_dead_letters(settings.buffer_path)
        assert sorted(d.payload for d in dead) == sorted(POISON.values())
        assert {d.reason for d in dead} == {INVALID_COMMAND}
        assert all(d.detail for d in dead)
        assert all(d.detail.isprintable() for d in dead)
        assert stored_offset(settings) == last
        assert list(states(settings)) == [good.id]
        assert r.metric("iggy_edge_store_dead_letters_total", reason=INVALID_COMMAND) == len(POISON)
        assert r.agent.ready.is_set()


@pytest.mark.parametrize("name", sorted(POISON))
@pytest.mark.unit
def test_the_boundary_refuses_each_poison_without_raising(name: str) -> None:
    got = read_command(POISON[name], now=1.7e9, default_ttl_s=60)
    assert not hasattr(got, "device_payload"), got
    assert got.reason == INVALID_COMMAND
    assert got.detail.isprintable()


# Issue 18 item 2(a): device ids a PUBLISH could trip on are refused at poll time.
BAD_DEVICE_IDS = [
    "dev\x00one",
    "dev\x1bone",  # C0 (ESC)
    "dev\x85one",  # C1 (NEL)
    "dev\x9bone",  # C1 (CSI)
    "dev\ufffe",  # noncharacter
    "dev\uffff",
    "dev\U0010ffff",
    "a/b",
    "x" * 65,
    "iggy-edge-x",
    "dev1\n",  # `$` used to match before a trailing newline
]


async def test_commands_for_unusable_device_ids_are_dead_lettered_with_the_offset_consumed(
    tmp_path: Path, broker: Broker
) -> None:
    settings = downlink_settings(tmp_path, broker, iggy={"partitions": 1})
    iggy = MemoryIggy(partitions=1)
    async with device(broker) as dev, running(settings, iggy):
        for i, bad in enumerate(BAD_DEVICE_IDS):
            send_raw(iggy, settings, raw(command_doc(id=f"bad-{i}", device=bad)))
        good = make_command("dev-1", "after")
        last = send(iggy, settings, good)
        await async_wait_until(lambda: dev.ids() == [good.id], what="the good command arrives")
        dead = read_dead_letters(settings.buffer_path)
        assert len(dead) == len(BAD_DEVICE_IDS)
        assert all("'device'" in d.detail for d in dead)
        assert stored_offset(settings) == last
        assert [r.id for r in read_commands(settings.buffer_path)] == [good.id]


@pytest.mark.unit
def test_a_trailing_newline_is_refused_by_the_parser_and_the_credentials_check() -> None:
    with pytest.raises(CredentialsError):
        check_device_id("dev1\n")
    with pytest.raises(InvalidCommand):
        parse_command(raw(command_doc(device="dev1\n")), now=1.7e9, default_ttl_s=60)
    assert parse_command(raw(command_doc(device="dev1")), now=1.7e9, default_ttl_s=60).device == "dev1"


@pytest.mark.unit
def test_a_command_from_near_year_9999_without_expiry_expires_at_the_last_time_allowed() -> None:
    # Hypothesis found it: created_at allowed, created_at + the default TTL
    # past MAX_TIME, so a command left the parser with a time it promises
    # never to pass on (the fuzz test's check_usable).
    doc = b'{"id": "y", "device": "dev-1", "name": "n", "created_at": 253402300000.0}'
    cmd = parse_command(doc, now=1.7e9, default_ttl_s=3600)
    assert (cmd.created_at, cmd.expires_at) == (253402300000.0, MAX_TIME)
    cmd = parse_command(raw(command_doc(created_at=1.7e9)), now=1.7e9, default_ttl_s=3600)
    assert cmd.expires_at == 1.7e9 + 3600


# -- the inbox insert refusing one row (a parser gap) must not wedge the partition


@pytest.mark.unit
async def test_a_row_the_inbox_refuses_is_dead_lettered_and_the_rest_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = downlink_settings(tmp_path, iggy={"partitions": 1})
    real_read = poll_module.read_command  # type: ignore[attr-defined]

    def gap(payload: bytes, *, now: float, default_ttl_s: float) -> object:
        """A parser that lets an unencodable command through (the gap the
        inbox must survive): an integer json cannot print."""
        got = real_read(payload, now=now, default_ttl_s=default_ttl_s)
        if isinstance(got, Command) and got.name == "gap":
            return Command(got.id, got.device, got.name, {"n": 10**5000}, got.created_at, got.expires_at)
        return got

    monkeypatch.setattr(poll_module, "read_command", gap)
    async with poll_harness(settings) as h:
        before = make_command("dev-1", "before")
        h.send_raw(before.wire())
        bad = h.send_raw(make_command("dev-1", "gap").wire())
        after = make_command("dev-1", "after")
        last = h.send_raw(after.wire())
        await async_wait_until(lambda: h.offset() == last, what="the offset passes the bad row")
        assert [r.name for r in reversed(read_commands(settings.buffer_path))] == ["before", "after"]
        (dead,) = read_dead_letters(settings.buffer_path)
        assert dead.reason == INVALID_COMMAND
        assert dead.mqtt_topic.endswith(f"@{bad}".encode())
        assert "inbox cannot store it" in dead.detail
        assert h.metrics.value("iggy_edge_downlink_errors_total", kind="unstorable") == 1
        assert not h.task.done()


@pytest.mark.unit
async def test_the_inbox_names_the_row_it_refuses_and_stores_nothing(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        good = make_command("dev-1", "ok")
        surrogate = Command("s1", "\ud800", "n", {}, 1.7e9, 1.8e9)  # past the parser
        with pytest.raises(RowRefused) as e:
            await inbox.store_polled("edge", "t", 0, 1, [(good, "t/0@0"), (surrogate, "t/0@1")])
        assert (e.value.kind, e.value.index) == ("command", 1)
        assert read_commands(settings.buffer_path) == []
        assert await inbox.offsets() == {}
    finally:
        await inbox.close()


# -- item 9: desired configs for devices never seen are bounded


@pytest.mark.unit
async def test_configs_beyond_max_config_devices_are_dead_lettered(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path, iggy={"partitions": 1}, downlink={"max_config_devices": 3})
    async with poll_harness(settings) as h:
        for i in range(5):
            h.send_raw(make_config(f"dev-{i}", {"v": 1}).wire(), config=True)
        # A known device's newer config still replaces its row at the bound.
        last = h.send_raw(make_config("dev-0", {"v": 2}).wire(), config=True)
        await async_wait_until(lambda: h.offset() == last, what="every config consumed")
        rows = {device: state for device, _, state, _ in read_configs(settings.buffer_path)}
        assert sorted(rows) == ["dev-0", "dev-1", "dev-2"]
        dead = read_dead_letters(settings.buffer_path)
        assert sorted(json.loads(d.payload)["device"] for d in dead) == ["dev-3", "dev-4"]
        assert {d.reason for d in dead} == {TOO_MANY_CONFIG_DEVICES}
        assert h.metrics.value("iggy_edge_store_dead_letters_total", reason=TOO_MANY_CONFIG_DEVICES) == 2
        payloads = await h.inbox.due_configs(10)
        assert {c.device: json.loads(c.payload) for c in payloads}["dev-0"] == {"v": 2}


# -- item 3: an ack counts only from the device the command was addressed to


async def test_another_devices_ack_is_refused_counted_and_dead_lettered(
    tmp_path: Path, broker: Broker
) -> None:
    settings = downlink_settings(tmp_path, broker)
    iggy = MemoryIggy()
    async with device(broker, "edge/dev-a/down/cmd") as dev, running(settings, iggy) as r:
        await wait_subscribed(r.agent)  # device acks come in through ingest
        cmd = make_command("dev-a", "open-the-door")
        send(iggy, settings, cmd)
        await async_wait_until(lambda: dev.ids() == [cmd.id], what="dev-a got its command")
        await async_wait_until(lambda: states(settings)[cmd.id] == "delivered", what="delivered")
        forged = json.dumps({"id": cmd.id, "status": "ok"}).encode()
        await publish(broker, "edge/dev-b/up/ack", forged)
        await async_wait_until(
            lambda: any(d.reason == ACK_WRONG_DEVICE for d in read_dead_letters(settings.buffer_path)),
            what="the forged ack dead-lettered",
        )
        (dead,) = read_dead_letters(settings.buffer_path)
        assert (dead.mqtt_topic, dead.payload) == (b"edge/dev-b/up/ack", forged)
        assert "'dev-a'" in dead.detail
        assert "'dev-b'" in dead.detail
        assert states(settings)[cmd.id] == "delivered"
        assert r.metric("iggy_edge_downlink_errors_total", kind=ACK_WRONG_DEVICE) == 1
        assert r.metric("iggy_edge_store_dead_letters_total", reason=ACK_WRONG_DEVICE) == 1
        assert r.metric("iggy_edge_downlink_commands_total", state="acked") == 0
        # The device the command is for still acknowledges it.
        await publish(broker, "edge/dev-a/up/ack", forged)
        await async_wait_until(lambda: states(settings)[cmd.id] == "acked", what="dev-a's own ack counts")
        assert r.metric("iggy_edge_downlink_commands_total", state="acked") == 1


@pytest.mark.unit
async def test_another_devices_ack_while_received_does_not_suppress_delivery(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        cmd = make_command("dev-a", "open-the-door")
        await inbox.store_polled("edge", "t", 0, 0, [(cmd, "t/0@0")])
        got = await inbox.apply_acks([("dev-b", Ack(cmd.id, "ok", None))])
        assert (got.done, got.wrong_device) == ([], [(0, "dev-a")])
        assert [c.id for c in await inbox.due_commands(10)] == [cmd.id]  # still to be delivered
        got = await inbox.apply_acks([("dev-a", Ack(cmd.id, "ok", None))])
        assert got.done == [(cmd.id, CommandState.ACKED)]
        assert await inbox.due_commands(10) == []
    finally:
        await inbox.close()


# -- item 9: `command list` prints untrusted text escaped


@pytest.mark.unit
async def test_command_list_escapes_what_the_cloud_side_and_devices_wrote(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        # Rows as an older agent (or anything writing the file) could have
        # left them: past today's parser, which refuses such a device id.
        red = "\x1b[31m"
        cmd = Command(f"id{red}", f"dev{red}", f"name{red}\u202e", {}, 1.7e9, 1.8e9)
        await inbox.store_polled("edge", "t", 0, 0, [(cmd, "t/0@0")])
        await inbox.apply_acks([(cmd.device, Ack(cmd.id, "error", f"boom{red}\x07"))])
    finally:
        await inbox.close()
    config = tmp_path / "config.toml"
    config.write_text(f'gateway_id = "gw-test"\nstate_dir = "{settings.state_dir}"\n')
    # color=True: click would strip ANSI sequences from what a test sees, not from a terminal.
    result = CliRunner().invoke(app, ["command", "list", "-c", str(config)], color=True)
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output
    assert "\x07" not in result.output
    assert "\u202e" not in result.output
    assert "dev\\x1b[31m" in result.output
    assert "device: boom\\x1b[31m\\x07" in result.output


@pytest.mark.unit
async def test_command_list_shows_the_result_the_device_sent(tmp_path: Path) -> None:
    settings = downlink_settings(tmp_path)
    inbox = await Inbox.open(settings.buffer_path, settings)
    try:
        cmd = Command("c-1", "dev-1", "read", {}, 1.7e9, 1.8e9)
        await inbox.store_polled("edge", "t", 0, 0, [(cmd, "t/0@0")])
        ack = parse_ack(b'{"id": "c-1", "status": "ok", "result": {"t": 21.5, "unit": "C"}}')
        assert ack is not None
        assert ack.result == '{"t":21.5,"unit":"C"}'
        await inbox.apply_acks([("dev-1", ack)])
    finally:
        await inbox.close()
    config = tmp_path / "config.toml"
    config.write_text(f'gateway_id = "gw-test"\nstate_dir = "{settings.state_dir}"\n')
    result = CliRunner().invoke(app, ["command", "list", "-c", str(config)])
    assert result.exit_code == 0, result.output
    row = next(line for line in result.output.splitlines() if line.startswith("c-1"))
    assert "acked" in row
    assert row.endswith('result: {"t":21.5,"unit":"C"}')


# -- issue 23: the kind header of the one return-path topic is untrusted too


@pytest.mark.unit
async def test_a_missing_or_unknown_kind_is_a_dead_letter_and_the_rest_goes_on(tmp_path: Path) -> None:
    """Commands and configs share one partition; the kind header says which.
    Without one, or with another value, the message is dead-lettered with
    its reason and its offset consumed, like an invalid command; a config
    sent as a command (or the reverse) is refused by that kind's parser."""
    settings = downlink_settings(tmp_path)
    async with poll_harness(settings) as h:
        cfg = make_config("dev-1", {"v": 1})
        bad = [
            (make_command("dev-1", "no-kind").wire(), {}),
            (make_command("dev-1", "odd").wire(), {"kind": "reboot\x1b[2J"}),
            (make_command("dev-1", "upper").wire(), {"kind": "COMMAND"}),
            (cfg.wire(), {"kind": "command"}),  # a config's fields are not a command's
        ]
        offsets = [h.send_raw(payload, headers=headers) for payload, headers in bad]
        good = make_command("dev-1", "good")
        h.send_raw(good.wire(), headers=good.headers())
        last = h.send_raw(cfg.wire(), headers=cfg.headers())
        await async_wait_until(lambda: h.offset() == last, what="everything consumed")
        assert [r.name for r in read_commands(settings.buffer_path)] == ["good"]
        assert [d for d, *_ in read_configs(settings.buffer_path)] == ["dev-1"]
        dead = read_dead_letters(settings.buffer_path)
        assert sorted(int(d.mqtt_topic.decode().rsplit("@", 1)[1]) for d in dead) == offsets
        assert {d.reason for d in dead} == {INVALID_COMMAND}
        details = sorted(d.detail for d in dead)
        assert any("no 'kind' header" in d for d in details)
        assert any("'kind' header is 'reboot\\x1b[2J'" in d for d in details)  # escaped, printable
        assert all(d.isprintable() for d in details)
        assert not h.task.done()
