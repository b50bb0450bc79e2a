"""The MQTT codec against the bytes the MQTT 5.0 standard (OASIS) prescribes,
and round trips.  Section numbers are the standard's."""

from __future__ import annotations

import random

import pytest
from gmqtt.mqtt.constants import MQTTv50
from gmqtt.mqtt.handler import MqttPackageHandler
from iggy_edge import mqtt_codec as c

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("n", "wire"),
    [
        # 1.5.5, table 1-1: the boundaries of one to four bytes
        (0, "00"),
        (127, "7f"),
        (128, "8001"),
        (16_383, "ff7f"),
        (16_384, "808001"),
        (2_097_151, "ffff7f"),
        (2_097_152, "80808001"),
        (268_435_455, "ffffff7f"),
    ],
)
def test_varint_exact_bytes(n: int, wire: str) -> None:
    assert c.varint(n).hex() == wire
    assert c.read_varint(bytes.fromhex(wire)) == (n, len(wire) // 2)


def test_varint_bounds_and_malformed() -> None:
    with pytest.raises(ValueError, match="Variable Byte Integer"):
        c.varint(268_435_456)
    with pytest.raises(ValueError, match="Variable Byte Integer"):
        c.varint(-1)
    with pytest.raises(c.MalformedPacket):
        c.read_varint(b"\xff\xff\xff\xff\x01")
    assert c.read_varint(b"\x80\x80") is None  # cut short: wait for more bytes


@pytest.mark.parametrize(
    ("body_len", "header"), [(127, "307f"), (128, "308001"), (16_383, "30ff7f"), (16_384, "30808001")]
)
def test_remaining_length_boundaries(body_len: int, header: str) -> None:
    """2.1.4: the fixed header grows at 128 and 16,384 bytes of body."""
    topic = b"t"
    payload = b"x" * (body_len - 2 - len(topic))
    wire = c.publish(topic, payload)
    assert wire.hex().startswith(header)
    assert len(wire) == len(header) // 2 + body_len
    packets, used = c.split_packets(wire)
    assert used == len(wire)
    assert c.parse_publish(packets[0][0], packets[0][1], v5=False) == (0, 0, topic, payload, b"")


def test_connect_311_exact_bytes() -> None:
    # 3.1.2: protocol name, level 4, flags (clean session), keep alive 60; 3.1.3: client id
    assert (
        c.connect("abc", keepalive=60).hex() == "100f" + "00044d515454" + "04" + "02" + "003c" + "0003616263"
    )


def test_connect_5_with_session_expiry_exact_bytes() -> None:
    # 3.1.2.11: property length 5, session expiry interval (0x11) = 3600 as a four byte integer
    wire = c.connect("abc", keepalive=60, clean=False, version=c.MQTT5, props=[(0x11, 3600)])
    assert wire.hex() == "1015" + "00044d515454" + "05" + "00" + "003c" + "05" + "1100000e10" + "0003616263"


def test_connack() -> None:
    # 3.2.2.1.1: bit 0 of the acknowledge flags is session present
    assert c.parse_connack(b"\x01\x00") == (True, 0)
    assert c.parse_connack(b"\x00\x87\x00") == (False, 0x87)
    with pytest.raises(c.MalformedPacket):
        c.parse_connack(b"\x00")


def test_publish_exact_bytes() -> None:
    # 3.3.1: 0x30 | dup << 3 | qos << 1 | retain; 3.3.2: topic, packet id, properties (v5)
    assert c.publish("a/b", b"hi", qos=1, mid=10).hex() == "3209" + "0003612f62" + "000a" + "6869"
    assert (
        c.publish("a/b", b"hi", qos=1, mid=10, version=c.MQTT5).hex()
        == "320a" + "0003612f62" + "000a" + "00" + "6869"
    )
    assert c.publish(b"t", b"", qos=2, mid=1, retain=True, dup=True).hex() == "3d05" + "000174" + "0001"


def test_properties_exact_bytes() -> None:
    # 2.2.2.2: each property is an identifier (a varint) and a value of its type
    block = c.properties(
        [
            (0x01, 1),  # payload format indicator, byte
            (0x02, 60),  # message expiry interval, four byte integer
            (0x23, 5),  # topic alias, two byte integer
            (0x0B, 200),  # subscription identifier, varint (two bytes at 200)
            (0x03, "json"),  # content type, UTF-8 string
            (0x09, b"\x00\xff"),  # correlation data, binary
            (0x26, ("k", "v")),  # user property, string pair
        ]
    )
    body = (
        "0101"
        + "020000003c"
        + "230005"
        + "0bc801"
        + "03"
        + "00046a736f6e"
        + "09"
        + "000200ff"
        + "26"
        + "00016b"
        + "000176"
    )
    assert block.hex() == f"{len(body) // 2:02x}" + body
    assert c.properties() == b"\x00"
    assert c.parse_properties(block) == (
        [
            (0x01, 1),
            (0x02, 60),
            (0x23, 5),
            (0x0B, 200),
            (0x03, "json"),
            (0x09, b"\x00\xff"),
            (0x26, ("k", "v")),
        ],
        len(block),
    )


def test_properties_agree_with_gmqtt() -> None:
    """A second, independent decoder reads our property block the same way."""
    handler = MqttPackageHandler.__new__(MqttPackageHandler)
    handler.__dict__["_connection_state"] = type("S", (), {"protocol_version": MQTTv50})()
    block = c.properties([(0x02, 60), (0x26, ("k", "v")), (0x23, 5)])
    props, rest = handler._parse_properties(block + b"payload")  # noqa: SLF001 - gmqtt's own decoder
    assert rest == b"payload"
    assert props == {"message_expiry_interval": [60], "user_property": [("k", "v")], "topic_alias": [5]}


def test_publish_with_properties_comes_back_raw() -> None:
    props: list[tuple[int, int | str | bytes | tuple[str, str]]] = [(0x02, 60), (0x26, ("k", "v"))]
    wire = c.publish("a", b"p", qos=1, mid=3, version=c.MQTT5, props=props)
    ((first, body),) = c.split_packets(wire)[0]
    qos, mid, topic, payload, raw = c.parse_publish(first, body, v5=True)
    assert (qos, mid, topic, payload) == (1, 3, b"a", b"p")
    assert c.parse_properties(c.varint(len(raw)) + raw)[0] == props


def test_publish_round_trip() -> None:
    rnd = random.Random(5)
    for _ in range(2000):
        topic = bytes(rnd.randrange(256) for _ in range(rnd.randrange(1, 40)))
        payload = rnd.randbytes(rnd.choice([0, 1, 60, 127, 128, 300, 20_000]))
        qos = rnd.randrange(3)
        mid = rnd.randrange(1, 65536) if qos else 0
        v5 = rnd.random() < 0.5
        retain, dup = rnd.random() < 0.5, rnd.random() < 0.5
        wire = c.publish(
            topic, payload, qos=qos, mid=mid, retain=retain, dup=dup, version=c.MQTT5 if v5 else c.MQTT311
        )
        ((first, body),) = c.split_packets(wire)[0]
        assert first & 1 == retain
        assert (first >> 3) & 1 == dup
        assert c.parse_publish(first, body, v5) == (qos, mid, topic, payload, b"")


@pytest.mark.parametrize(
    ("cmd", "body", "v5"),
    [
        (0x36, b"\x00\x01t\x00\x01", False),  # QoS 3
        (0x30, b"\x00", False),  # no topic length
        (0x32, b"\x00\x05ab", False),  # topic longer than the packet
        (0x32, b"\x00\x01t\x00", False),  # packet id cut short
        (0x30, b"\x00\x01t", True),  # v5 without its property length
        (0x30, b"\x00\x01t\x05\x02", True),  # properties longer than the packet
    ],
)
def test_malformed_publish(cmd: int, body: bytes, v5: bool) -> None:
    with pytest.raises(c.MalformedPacket):
        c.parse_publish(cmd, body, v5)


def test_acks() -> None:
    # 3.4.2: packet id; a reason code of 0 with no properties may be left out (remaining length 2)
    assert c.ack(c.PUBACK, 0x1234).hex() == "40021234"
    assert c.ack(c.PUBREC, 1).hex() == "50020001"
    assert c.parse_ack(b"\x12\x34") == (0x1234, 0)
    assert c.parse_ack(b"\x12\x34\x87") == (0x1234, 0x87)  # not authorized
    assert c.parse_ack(b"\x12\x34\x10\x00") == (0x1234, 0x10)  # no matching subscribers, empty properties
    with pytest.raises(c.MalformedPacket):
        c.parse_ack(b"\x01")


def test_split_packets_keeps_a_partial_packet() -> None:
    stream = c.ack(c.PUBACK, 1) + c.PINGRESP_PACKET + c.publish("t", b"x" * 200)
    packets, used = c.split_packets(stream[:-5])
    assert packets == [(0x40, b"\x00\x01"), (0xD0, b"")]
    assert used == 6
    packets, used = c.split_packets(stream)
    assert len(packets) == 3
    assert used == len(stream)


def test_splitter_across_chunks() -> None:
    stream = c.ack(c.PUBACK, 7) + c.publish("t", b"y" * 300) + c.PINGRESP_PACKET
    s = c.Splitter()
    got = [p for i in range(0, len(stream), 5) for p in s.feed(stream[i : i + 5])]
    assert [first for first, _ in got] == [0x40, 0x30, 0xD0]
    assert s.feed(b"") == []
