from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
from iggy_edge.config import Settings, parse_config
from iggy_edge.records import OutboundRecord, make_message_id
from iggy_edge.uplink.factory import make_command_source, make_uplink
from iggy_edge.uplink.file import FileUplink
from iggy_edge.uplink.iggy import IggyCommandSource, IggyUplink
from iggy_edge.uplink.memory import (
    MemoryCommandSource,
    MemoryIggy,
    MemoryUplink,
    set_shared_memory_iggy,
)
from iggy_edge.uplink.partition import (
    KeyPartitioner,
    partition_for,
    record_problem,
    wire_headers,
)
from iggy_edge.uplink.protocol import (
    UplinkAmbiguous,
    UplinkRejected,
    UplinkUnavailable,
)

pytestmark = pytest.mark.unit


def rec(seq: int, key: str, topic: str = "telemetry", payload: bytes | None = None) -> OutboundRecord:
    return OutboundRecord(
        seq=seq,
        message_id=make_message_id(0xABCD, 7, seq),
        stream="edge",
        topic=topic,
        key=key,
        payload=payload if payload is not None else f"p{seq}".encode(),
        headers={"mqtt-topic": f"edge/{key}/up/t", "received-at-us": str(seq)},
    )


def test_partition_function_is_stable_and_spreads() -> None:
    # Pinned values: these must never change, or devices move partitions on upgrade.
    keys = ("dev-1", "dev-2", "dev-3", "dev-4")
    assert [partition_for(k, 3) for k in keys] == [2, 1, 0, 2]
    assert [partition_for(k, 10) for k in keys] == [3, 9, 1, 5]
    assert partition_for("dev-1", 1) == 0
    counts = [0, 0, 0]
    for i in range(3000):
        counts[partition_for(f"device-{i}", 3)] += 1
    assert min(counts) > 800, counts
    with pytest.raises(ValueError, match="partition count"):
        partition_for("x", 0)


def test_partition_function_pinned_values() -> None:
    # blake2b(digest_size=4) big-endian % count, computed independently.
    for key in ("dev-1", "ü-gerät", ""):
        h = int.from_bytes(hashlib.blake2b(key.encode(), digest_size=4).digest(), "big")
        assert partition_for(key, 7) == h % 7


def test_partitioner_groups_by_partition_keeping_order() -> None:
    records = [rec(i, f"d{i % 5}") for i in range(1, 101)]
    groups = KeyPartitioner().split("edge", "telemetry", 3, records)
    seen = [r.seq for _, g in groups for r in g]
    assert sorted(seen) == list(range(1, 101))
    for p, g in groups:
        assert all(partition_for(r.key, 3) == p for r in g)
        assert [r.seq for r in g] == sorted(r.seq for r in g)


async def test_send_stores_ids_headers_in_key_order() -> None:
    iggy = MemoryIggy(partitions=3)
    up = iggy.uplink()
    await up.start()
    batch = [rec(i, f"d{i % 4}") for i in range(1, 41)]
    await up.send(batch)
    assert iggy.count() == 40
    by_key = iggy.ids_by_key("edge", "telemetry")
    for key, ids in by_key.items():
        expected = [r.message_id for r in batch if r.key == key]
        assert ids == expected
        part = partition_for(key, 3)
        assert set(ids) <= set(iggy.ids("edge", "telemetry", part))
    msgs = iggy.messages("edge", "telemetry", partition_for("d1", 3))
    first = next(m for m in msgs if m.message_id == batch[0].message_id)
    assert first.payload == b"p1"
    assert first.headers["mqtt-topic"] == "edge/d1/up/t"
    assert [m.offset for m in msgs] == list(range(len(msgs)))


async def test_down_raises_unavailable_and_stores_nothing() -> None:
    iggy = MemoryIggy()
    up = iggy.uplink()
    iggy.down = True
    with pytest.raises(UplinkUnavailable) as ei:
        await up.send([rec(1, "a")])
    assert ei.value.confirmed == frozenset()
    assert iggy.count() == 0
    with pytest.raises(UplinkUnavailable):
        await up.start()
    iggy.down = False
    await up.send([rec(1, "a")])
    assert iggy.count() == 1


async def test_fail_next_after_one_group_reports_confirmed_prefix() -> None:
    iggy = MemoryIggy(partitions=1)
    up = iggy.uplink()
    batch = [rec(1, "a", "telemetry"), rec(2, "a", "acks"), rec(3, "b", "telemetry")]
    iggy.fail_next(1, after=1)
    with pytest.raises(UplinkUnavailable) as ei:
        await up.send(batch)
    # telemetry group (seqs 1 and 3) went first and was confirmed; acks failed.
    assert ei.value.confirmed == frozenset({1, 3})
    assert iggy.count("edge", "acks") == 0
    await up.send([batch[1]])
    assert iggy.count() == 3


async def test_ambiguous_failure_stores_a_real_duplicate() -> None:
    iggy = MemoryIggy(partitions=1)
    up = iggy.uplink()
    batch = [rec(1, "a"), rec(2, "a")]
    iggy.fail_next(1, ambiguous=True)
    with pytest.raises(UplinkAmbiguous) as ei:
        await up.send(batch)
    assert ei.value.confirmed == frozenset()
    await up.send(batch)  # the forwarder's retry
    ids = iggy.ids("edge", "telemetry", 0)
    assert ids == [r.message_id for r in batch] * 2  # duplicate, same ids


async def test_missing_topic_rejected_when_creation_disabled() -> None:
    iggy = MemoryIggy(create_missing=False)
    iggy.create_topic("edge", "telemetry")
    up = iggy.uplink()
    with pytest.raises(UplinkRejected) as ei:
        await up.send([rec(1, "a"), rec(2, "a", "nope")])
    assert ei.value.confirmed == frozenset({1})


async def test_validate_rejects_what_iggy_cannot_carry() -> None:
    iggy = MemoryIggy(validate=True)
    up = iggy.uplink()
    with pytest.raises(UplinkRejected, match="empty payload"):
        await up.send([rec(1, "a", payload=b"")])
    assert record_problem(rec(1, "a")) is None
    long = OutboundRecord(1, 1, "edge", "t", "k", b"x", {"mqtt-topic": "x" * 300})
    assert "255" in (record_problem(long) or "")
    assert wire_headers({"a": "1", "b": ""}) == {"a": "1"}


async def test_latency_is_applied_per_send() -> None:
    iggy = MemoryIggy(latency_s=0.05)
    up = iggy.uplink()
    t = time.monotonic()
    await up.send([rec(1, "a")])
    assert time.monotonic() - t >= 0.045


async def test_command_source_polls_from_offset_and_mirrors() -> None:
    iggy = MemoryIggy(partitions=2)
    for i in range(5):
        iggy.publish("edge", "commands", 1, f"c{i}".encode(), {"command-id": str(i)}, message_id=i + 1)
    src = iggy.command_source("iggy-edge-gw1")
    await src.start()
    first = await src.poll("edge", "commands", 1, 0, 3)
    assert [m.offset for m in first] == [0, 1, 2]
    assert first[1].payload == b"c1"
    assert first[1].headers == {"command-id": "1"}
    await src.mirror_offset("edge", "commands", 1, first[-1].offset)
    stored = iggy.stored_offset("iggy-edge-gw1", "edge", "commands", 1)
    assert stored == 2
    rest = await src.poll("edge", "commands", 1, stored + 1, 10)
    assert [m.offset for m in rest] == [3, 4]
    assert await src.poll("edge", "commands", 1, 5, 10) == []
    assert await src.poll("edge", "commands", 0, 0, 10) == []
    with pytest.raises(UplinkRejected):
        await src.poll("edge", "commands", 9, 0, 10)
    iggy.down = True
    with pytest.raises(UplinkUnavailable):
        await src.poll("edge", "commands", 1, 0, 1)
    with pytest.raises(UplinkUnavailable):
        await src.mirror_offset("edge", "commands", 1, 4)


async def test_keep_payloads_off_keeps_ids_only() -> None:
    iggy = MemoryIggy(keep_payloads=False, partitions=1)
    await iggy.uplink().send([rec(1, "a"), rec(2, "b")])
    assert iggy.ids("edge", "telemetry") == [rec(1, "a").message_id, rec(2, "b").message_id]
    assert iggy.partition("edge", "telemetry", 0).records == [None, None]


def _settings(tmp_path: Path, **iggy: object) -> Settings:
    raw = {"gateway_id": "gw1", "state_dir": str(tmp_path), "iggy": iggy}
    return parse_config(raw, env={})


async def test_factory_chooses_by_kind(tmp_path: Path) -> None:
    assert make_uplink(_settings(tmp_path)) is None  # default kind "none"
    assert make_command_source(_settings(tmp_path)) is None

    file_settings = _settings(tmp_path, kind="file", file_path=str(tmp_path / "u.jsonl"))
    up = make_uplink(file_settings)
    assert isinstance(up, FileUplink)
    assert make_command_source(file_settings) is None

    shared = MemoryIggy()
    set_shared_memory_iggy(shared)
    try:
        mem = _settings(tmp_path, kind="memory")
        mup = make_uplink(mem)
        src = make_command_source(mem)
        assert isinstance(mup, MemoryUplink)
        assert isinstance(src, MemoryCommandSource)
        await mup.send([rec(1, "a")])
        assert shared.count() == 1  # both views share the process-wide store
        shared.publish("edge", "commands", 0, b"go")
        assert [m.payload for m in await src.poll("edge", "commands", 0, 0, 10)] == [b"go"]
        assert src.consumer_name == "iggy-edge-gw1"
    finally:
        set_shared_memory_iggy(None)

    real = _settings(tmp_path, kind="iggy", address="127.0.0.1:8090")
    iup = make_uplink(real)
    assert isinstance(iup, IggyUplink)
    isrc = make_command_source(real)
    assert isinstance(isrc, IggyCommandSource)
    assert isrc.consumer_name == "iggy-edge-gw1"
