"""The server-side mirror of the return path's read offsets.

The Python SDK 0.9.0 has no ``store_consumer_offset`` /
``get_consumer_offset``, and the consumer-group route does not work on
edge.5: the server fences a group offset commit to a member that currently
owns the partition, so a group consumer that never joins gets "Resource with
key:  was not found."  We send STORE_CONSUMER_OFFSET (121) and
GET_CONSUMER_OFFSET (120) raw, for the single consumer ``consumer_name``
(``iggy-edge-<gateway>``) -- the same consumer our polls name.  The server
hashes a named consumer to a stable id, keeps one offset per partition, lets
it move backwards (our SQLite offset is the truth) and refuses one beyond the
partition's last offset ("Invalid offset").  A ``PollingStrategy.Next`` poll
by that consumer resumes at the stored offset + 1, which is what the cloud
side sees.  Our own polls use explicit offsets and no auto-commit, so polling
stores nothing.
"""

from __future__ import annotations

import struct
from typing import Final

from .connection import Connection
from .wire import encode_identifier

GET_CONSUMER_OFFSET_CODE: Final = 120
STORE_CONSUMER_OFFSET_CODE: Final = 121
_CONSUMER_KIND: Final = 1  # a single consumer (2 would be a consumer group)
_ACK_QUORUM: Final = 1


def encode_get_consumer_offset(consumer: str, stream: str, topic: str, partition_id: int) -> bytes:
    """Payload of GET_CONSUMER_OFFSET (binary protocol 0.9): consumer kind u8
    (1 = single consumer) and identifier, stream and topic identifiers (kind
    u8, length u8, bytes), then a partition flag u8 and the partition id u32
    little-endian."""
    return (
        bytes((_CONSUMER_KIND,))
        + encode_identifier(consumer)
        + encode_identifier(stream)
        + encode_identifier(topic)
        + struct.pack("<BI", 1, partition_id)
    )


def encode_store_consumer_offset(
    consumer: str, stream: str, topic: str, partition_id: int, offset: int
) -> bytes:
    """Payload of STORE_CONSUMER_OFFSET: the GET_CONSUMER_OFFSET payload, then
    the offset u64 and the ack level u8 (1 = quorum) little-endian."""
    return encode_get_consumer_offset(consumer, stream, topic, partition_id) + struct.pack(
        "<QB", offset, _ACK_QUORUM
    )


def decode_consumer_offset(payload: bytes) -> int | None:
    """GET_CONSUMER_OFFSET reply: partition u32, current offset u64, stored
    offset u64 (little-endian); an empty reply means no stored offset."""
    if not payload:
        return None
    if len(payload) < 20:
        raise ValueError(f"consumer offset reply of {len(payload)} bytes, expected 20")
    _partition, _current, stored = struct.unpack_from("<IQQ", payload)
    return int(stored)


async def store_consumer_offset(
    conn: Connection, consumer: str, stream: str, topic: str, partition_id: int, offset: int
) -> None:
    """Store `offset` as `consumer`'s last consumed one on the server (bounded)."""
    client = await conn.client()
    payload = encode_store_consumer_offset(consumer, stream, topic, partition_id, offset)
    await conn.call(
        f"store offset {offset} of {stream}/{topic}/{partition_id}",
        client.send_binary_request(STORE_CONSUMER_OFFSET_CODE, payload),
    )


async def get_consumer_offset(
    conn: Connection, consumer: str, stream: str, topic: str, partition_id: int
) -> int | None:
    """The offset the server holds for `consumer` on this partition, or None."""
    client = await conn.client()
    payload = encode_get_consumer_offset(consumer, stream, topic, partition_id)
    reply = await conn.call(
        f"get offset of {stream}/{topic}/{partition_id}",
        client.send_binary_request(GET_CONSUMER_OFFSET_CODE, payload),
    )
    return decode_consumer_offset(reply)
