"""Value types that travel between stages, and the message-id scheme.

Message id (128 bits, stable across retries and restarts)::

    high 64 bits = 32-bit hash of the gateway id  |  32-bit buffer epoch
    low  64 bits = outbox sequence number (SQLite AUTOINCREMENT, never reused)

The epoch is a random number drawn when a buffer database is created, so a
gateway whose database had to be moved aside and recreated never reissues an
id it used before.  Iggy 0.9 keeps duplicates; consumers drop the copy an
ambiguous retry can leave by this id.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Final

HEADER_MQTT_TOPIC: Final = "mqtt-topic"
HEADER_QOS: Final = "mqtt-qos"
HEADER_RETAIN: Final = "mqtt-retain"
HEADER_GATEWAY: Final = "gateway-id"
HEADER_RECEIVED_US: Final = "received-at-us"
HEADER_DEVICE_SEQ: Final = "device-seq"


def gateway_hash32(gateway_id: str) -> int:
    """32-bit, stable hash of a gateway id (blake2b, not Python's salted hash)."""
    return int.from_bytes(hashlib.blake2b(gateway_id.encode(), digest_size=4).digest(), "big")


def make_message_id(gateway_hash: int, epoch: int, seq: int) -> int:
    return (gateway_hash << 96) | (epoch << 64) | seq


def split_message_id(message_id: int) -> tuple[int, int, int]:
    """Inverse of make_message_id: (gateway_hash, epoch, seq)."""
    return message_id >> 96, (message_id >> 64) & 0xFFFFFFFF, message_id & 0xFFFFFFFFFFFFFFFF


@dataclass(frozen=True, slots=True)
class Route:
    """Where a message goes in Iggy."""

    stream: str
    topic: str
    key: str


@dataclass(slots=True)
class OutboundRecord:
    """A committed outbox record on its way to Iggy.

    `seq` is the outbox sequence (and the low 64 bits of `message_id`); the
    forwarder confirms and deletes by it.

    Not frozen, though nothing changes it after the outbox built it: a frozen
    dataclass's ``__init__`` sets each field through ``object.__setattr__``,
    2.1 us per record here against 0.4 us -- the largest single cost of a
    drain (bench/drain_bench.py) before it went.
    """

    seq: int
    message_id: int
    stream: str
    topic: str
    key: str
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.payload)
