"""Fuzz the return path's trust boundary (issue 18, "How").

Iggy command and config payloads -- arbitrary bytes, arbitrary JSON with
surrogates, control characters, deep nesting, huge numbers and wrong types,
and mutated valid messages -- go

* through the pure boundary functions (`read_command`, `read_config`): they
  never raise, and what they let through is safe for every later step;
* through the real return poll (ReturnPoll, the real inbox on a real SQLite
  file, the real outbox as the dead-letter sink; MemoryIggy as the command
  source): each message is stored or dead-lettered with a reason, its offset
  is consumed, and a valid command after it is stored.

The end-to-end run with a real Mosquitto (a valid command after a batch of
poison ones reaches a subscriber) is
tests/test_return_path_trust.py::test_poison_commands_are_dead_lettered_and_the_next_one_is_delivered.
"""

from __future__ import annotations

import asyncio
import json
import math
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iggy_edge.buffer_admin import read_dead_letters
from iggy_edge.device_ids import is_device_id
from iggy_edge.downlink.commands import (
    MAX_DEVICE_PAYLOAD_BYTES,
    MAX_TIME,
    Command,
    DesiredConfig,
    Refused,
    make_command,
    make_config,
    message_kind,
    read_command,
    read_config,
)
from iggy_edge.inbox_admin import read_commands, read_configs

from tests.support.downlink import downlink_settings
from tests.support.return_path import poll_harness
from tests.support.wait import async_wait_until

NOW = 1.75e9

# Every code point, surrogates and control characters included.
ANY_CHAR = st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=())
ANY_TEXT = st.text(ANY_CHAR, max_size=20)
DEVICEISH = st.one_of(
    st.sampled_from(["dev-1", "a", "x" * 64, "x" * 65, "iggy-edge-x", "a/b", "dev1\n", "", "+", "#"]),
    ANY_TEXT,
)
NUMBER = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(MAX_TIME),
    st.just(MAX_TIME + 1),
)
SCALAR = st.one_of(st.none(), st.booleans(), NUMBER, ANY_TEXT)
JSON = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(ANY_TEXT, inner, max_size=4)
)


def maybe(key: str, value: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
    return st.one_of(st.just({}), value.map(lambda v: {key: v}))


def command_docs() -> st.SearchStrategy[dict[str, Any]]:
    fields = [
        maybe("id", st.one_of(ANY_TEXT, JSON)),
        maybe("device", st.one_of(DEVICEISH, JSON)),
        maybe("name", st.one_of(ANY_TEXT, JSON)),
        maybe("args", JSON),
        maybe("created_at", st.one_of(NUMBER, JSON)),
        maybe("expires_at", st.one_of(NUMBER, JSON)),
    ]
    return st.tuples(*fields).map(lambda parts: {k: v for p in parts for k, v in p.items()})


def config_docs() -> st.SearchStrategy[dict[str, Any]]:
    fields = [
        maybe("device", st.one_of(DEVICEISH, JSON)),
        maybe("config", JSON),
        maybe("id", JSON),
        maybe("version", JSON),
        maybe("created_at", st.one_of(NUMBER, JSON)),
    ]
    return st.tuples(*fields).map(lambda parts: {k: v for p in parts for k, v in p.items()})


class Short(bytes):
    """A payload whose repr stays short (hypothesis prints failing examples,
    and warns -- an error here -- about reprs of hundreds of kB)."""

    def __repr__(self) -> str:
        text = bytes.__repr__(self)
        return text if len(text) <= 300 else f"{text[:200]}...<{len(self)} bytes>"


def encoded(doc: object) -> bytes:
    # allow_nan: NaN/Infinity as Python's json writes them (not JSON, but bytes a sender can send)
    return json.dumps(doc).encode()


def deep(n: int) -> bytes:
    return b'{"id": "deep", "device": "dev-1", "name": "n", "args": {"a": ' + b"[" * n + b"]" * n + b"}}"


def long_number(n: int, field: str) -> bytes:
    return b'{"id": "num", "device": "dev-1", "name": "n", "' + field.encode() + b'": ' + b"9" * n + b"}"


def mutated(base: bytes) -> st.SearchStrategy[bytes]:
    """A valid message with bytes flipped, inserted or cut."""

    def apply(edits: list[tuple[int, int, bytes]]) -> bytes:
        out = bytearray(base)
        for kind, pos, data in edits:
            i = pos % (len(out) + 1)
            if kind == 0:
                out[i:i] = data
            elif kind == 1 and out:
                out[i % len(out)] ^= data[0] if data else 0xFF
            else:
                del out[i : i + len(data) + 1]
        return bytes(out)

    edit = st.tuples(st.integers(0, 2), st.integers(0, 10_000), st.binary(min_size=1, max_size=4))
    return st.lists(edit, min_size=1, max_size=4).map(apply)


VALID_COMMAND = make_command("dev-1", "relay", {"on": True, "level": 3}, command_id="base", now=NOW).wire()
VALID_CONFIG = make_config("dev-1", {"period_s": 10}, config_id="v1", now=NOW).wire()

COMMAND_PAYLOADS = st.builds(
    Short,
    st.one_of(
        st.binary(max_size=200),
        command_docs().map(encoded),
        JSON.map(encoded),
        st.integers(1, 40_000).map(deep),
        st.tuples(st.integers(1, 6000), st.sampled_from(["expires_at", "created_at", "args", "id"])).map(
            lambda t: long_number(*t)
        ),
        mutated(VALID_COMMAND),
    ),
)
CONFIG_PAYLOADS = st.builds(
    Short,
    st.one_of(
        st.binary(max_size=200),
        config_docs().map(encoded),
        JSON.map(encoded),
        st.integers(1, 40_000).map(lambda n: deep(n).replace(b'"args"', b'"config"')),
        mutated(VALID_CONFIG),
    ),
)


def check_usable(got: Command | DesiredConfig) -> None:
    """What the boundary lets through is safe for every later step."""
    assert is_device_id(got.device)
    payload = got.device_payload()
    assert len(payload) <= MAX_DEVICE_PAYLOAD_BYTES
    json.loads(payload)
    got.wire().decode()
    for text in (got.id, got.device, *([got.name] if isinstance(got, Command) else [])):
        text.encode()  # no surrogates
    times = [got.created_at, *([got.expires_at] if isinstance(got, Command) else [])]
    assert all(math.isfinite(t) and 0 <= t <= MAX_TIME for t in times)


# -- the pure functions (fast) -------------------------------------------------------

PURE = settings(max_examples=600, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@PURE
@given(COMMAND_PAYLOADS)
def test_read_command_never_raises_and_passes_only_usable_commands(payload: bytes) -> None:
    got = read_command(payload, now=NOW, default_ttl_s=3600)
    if isinstance(got, Refused):
        assert got.reason == "invalid_command"
        assert got.detail
        assert got.detail.isprintable()
    else:
        check_usable(got)


@PURE
@given(CONFIG_PAYLOADS)
def test_read_config_never_raises_and_passes_only_usable_configs(payload: bytes) -> None:
    got = read_config(payload, now=NOW, fallback_id="offset-1")
    if isinstance(got, Refused):
        assert got.reason == "invalid_command"
        assert got.detail.isprintable()
    else:
        check_usable(got)


HEADERS = st.dictionaries(
    st.one_of(st.just("kind"), st.text(max_size=8)),
    st.one_of(
        st.sampled_from(["command", "config", "ota", "Command", " config", "OTA", "ota\x00", ""]),
        st.text(max_size=40),
    ),
    max_size=3,
)


# Written out rather than taken from the module: a new kind is a decision
# this test should be told about.
RETURN_PATH_KINDS = ("command", "config", "ota")


@PURE
@given(HEADERS)
def test_message_kind_never_raises_and_names_only_the_known_kinds(headers: dict[str, str]) -> None:
    got = message_kind(headers)
    if isinstance(got, Refused):
        assert got.reason == "invalid_command"
        assert got.detail.isprintable()
        assert headers.get("kind") not in RETURN_PATH_KINDS
    else:
        assert got == headers["kind"]
        assert got in RETURN_PATH_KINDS


# -- through the real return poll ------------------------------------------------------


async def through_the_poll(tmp: Path, commands: list[bytes], configs: list[bytes]) -> None:
    s = downlink_settings(tmp, iggy={"partitions": 1})
    async with poll_harness(s) as h:
        sent_cmds = {h.send_raw(p): p for p in commands}
        sent_cfgs = {h.send_raw(p, config=True): p for p in configs}
        good = make_command("dev-1", "after-the-fuzz")
        last = h.send_raw(good.wire())
        last_cfg = h.send_raw(make_config("dev-2", {"ok": True}).wire(), config=True)
        await async_wait_until(lambda: h.offset() == last_cfg, what="every offset consumed")
        assert not h.task.done()
    stored = {r.source: r for r in read_commands(s.buffer_path, limit=1000)}
    # "iggy:edge-rp-5/return.gw-test/0@3" -> "return.gw-test/0@3"
    dead = {d.mqtt_topic.decode().split("/", 1)[1]: d for d in read_dead_letters(s.buffer_path, limit=1000)}
    assert stored[f"return.gw-test/0@{last}"].id == good.id
    for offset, payload in sent_cmds.items():
        where = f"return.gw-test/0@{offset}"
        got = read_command(payload, now=NOW, default_ttl_s=3600)
        if where in stored:
            assert not isinstance(got, Refused)
        elif where in dead:
            assert dead[where].reason == "invalid_command"
            assert dead[where].payload == payload
            assert dead[where].detail
        else:  # a second copy of an id already in the inbox: consumed, not stored again
            assert not isinstance(got, Refused)
            assert any(r.id == got.id for r in stored.values())
    config_rows = {device: source for device, _, _, source in read_configs(s.buffer_path)}
    assert config_rows["dev-2"] == f"return.gw-test/0@{last_cfg}"
    for offset, payload in sent_cfgs.items():
        where = f"return.gw-test/0@{offset}"
        got_cfg = read_config(payload, now=NOW, fallback_id=f"offset-{offset}")
        if isinstance(got_cfg, Refused):
            assert dead[where].reason == "invalid_command"
        else:  # its device has a row, this one or a newer one
            assert got_cfg.device in config_rows
            assert where not in dead


@settings(max_examples=40, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(COMMAND_PAYLOADS, max_size=8), st.lists(CONFIG_PAYLOADS, max_size=4))
def test_every_message_is_stored_or_dead_lettered_and_the_next_command_is_stored(
    commands: list[bytes], configs: list[bytes]
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        asyncio.run(through_the_poll(Path(tmp), commands, configs))
