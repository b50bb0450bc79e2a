"""The OTA wire format, gateway side (/work/ota-protocol.md; docs/ota.md).

Gateway -> board on ``down/ota`` (QoS 1): one line of compact JSON, then
``\\n``, then (chunks only) the raw bytes.  Board -> gateway on ``up/ota``:
one compact JSON object per message.  Everything the board sends is
untrusted: `parse_reply` returns a `Reply` or a `Garbage` with the reason,
never raises, and bounds every field.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Final

CHUNK_BYTES: Final = 1024  # data per chunk at most: the whole message stays under 1.5 kB
MIN_CHUNK_BYTES: Final = 64  # a board's need may ask for less ("n"), not for less than this
MAX_FILES: Final = 32  # the library (19 modules) and an app: see docs/ota.md
MAX_PATH_CHARS: Final = 64
MAX_VERSION_CHARS: Final = 32
MAX_WHY_CHARS: Final = 200
MAX_REPLY_BYTES: Final = 1024  # a few fields and a reason of 200 characters; longer is garbage
# Board states on up/ota (the contract's "Messages board -> gateway")
BOARD_STATES: Final = ("need", "bad", "staged", "trial", "done", "rolled_back", "failed", "idle")

_ID = re.compile(r"[A-Za-z0-9_.-]{1,32}\Z")
_PATH = re.compile(r"[a-z0-9_./-]{1,64}\Z")
_VERSION = re.compile(r"[A-Za-z0-9_.+-]{1,32}\Z")


def id_problem(uid: str) -> str | None:
    if not isinstance(uid, str) or not _ID.match(uid):
        return f"update id {uid!r} must be 1-32 characters of [A-Za-z0-9_.-]"
    return None


def version_problem(version: str) -> str | None:
    if not isinstance(version, str) or not _VERSION.match(version):
        return f"version {version!r} must be 1-32 characters of [A-Za-z0-9_.+-]"
    return None


def path_problem(path: str) -> str | None:
    """Why `path` cannot be a file of an update (relative, lower case, no
    ``..``, no empty level), or None."""
    if not isinstance(path, str) or not _PATH.match(path):
        return f"file path {path!r} must be 1-{MAX_PATH_CHARS} characters of [a-z0-9_./-]"
    parts = path.split("/")
    if path.startswith("/") or any(p in ("", ".", "..") for p in parts):
        return f"file path {path!r} must be relative, without '.', '..' or empty levels"
    return None


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _line(doc: dict[str, object]) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def manifest(uid: str, version: str, files: list[tuple[str, int, str]], mpy: int | None) -> bytes:
    total = sum(size for _, size, _ in files)
    return _line(
        {"t": "m", "id": uid, "v": version, "files": [list(f) for f in files], "total": total, "mpy": mpy}
    )


def chunk(uid: str, f: int, o: int, data: bytes) -> bytes:
    return _line({"t": "c", "id": uid, "f": f, "o": o, "h": sha256_hex(data)}) + data


def abort(uid: str) -> bytes:
    return _line({"t": "x", "id": uid})


def is_chunk(message: bytes) -> bool:
    return message.startswith(b'{"t":"c"')


def probe() -> bytes:
    return _line({"t": "q"})


@dataclass(frozen=True, slots=True)
class Reply:
    """One well-formed message from a board on up/ota."""

    st: str
    id: str | None = None
    f: int = -1
    o: int = -1
    v: str | None = None
    why: str = ""
    mpy: int | None = None  # the .mpy version the board loads, when it says
    n: int | None = None  # need: the most data bytes the board takes in one chunk


@dataclass(frozen=True, slots=True)
class Garbage:
    """What could not be read as a reply, and why (counted, then ignored)."""

    reason: str


def _printable(text: str, limit: int) -> str:
    return "".join(c if c.isprintable() else "?" for c in text[:limit])


def _int(doc: dict[str, object], key: str) -> int | None:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**31:
        return None
    return value


def parse_reply(payload: bytes) -> Reply | Garbage:
    """A board's message, checked field by field."""
    if len(payload) > MAX_REPLY_BYTES:
        return Garbage(f"{len(payload)} bytes, over {MAX_REPLY_BYTES}")
    try:
        doc = json.loads(payload)
    except ValueError:  # UnicodeDecodeError too
        return Garbage("not JSON")
    if not isinstance(doc, dict):
        return Garbage("not a JSON object")
    st = doc.get("st")
    if st not in BOARD_STATES:
        return Garbage(f"unknown state {_printable(str(st), 20)!r}")
    uid = doc.get("id")
    if uid is not None and id_problem(uid) is not None:
        return Garbage("bad update id")
    f, o = _int(doc, "f"), _int(doc, "o")
    if st in ("need", "bad") and (f is None or o is None):
        return Garbage(f"{st} without a valid f and o")
    v = doc.get("v")
    if v is not None and (
        not isinstance(v, str) or not v or len(v) > MAX_VERSION_CHARS or not v.isprintable()
    ):
        return Garbage("bad version")
    why = doc.get("why", "")
    why = _printable(why, MAX_WHY_CHARS) if isinstance(why, str) else ""
    n = _int(doc, "n")
    if "n" in doc and doc["n"] is not None and (n is None or n < MIN_CHUNK_BYTES):
        return Garbage("bad chunk size n")
    return Reply(st, uid, -1 if f is None else f, -1 if o is None else o, v, why, _int(doc, "mpy"), n)
