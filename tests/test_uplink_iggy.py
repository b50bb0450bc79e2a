"""IggyUplink / IggyCommandSource / IggyCommandSink against a real iggy-server.

Skipped with a reason when `iggy-server` is not on PATH (see
tests/support/iggy_server.py).
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
from apache_iggy import Consumer, Durability, PollingStrategy
from iggy_edge.config import IggySettings
from iggy_edge.records import (
    HEADER_GATEWAY,
    HEADER_MQTT_TOPIC,
    HEADER_RECEIVED_US,
    OutboundRecord,
    gateway_hash32,
    make_message_id,
)
from iggy_edge.uplink.iggy import (
    CREATE_TOPIC_CODE,
    IggyCommandSink,
    IggyCommandSource,
    IggyProbe,
    IggyUplink,
    classify,
    decode_consumer_offset,
    encode_create_topic,
    encode_get_consumer_offset,
    encode_store_consumer_offset,
)
from iggy_edge.uplink.iggy import send as send_module
from iggy_edge.uplink.iggy.connection import Connection
from iggy_edge.uplink.partition import partition_for
from iggy_edge.uplink.protocol import (
    PolledMessage,
    UplinkAmbiguous,
    UplinkRejected,
    UplinkUnavailable,
)
from pydantic import SecretStr

from tests.support.iggy_server import IggyServer, iggy_tls_server  # noqa: F401 -- fixture
from tests.support.ports import free_port

GW = "gw-test"


def settings_for(server: IggyServer, **kw: object) -> IggySettings:
    base: dict[str, object] = {
        "kind": "iggy",
        "address": server.address,
        "username": server.username,
        "password": SecretStr(server.password),
        "request_timeout_s": 5.0,
        "connect_timeout_s": 5.0,
        "partitions": 3,
    }
    base.update(kw)
    return IggySettings.model_validate(base)


def rec(seq: int, key: str, topic: str = "telemetry") -> OutboundRecord:
    return OutboundRecord(
        seq=seq,
        message_id=make_message_id(gateway_hash32(GW), 0x1234, seq),
        stream="edge",
        topic=topic,
        key=key,
        payload=f'{{"seq": {seq}}}'.encode(),
        headers={
            HEADER_MQTT_TOPIC: f"edge/{key}/up/temp",
            HEADER_GATEWAY: GW,
            HEADER_RECEIVED_US: str(1_700_000_000_000_000 + seq),
        },
    )


async def read_all(source: IggyCommandSource, topic: str, partitions: int) -> dict[int, list[PolledMessage]]:
    out: dict[int, list[PolledMessage]] = {}
    for p in range(partitions):
        out[p] = await source.poll("edge", topic, p, 0, 10_000)
    return out


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        ("Not connected", UplinkUnavailable),
        ("Cannot establish connection", UplinkUnavailable),
        ("Unauthenticated", UplinkUnavailable),
        ("Invalid credentials", UplinkUnavailable),
        ("Request transiently not accepted; retry, on any replica", UplinkUnavailable),
        ("Disconnected", UplinkAmbiguous),
        ("Connection closed", UplinkAmbiguous),
        ("Request transiently not committed; retry", UplinkAmbiguous),
        ("Topic with name: x for stream with ID: edge was not found.", UplinkRejected),
        ("Unauthorized", UplinkRejected),
        ("Invalid message payload length", UplinkRejected),
    ],
)
def test_sdk_error_texts_map_to_our_classes(text: str, kind: type) -> None:
    assert classify(RuntimeError(text)) is kind


def test_timeouts_are_ambiguous_and_os_errors_unavailable() -> None:
    assert classify(TimeoutError()) is UplinkAmbiguous
    assert classify(ConnectionRefusedError()) is UplinkUnavailable


def test_consumer_offset_wire_format() -> None:
    # kind 1 (single consumer) + string identifier (kind 2, len, bytes) x3 + flag + u32 LE
    get = b"\x01" + b"\x02\x01g" + b"\x02\x04edge" + b"\x02\x03cmd" + b"\x01\x05\x00\x00\x00"
    assert encode_get_consumer_offset("g", "edge", "cmd", 5) == get
    # ... + offset u64 LE + ack level (1 = quorum)
    assert encode_store_consumer_offset("g", "edge", "cmd", 5, 7) == get + (7).to_bytes(8, "little") + b"\x01"
    reply = (1).to_bytes(4, "little") + (9).to_bytes(8, "little") + (7).to_bytes(8, "little")
    assert decode_consumer_offset(reply) == 7
    assert decode_consumer_offset(b"") is None
    with pytest.raises(ValueError, match="20"):
        decode_consumer_offset(b"\x00" * 5)


def test_create_topic_wire_format() -> None:
    # stream identifier, partitions u32 LE, name (len u8 + bytes), options as
    # (key kind, key len u32 LE, key, value kind, value len u32 LE, value)
    assert encode_create_topic("edge", "t", 3, [("enforce_fsync", "true")]) == (
        b"\x02\x04edge"
        + b"\x03\x00\x00\x00"
        + b"\x01t"
        + b"\x02\x0d\x00\x00\x00enforce_fsync"
        + b"\x02\x04\x00\x00\x00true"
    )


class FakeWorld:
    """What a fake SDK client sees: topics, stored sends, and a script of
    outcomes for the next send_messages calls ("ok", "hang", or an error text)."""

    def __init__(self, partitions: int = 3) -> None:
        self.partitions = partitions
        self.streams: set[str] = set()
        self.topics: dict[tuple[str, str], int] = {}
        self.created_topics: list[tuple[str, str, int, object]] = []
        self.sent: list[tuple[str, str, int, list[OutboundRecord]]] = []
        self.script: list[str] = []
        self.clients: list[FakeClient] = []
        self.refuse = False
        self.password = "pw"
        self.knows_durability = True  # False: like server 0.9.0-edge.5
        self.binary_requests: list[tuple[int, bytes]] = []

    def factory(self, config: object) -> Any:  # a FakeClient where the SDK makes an IggyClient
        c = FakeClient(self)
        self.clients.append(c)
        return c


class FakeClient:
    def __init__(self, world: FakeWorld) -> None:
        self.w = world
        self.logged_in = False

    async def connect(self) -> None:
        if self.w.refuse:
            raise RuntimeError("Cannot establish connection")

    async def login_user(self, username: str, password: str) -> None:
        if password != self.w.password:
            raise RuntimeError("Invalid credentials")
        self.logged_in = True

    async def logout_user(self) -> None:
        pass

    async def get_topic(self, stream: str, topic: str) -> SimpleNamespace | None:
        if stream not in self.w.streams:
            raise RuntimeError(f"Stream with name: {stream} was not found.")
        n = self.w.topics.get((stream, topic))
        return None if n is None else SimpleNamespace(partitions_count=n)

    async def create_stream(self, name: str) -> None:
        if name in self.w.streams:
            raise RuntimeError(f"Stream with name: {name} already exists.")
        self.w.streams.add(name)

    async def create_topic(
        self, stream: str, name: str, partitions_count: int, durability: object = None
    ) -> None:
        if not self.w.knows_durability:
            raise RuntimeError("Unsupported option key: ")
        if (stream, name) in self.w.topics:
            raise RuntimeError(f"Topic with name: {name} for stream with ID: 1 already exists.")
        self.w.topics[(stream, name)] = partitions_count
        self.w.created_topics.append((stream, name, partitions_count, durability))

    async def send_binary_request(self, code: int, payload: bytes) -> bytes:
        self.w.binary_requests.append((code, payload))
        if code == CREATE_TOPIC_CODE:
            # stream identifier (kind, len, name), partitions u32, name (len, bytes)
            n = payload[1]
            stream = payload[2 : 2 + n].decode()
            pos = 2 + n
            partitions = int.from_bytes(payload[pos : pos + 4], "little")
            length = payload[pos + 4]
            name = payload[pos + 5 : pos + 5 + length].decode()
            self.w.topics[(stream, name)] = partitions
            self.w.created_topics.append((stream, name, partitions, payload[pos + 5 + length :]))
        return b""

    async def send_messages(
        self, stream: str, topic: str, partition: int, messages: list[OutboundRecord]
    ) -> SimpleNamespace:
        outcome = self.w.script.pop(0) if self.w.script else "ok"
        if outcome == "hang":
            await asyncio.sleep(60)
        if outcome != "ok":
            raise RuntimeError(outcome)
        self.w.sent.append((stream, topic, partition, messages))
        return SimpleNamespace(confirmations=[])


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> FakeWorld:
    # SendMessage is opaque; let the fake see our records instead.
    monkeypatch.setattr(send_module, "_to_send_message", lambda r: r)
    return FakeWorld()


def fake_settings(**kw: object) -> IggySettings:
    base: dict[str, object] = {
        "kind": "iggy",
        "address": "127.0.0.1:8090",
        "password": SecretStr("pw"),
        "request_timeout_s": 0.3,
        "connect_timeout_s": 0.3,
        "partitions": 3,
    }
    base.update(kw)
    return IggySettings.model_validate(base)


async def test_fake_create_missing_uses_persisted_durability(fake: FakeWorld) -> None:
    up = IggyUplink(fake_settings(), GW, topics=[("edge", "telemetry")], client_factory=fake.factory)
    await up.start()
    assert fake.created_topics == [("edge", "telemetry", 3, Durability.PERSISTED)]
    up2 = IggyUplink(fake_settings(), GW, topics=[("edge", "telemetry")], client_factory=fake.factory)
    await up2.start()  # exists: nothing created
    assert len(fake.created_topics) == 1
    off = IggyUplink(fake_settings(create_missing=False), GW, client_factory=fake.factory)
    with pytest.raises(UplinkRejected, match="create_missing"):
        await off.send([rec(1, "a", topic="acks")])


async def test_fake_server_without_durability_keys_gets_fsync_options(fake: FakeWorld) -> None:
    # Server 0.9.0-edge.5 refuses the durability keys SDK 0.9.0 sends
    # ("Unsupported option key"); the topic is then created by a raw request
    # asking for fsync and a flush per message.
    fake.knows_durability = False
    up = IggyUplink(fake_settings(), GW, topics=[("edge", "telemetry")], client_factory=fake.factory)
    await up.start()
    bare = encode_create_topic("edge", "telemetry", 3)
    full = encode_create_topic(
        "edge", "telemetry", 3, [("enforce_fsync", "true"), ("messages_required_to_save", "1")]
    )
    assert fake.binary_requests == [(CREATE_TOPIC_CODE, full)]
    assert fake.created_topics == [("edge", "telemetry", 3, full[len(bare) :])]
    assert len(fake.clients) == 1  # a refused option is an answer, not a broken connection


async def test_fake_send_groups_by_partition_one_request_each(fake: FakeWorld) -> None:
    up = IggyUplink(fake_settings(), GW, client_factory=fake.factory)
    batch = [rec(i, f"d{i % 5}") for i in range(1, 31)] + [rec(99, "d1", topic="acks")]
    await up.send(batch)
    requests = {(s, t, p): [r.seq for r in rs] for s, t, p, rs in fake.sent}
    assert len(fake.sent) == len(requests)  # one request per (stream, topic, partition)
    for (_, topic, p), seqs in requests.items():
        for seq in seqs:
            r = next(x for x in batch if x.seq == seq and x.topic == topic)
            assert partition_for(r.key, 3) == p
        assert seqs == sorted(seqs)
    assert sum(len(v) for v in requests.values()) == 31


@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_fake_timeout_is_ambiguous_with_confirmed_and_reconnects(fake: FakeWorld) -> None:
    fake.streams.add("edge")
    fake.topics[("edge", "telemetry")] = 1
    fake.topics[("edge", "acks")] = 1
    up = IggyUplink(fake_settings(), GW, client_factory=fake.factory)
    fake.script = ["ok", "hang"]
    t = time.monotonic()
    with pytest.raises(UplinkAmbiguous) as ei:
        await up.send([rec(1, "a"), rec(2, "a", topic="acks")])
    assert time.monotonic() - t < 1.0
    assert ei.value.confirmed == frozenset({1})
    assert len(fake.clients) == 1
    await up.send([rec(2, "a", topic="acks")])
    assert len(fake.clients) == 2  # the old client was dropped, a new one built


@pytest.mark.parametrize(
    ("text", "kind", "reconnects"),
    [
        ("Not connected", UplinkUnavailable, True),
        ("Disconnected", UplinkAmbiguous, True),
        ("Unauthorized", UplinkRejected, False),
    ],
)
async def test_fake_send_errors_are_mapped(fake: FakeWorld, text: str, kind: type, reconnects: bool) -> None:
    up = IggyUplink(fake_settings(), GW, client_factory=fake.factory)
    fake.script = [text]
    with pytest.raises(kind) as ei:
        await up.send([rec(1, "a")])
    assert type(ei.value) is kind
    await up.send([rec(1, "a")])
    assert len(fake.clients) == (2 if reconnects else 1)


async def test_fake_vanished_topic_is_looked_up_again(fake: FakeWorld) -> None:
    up = IggyUplink(fake_settings(), GW, client_factory=fake.factory)
    await up.send([rec(1, "a")])
    fake.topics.clear()
    fake.script = ["Topic with name: telemetry for stream with ID: 1 was not found."]
    with pytest.raises(UplinkUnavailable):
        await up.send([rec(2, "a")])
    await up.send([rec(2, "a")])  # recreated on the next attempt
    assert ("edge", "telemetry") in fake.topics


async def test_fake_connect_and_login_failures_are_unavailable(fake: FakeWorld) -> None:
    fake.refuse = True
    with pytest.raises(UplinkUnavailable, match="cannot connect"):
        await IggyUplink(fake_settings(), GW, client_factory=fake.factory).start()
    fake.refuse = False
    with pytest.raises(UplinkUnavailable, match="log in"):
        await IggyUplink(fake_settings(password=SecretStr("bad")), GW, client_factory=fake.factory).start()


async def test_fake_probe_reads_without_creating_and_reports_login_failures(fake: FakeWorld) -> None:
    async with IggyProbe(fake_settings(), timeout_s=0.3, client_factory=fake.factory) as probe:
        assert await probe.topic("edge", "telemetry") is None  # the stream is missing: no topic
        fake.streams.add("edge")
        fake.topics[("edge", "telemetry")] = 3
        found = await probe.topic("edge", "telemetry")
        assert found is not None
        assert found.partitions_count == 3
    assert fake.created_topics == []
    assert fake.streams == {"edge"}  # a probe creates nothing
    fake.refuse = True
    with pytest.raises(UplinkUnavailable, match="cannot connect"):
        async with IggyProbe(fake_settings(), timeout_s=0.3, client_factory=fake.factory):
            pass


@pytest.mark.iggy
async def test_send_keeps_ids_headers_order_and_partition_per_key(iggy_server: IggyServer) -> None:
    s = settings_for(iggy_server)
    up = IggyUplink(s, GW, topics=[("edge", "telemetry")])
    await up.start()
    keys = [f"dev-{i}" for i in range(7)]
    batch1 = [rec(i, keys[i % 7]) for i in range(1, 71)]
    batch2 = [rec(i, keys[i % 7]) for i in range(71, 141)]
    await up.send(batch1)
    await up.send(batch2)
    await up.close()

    source = IggyCommandSource(s, GW, "iggy-edge-reader")
    by_partition = await read_all(source, "telemetry", 3)
    await source.close()

    sent = {r.message_id: r for r in batch1 + batch2}
    seen: dict[str, list[int]] = {}
    total = 0
    for p, messages in by_partition.items():
        assert [m.offset for m in messages] == list(range(len(messages)))
        for m in messages:
            r = sent[m.message_id]  # our 128-bit id came back exactly
            assert partition_for(r.key, 3) == p
            assert m.payload == r.payload
            assert m.headers == r.headers
            assert m.timestamp_us > 0
            seen.setdefault(r.key, []).append(r.seq)
            total += 1
    assert total == 140
    for key in keys:
        assert seen[key] == [r.seq for r in batch1 + batch2 if r.key == key]
    assert len([p for p, msgs in by_partition.items() if msgs]) > 1  # keys spread


@pytest.mark.iggy
async def test_create_missing_makes_stream_and_topic_and_tolerates_races(
    iggy_server: IggyServer,
) -> None:
    s = settings_for(iggy_server, partitions=4)
    ups = [IggyUplink(s, GW, topics=[("edge", "telemetry"), ("edge", "acks")]) for _ in range(3)]
    await asyncio.gather(*(u.start() for u in ups))  # "already exists" is not an error

    conn = Connection(s, "test admin")
    client = await conn.client()
    for name in ("telemetry", "acks"):
        topic = await client.get_topic("edge", name)
        assert topic is not None
        assert topic.partitions_count == 4
    stream = await client.get_stream("edge")
    assert stream is not None
    assert stream.topics_count == 2
    for u in ups:
        await u.close()
    await conn.close()


@pytest.mark.iggy
async def test_missing_topic_without_create_is_rejected_with_confirmed_prefix(
    iggy_server: IggyServer,
) -> None:
    creator = IggyUplink(settings_for(iggy_server), GW, topics=[("edge", "telemetry")])
    await creator.start()
    await creator.close()

    up = IggyUplink(settings_for(iggy_server, create_missing=False), GW)
    await up.start()
    batch = [rec(1, "a"), rec(2, "b", topic="nope"), rec(3, "a")]
    with pytest.raises(UplinkRejected) as ei:
        await up.send(batch)
    assert "nope" in str(ei.value)
    assert ei.value.confirmed == frozenset({1, 3})  # the telemetry group went first
    await up.close()

    source = IggyCommandSource(settings_for(iggy_server), GW, "reader")
    stored = await read_all(source, "telemetry", 3)
    assert sorted(m.message_id for msgs in stored.values() for m in msgs) == sorted(
        [rec(1, "a").message_id, rec(3, "a").message_id]
    )
    await source.close()


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_stopped_server_fails_fast_and_reconnects_when_back(
    iggy_server: IggyServer,
) -> None:
    s = settings_for(iggy_server, request_timeout_s=3.0, connect_timeout_s=3.0)
    up = IggyUplink(s, GW, topics=[("edge", "telemetry")])
    await up.start()
    await up.send([rec(1, "a")])

    iggy_server.stop()
    t = time.monotonic()
    with pytest.raises((UplinkUnavailable, UplinkAmbiguous)) as first:
        await up.send([rec(2, "a")])
    assert time.monotonic() - t < 3.0 + 1.0
    assert first.value.confirmed == frozenset()
    # The connection is now known to be gone: nothing can leave, and quickly.
    t = time.monotonic()
    with pytest.raises(UplinkUnavailable):
        await up.send([rec(2, "a")])
    assert time.monotonic() - t < 3.0 + 1.0

    iggy_server.start()
    await up.send([rec(2, "a"), rec(3, "a")])  # reconnects on its own
    await up.close()

    source = IggyCommandSource(s, GW, "reader")
    msgs = await source.poll("edge", "telemetry", partition_for("a", 3), 0, 100)
    await source.close()
    # Record 1 survived the restart (persisted durability); an ambiguous first
    # failure could at most have added a copy of record 2 with the same id.
    seqs = [m.message_id & 0xFFFFFFFFFFFFFFFF for m in msgs]
    assert seqs[0] == 1
    assert seqs[-2:] == [2, 3]
    assert set(seqs) == {1, 2, 3}


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_unreachable_and_bad_login_raise_unavailable_in_time(
    iggy_server: IggyServer,
) -> None:
    closed = settings_for(iggy_server, address=f"127.0.0.1:{free_port()}", connect_timeout_s=2.0)
    t = time.monotonic()
    with pytest.raises(UplinkUnavailable):
        await IggyUplink(closed, GW).start()
    assert time.monotonic() - t < 3.0

    wrong = settings_for(iggy_server, password=SecretStr("wrong"))
    with pytest.raises(UplinkUnavailable, match="log in"):
        await IggyUplink(wrong, GW).start()


@pytest.mark.iggy
async def test_offset_mirror_is_stored_on_the_server_and_polling_resumes_after_it(
    iggy_server: IggyServer,
) -> None:
    s = settings_for(iggy_server, partitions=2)
    sink = IggyCommandSink(s)
    offsets = []
    for i in range(10):
        offsets.append(
            await sink.publish(
                "edge",
                "commands",
                1,
                f'{{"cmd": {i}}}'.encode(),
                {"command-id": f"c{i}", "device": "dev-1"},
                message_id=1000 + i,
            )
        )
    await sink.close()
    assert offsets == list(range(10))

    source = IggyCommandSource(s, GW, f"iggy-edge-{GW}")
    await source.start()
    assert await source.read_mirrored_offset("edge", "commands", 1) is None
    first = await source.poll("edge", "commands", 1, 0, 4)
    assert [m.offset for m in first] == [0, 1, 2, 3]
    assert [m.message_id for m in first] == [1000, 1001, 1002, 1003]
    assert first[2].headers == {"command-id": "c2", "device": "dev-1"}
    # Polling stored nothing on the server (no auto-commit).
    assert await source.read_mirrored_offset("edge", "commands", 1) is None

    await source.mirror_offset("edge", "commands", 1, first[-1].offset)
    assert await source.read_mirrored_offset("edge", "commands", 1) == 3
    await source.close()

    # A new connection (a restarted agent, or the cloud side) sees it, and
    # resuming at stored + 1 continues exactly after it.
    again = IggyCommandSource(s, GW, f"iggy-edge-{GW}")
    stored = await again.read_mirrored_offset("edge", "commands", 1)
    assert stored == 3
    rest = await again.poll("edge", "commands", 1, stored + 1, 100)
    assert [m.offset for m in rest] == [4, 5, 6, 7, 8, 9]
    assert rest[0].payload == b'{"cmd": 4}'
    # The cloud side's view: the server's own "next" for our consumer.
    conn = Connection(s, "test cloud")
    client = await conn.client()
    nxt = await client.poll_messages(
        "edge",
        "commands",
        consumer=Consumer.Single(f"iggy-edge-{GW}"),
        polling_strategy=PollingStrategy.Next(),
        count=2,
        auto_commit=False,
        partition_id=1,
    )
    assert [m.offset() for m in nxt] == [4, 5]
    await conn.close()
    # Offsets of other partitions and other gateways are separate.
    assert await again.read_mirrored_offset("edge", "commands", 0) is None
    other = IggyCommandSource(s, "gw-other", "iggy-edge-gw-other")
    assert await other.read_mirrored_offset("edge", "commands", 1) is None
    # SQLite is the truth: the mirror follows it even backwards.
    await again.mirror_offset("edge", "commands", 1, 9)
    await again.mirror_offset("edge", "commands", 1, 5)
    assert await again.read_mirrored_offset("edge", "commands", 1) == 5
    await again.close()
    await other.close()


@pytest.mark.iggy
async def test_topics_we_create_keep_confirmed_sends_across_a_kill(iggy_server: IggyServer) -> None:
    # The server confirms a send once committed; with its defaults a committed
    # message waits in memory until 1024 are pending, so SIGKILL loses it.
    s = settings_for(iggy_server, partitions=1)
    up = IggyUplink(s, GW, topics=[("edge", "telemetry")])
    await up.start()
    conn = Connection(s, "test admin")
    client = await conn.client()
    topic = await client.get_topic("edge", "telemetry")
    assert topic is not None
    assert topic.options.to_scalar_dict() == {"enforce_fsync": True, "messages_required_to_save": 1}
    await conn.close()
    for i in range(1, 21):
        await up.send([rec(i, "a")])
    await up.close()

    iggy_server.kill()
    iggy_server.start()
    source = IggyCommandSource(s, GW, "reader")
    msgs = await source.poll("edge", "telemetry", 0, 0, 100)
    await source.close()
    assert [m.message_id & 0xFFFFFFFFFFFFFFFF for m in msgs] == list(range(1, 21))


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_frozen_server_times_out_within_request_timeout(iggy_server: IggyServer) -> None:
    s = settings_for(iggy_server, request_timeout_s=1.5, connect_timeout_s=1.5)
    up = IggyUplink(s, GW, topics=[("edge", "telemetry")])
    await up.start()
    await up.send([rec(1, "a")])
    iggy_server.pause()
    try:
        t = time.monotonic()
        with pytest.raises(UplinkAmbiguous, match="no answer within"):
            await up.send([rec(2, "a")])
        assert time.monotonic() - t < 1.5 + 0.5
        # The next attempt reconnects: the port accepts, the login is never
        # answered -> nothing was sent.
        t = time.monotonic()
        with pytest.raises(UplinkUnavailable):
            await up.send([rec(2, "a")])
        assert time.monotonic() - t < 1.5 + 0.5
    finally:
        iggy_server.resume()
    await up.send([rec(3, "a")])
    await up.close()


@pytest.mark.iggy
@pytest.mark.xdist_group("timing")  # wall-clock bounds: one after another on one xdist worker
async def test_tls_validates_against_the_configured_ca(iggy_tls_server: IggyServer) -> None:  # noqa: F811
    server = iggy_tls_server
    assert server.tls is not None
    ok = settings_for(server, tls=True, tls_ca_file=server.tls.ca_file)
    up = IggyUplink(ok, GW, topics=[("edge", "telemetry")])
    await up.start()
    await up.send([rec(1, "a")])
    await up.close()
    named = settings_for(server, tls=True, tls_ca_file=server.tls.ca_file, tls_domain="localhost")
    up = IggyUplink(named, GW)
    await up.start()
    await up.close()
    # The certificate is validated: no CA (system roots), a wrong name, and
    # plain TCP against the TLS port all fail as "unavailable", in time.
    for bad in (
        settings_for(server, tls=True),
        settings_for(server, tls=True, tls_ca_file=server.tls.ca_file, tls_domain="example.com"),
        settings_for(server),
    ):
        t = time.monotonic()
        with pytest.raises(UplinkUnavailable):
            await IggyUplink(bad, GW).start()
        assert time.monotonic() - t < 5.0


@pytest.mark.iggy
async def test_probe_sees_topics_streams_and_the_user(iggy_server: IggyServer) -> None:
    s = settings_for(iggy_server)
    async with IggyProbe(s, timeout_s=5.0) as probe:
        assert await probe.topic("edge", "telemetry") is None  # nothing created yet
        up = IggyUplink(s, GW, topics=[("edge", "telemetry")])
        await up.start()
        await up.close()
        topic = await probe.topic("edge", "telemetry")
        assert topic is not None
        assert topic.partitions_count == 3
        stream = await probe.stream("edge")
        assert stream is not None
        assert stream.topics_count == 1
        user = await probe.user(iggy_server.username)
        assert user is not None
        assert user.username == iggy_server.username
    wrong = settings_for(iggy_server, password=SecretStr("wrong"))
    with pytest.raises(UplinkUnavailable, match="log in"):
        async with IggyProbe(wrong, timeout_s=5.0):
            pass
