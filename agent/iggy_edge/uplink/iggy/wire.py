"""Pieces of Iggy's binary protocol (0.9) that the SDK does not expose and
the raw requests of topics.py and offsets.py share: identifiers and
string-typed key/value entries."""

from __future__ import annotations

import struct
from typing import Final

IDENTIFIER_STRING_KIND: Final = 2
VALUE_STRING_KIND: Final = 2


def encode_identifier(name: str) -> bytes:
    """A string identifier: kind u8 (2), length u8, bytes."""
    raw = name.encode()
    if not 1 <= len(raw) <= 255:
        raise ValueError(f"identifier must be 1-255 bytes: {name!r}")
    return bytes((IDENTIFIER_STRING_KIND, len(raw))) + raw


def encode_string_entry(key: str, value: str) -> bytes:
    """A key/value entry as the user-header codec writes it: key kind u8,
    key length u32 LE, key, value kind u8, value length u32 LE, value."""
    k, v = key.encode(), value.encode()
    return (
        bytes((VALUE_STRING_KIND,))
        + struct.pack("<I", len(k))
        + k
        + bytes((VALUE_STRING_KIND,))
        + struct.pack("<I", len(v))
        + v
    )
