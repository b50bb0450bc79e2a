"""The MQTT packet bytes the agent, its tests and its benchmarks write or read
themselves, in one tested place (MQTT 3.1.1 and 5.0).

gmqtt does the session; this module covers what we do around it:

* ingest's fast path parses the common PUBLISH (`parse_publish`) and packs the
  PUBACK/PUBREC of a whole group commit (`ack`);
* deliver reads the MQTT 5 reason code of a PUBACK (`parse_ack`), which gmqtt
  0.8 ignores;
* the test and benchmark publishers speak CONNECT, PUBLISH, PINGREQ and
  DISCONNECT on a raw socket, so every PUBACK is observed (`connect`,
  `publish`, `split_packets`).

Why not a library: `mqtt5` (Rust) is MQTT 5 only, decodes topics to `str`
(the agent must see a non-UTF-8 topic to dead-letter it) and cost 0.6 us
per PUBLISH read here, twice the lean parse below; gmqtt's own packers are tied
to its protocol object.  References are to the OASIS MQTT 5.0 standard.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from typing import Final

# Packet types (first byte, high nibble), 2.1.2
CONNECT: Final = 0x10
CONNACK: Final = 0x20
PUBLISH: Final = 0x30
PUBACK: Final = 0x40
PUBREC: Final = 0x50
PUBREL: Final = 0x60
PUBCOMP: Final = 0x70
SUBSCRIBE: Final = 0x80
SUBACK: Final = 0x90
PINGREQ: Final = 0xC0
PINGRESP: Final = 0xD0
DISCONNECT: Final = 0xE0

PINGREQ_PACKET: Final = b"\xc0\x00"
PINGRESP_PACKET: Final = b"\xd0\x00"
DISCONNECT_PACKET: Final = b"\xe0\x00"

MQTT311: Final = 4
MQTT5: Final = 5
MAX_VARINT: Final = 268_435_455  # 1.5.5: four bytes of seven bits
REFUSED: Final = 0x80  # reason codes >= 0x80 are failures, 2.4


class MalformedPacket(ValueError):
    """Bytes that are not a well-formed MQTT packet (the spec's 0x81)."""


# -- primitives (1.5) -------------------------------------------------------------

_U16: Final = struct.Struct("!H")
_U32: Final = struct.Struct("!I")
_ACK: Final = struct.Struct("!BBH")


def varint(n: int) -> bytes:
    """Variable Byte Integer, 1.5.5: 0..127 in one byte, up to 268,435,455 in four."""
    if not 0 <= n <= MAX_VARINT:
        raise ValueError(f"{n} does not fit a Variable Byte Integer")
    out = bytearray()
    while True:
        n, byte = divmod(n, 128)
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def read_varint(buf: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int] | None:
    """(value, position after it), or None when `buf` ends inside it.
    More than four bytes is malformed (1.5.5)."""
    value = 0
    for i in range(4):
        if pos + i >= len(buf):
            return None
        b = buf[pos + i]
        value |= (b & 0x7F) << (7 * i)
        if not b & 0x80:
            return value, pos + i + 1
    raise MalformedPacket("Variable Byte Integer longer than four bytes")


def string(s: str | bytes) -> bytes:
    """UTF-8 string or binary data with its two-byte length, 1.5.4 / 1.5.6."""
    b = s.encode() if isinstance(s, str) else s
    if len(b) > 0xFFFF:
        raise ValueError("string longer than 65,535 bytes")
    return _U16.pack(len(b)) + b


def packet(first: int, body: bytes) -> bytes:
    """Fixed header (type and flags, remaining length) + body, 2.1.1."""
    return bytes((first,)) + varint(len(body)) + body


def split_packets(buf: bytes | bytearray) -> tuple[list[tuple[int, bytes]], int]:
    """The whole packets at the start of `buf` as (first byte, body), and how
    many bytes they took; a partial packet at the end is left for later."""
    out: list[tuple[int, bytes]] = []
    pos = 0
    while pos + 2 <= len(buf):
        got = read_varint(buf, pos + 1)
        if got is None:
            break
        length, start = got
        if start + length > len(buf):
            break
        out.append((buf[pos], bytes(buf[start : start + length])))
        pos = start + length
    return out, pos


class Splitter:
    """Whole packets out of a byte stream read in arbitrary chunks."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[tuple[int, bytes]]:
        data = self._buf + chunk if self._buf else chunk
        packets, used = split_packets(data)
        self._buf = data[used:]
        return packets


# -- properties (2.2.2.2) ----------------------------------------------------------

# identifier -> data type, 2.2.2.2 table 2-4
BYTE, U16, U32, VARINT, UTF8, BINARY, PAIR = "byte", "u16", "u32", "varint", "utf8", "binary", "pair"
PROPERTY_TYPES: Final = {
    0x01: BYTE,  # payload format indicator
    0x02: U32,  # message expiry interval
    0x03: UTF8,  # content type
    0x08: UTF8,  # response topic
    0x09: BINARY,  # correlation data
    0x0B: VARINT,  # subscription identifier
    0x11: U32,  # session expiry interval
    0x12: UTF8,  # assigned client identifier
    0x13: U16,  # server keep alive
    0x15: UTF8,  # authentication method
    0x16: BINARY,  # authentication data
    0x17: BYTE,  # request problem information
    0x18: U32,  # will delay interval
    0x19: BYTE,  # request response information
    0x1A: UTF8,  # response information
    0x1C: UTF8,  # server reference
    0x1F: UTF8,  # reason string
    0x21: U16,  # receive maximum
    0x22: U16,  # topic alias maximum
    0x23: U16,  # topic alias
    0x24: BYTE,  # maximum QoS
    0x25: BYTE,  # retain available
    0x26: PAIR,  # user property
    0x27: U32,  # maximum packet size
    0x28: BYTE,  # wildcard subscription available
    0x29: BYTE,  # subscription identifier available
    0x2A: BYTE,  # shared subscription available
}
PropertyValue = int | str | bytes | tuple[str, str]


def properties(props: Iterable[tuple[int, PropertyValue]] = ()) -> bytes:
    """A property block: its length (a Variable Byte Integer), then each
    property as identifier + value.  An empty block is the single byte 0."""
    out = bytearray()
    for pid, value in props:
        kind = PROPERTY_TYPES.get(pid)
        if kind is None:
            raise ValueError(f"unknown property 0x{pid:02x}")
        out += varint(pid)
        if kind == PAIR:
            assert isinstance(value, tuple)
            out += string(value[0]) + string(value[1])
        elif kind in (UTF8, BINARY):
            assert isinstance(value, str | bytes)
            out += string(value)
        else:
            assert isinstance(value, int)
            if kind == BYTE:
                out.append(value)
            elif kind == U16:
                out += _U16.pack(value)
            elif kind == U32:
                out += _U32.pack(value)
            else:
                out += varint(value)
    return varint(len(out)) + bytes(out)


def parse_properties(buf: bytes, pos: int = 0) -> tuple[list[tuple[int, PropertyValue]], int]:
    """Decode the property block at `pos`: (properties in order, position after it)."""
    got = read_varint(buf, pos)
    if got is None:
        raise MalformedPacket("property length cut short")
    length, pos = got
    end = pos + length
    if end > len(buf):
        raise MalformedPacket("property block longer than the packet")
    out: list[tuple[int, PropertyValue]] = []

    def take_string() -> bytes:
        nonlocal pos
        if pos + 2 > end:
            raise MalformedPacket("string cut short")
        (n,) = _U16.unpack_from(buf, pos)
        if pos + 2 + n > end:
            raise MalformedPacket("string cut short")
        pos += 2 + n
        return buf[pos - n : pos]

    while pos < end:
        ident = read_varint(buf, pos)
        if ident is None:
            raise MalformedPacket("property identifier cut short")
        pid, pos = ident
        kind = PROPERTY_TYPES.get(pid)
        value: PropertyValue
        if kind is None:
            raise MalformedPacket(f"unknown property 0x{pid:02x}")
        if kind == BYTE:
            if pos + 1 > end:
                raise MalformedPacket("byte property cut short")
            value, pos = buf[pos], pos + 1
        elif kind in (U16, U32):
            width = 2 if kind == U16 else 4
            if pos + width > end:
                raise MalformedPacket("integer property cut short")
            value = int.from_bytes(buf[pos : pos + width], "big")
            pos += width
        elif kind == VARINT:
            got = read_varint(buf, pos)
            if got is None or got[1] > end:
                raise MalformedPacket("varint property cut short")
            value, pos = got
        elif kind == BINARY:
            value = take_string()
        elif kind == UTF8:
            value = take_string().decode()
        else:
            value = (take_string().decode(), take_string().decode())
        out.append((pid, value))
    return out, end


# -- packets ----------------------------------------------------------------------


def connect(
    client_id: str,
    *,
    keepalive: int = 60,
    clean: bool = True,
    version: int = MQTT311,
    props: Sequence[tuple[int, PropertyValue]] = (),
) -> bytes:
    """CONNECT without will, user name or password (3.1)."""
    flags = 0x02 if clean else 0x00
    body = string(b"MQTT") + bytes((version, flags)) + _U16.pack(keepalive)
    if version >= MQTT5:
        body += properties(props)
    return packet(CONNECT, body + string(client_id))


def parse_connack(body: bytes) -> tuple[bool, int]:
    """(session present, reason code) of a CONNACK body (3.2.2)."""
    if len(body) < 2:
        raise MalformedPacket("CONNACK shorter than two bytes")
    return bool(body[0] & 1), body[1]


def publish(
    topic: str | bytes,
    payload: bytes,
    *,
    qos: int = 0,
    mid: int = 0,
    retain: bool = False,
    dup: bool = False,
    version: int = MQTT311,
    props: Sequence[tuple[int, PropertyValue]] = (),
) -> bytes:
    """PUBLISH (3.3).  A bytes topic is sent as it is (tests send invalid ones)."""
    first = PUBLISH | (0x08 if dup else 0) | qos << 1 | int(retain)
    body = string(topic)
    if qos:
        body += _U16.pack(mid)
    if version >= MQTT5:
        body += properties(props)
    return packet(first, body + payload)


# (qos, packet id or 0, topic bytes, payload, property block without its length)
Publish = tuple[int, int, bytes, bytes, bytes]


def parse_publish(cmd: int, body: bytes, v5: bool) -> Publish:
    """Split a PUBLISH body (3.3.2); `cmd` is the first byte.  The property
    block comes back raw (b"" when empty) so the hot path pays nothing for it."""
    qos = (cmd >> 1) & 3
    if qos == 3:
        raise MalformedPacket("PUBLISH with QoS 3")
    if len(body) < 2:
        raise MalformedPacket("PUBLISH without a topic length")
    pos = topic_end = 2 + (body[0] << 8 | body[1])
    mid = 0
    if qos:
        if len(body) < pos + 2:
            raise MalformedPacket("PUBLISH cut short before its packet id")
        mid = body[pos] << 8 | body[pos + 1]
        pos += 2
    topic = body[2:topic_end]
    props = b""
    if v5:
        if len(body) <= pos:
            raise MalformedPacket("PUBLISH cut short before its properties")
        if body[pos]:  # the common case: an empty block, one zero byte
            got = read_varint(body, pos)
            if got is None or got[0] + got[1] > len(body):
                raise MalformedPacket("PUBLISH properties longer than the packet")
            props = body[got[1] : got[1] + got[0]]
            pos = got[1] + got[0]
        else:
            pos += 1
    elif len(body) < pos:
        raise MalformedPacket("PUBLISH topic longer than the packet")
    return qos, mid, topic, body[pos:], props


def ack(cmd: int, mid: int) -> bytes:
    """PUBACK/PUBREC/PUBCOMP with success: remaining length 2, the same bytes
    in MQTT 3.1.1 and 5 (a reason code of 0 without properties may be left
    out, 3.4.2.1)."""
    return _ACK.pack(cmd, 2, mid)


def parse_ack(body: bytes) -> tuple[int, int]:
    """(packet id, reason code) of a PUBACK/PUBREC/PUBREL/PUBCOMP body
    (3.4.2); a missing reason code means 0 (success)."""
    if len(body) < 2:
        raise MalformedPacket("acknowledgement without a packet id")
    mid = body[0] << 8 | body[1]
    return mid, body[2] if len(body) > 2 else 0
