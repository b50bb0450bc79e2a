"""Return-path value types, parsing and addressing.  Pure, no I/O.

Addressing (why one Iggy topic per gateway, see docs/return-path.md)
--------------------------------------------------------------------
A gateway reads one topic, ``{return_topic}.{gateway_id}`` (``return.<gw>``)
of ONE partition, in stream ``{stream_prefix}-{n}`` (``edge-rp-<n>``) where
n = `stream_shard` (blake2b of the gateway id mod ``stream_shards``, the
hash `partition_for` uses), and nothing else.  Commands, desired configs and
board updates share it; a message's ``kind`` user header (`KIND_HEADER`) says
which (`KIND_COMMAND`, `KIND_CONFIG`, `KIND_OTA`: ota/cloud.py).  Sharding
keeps each stream under Iggy's 4,096 topics per stream.  The cloud side learns
which gateway serves a device from the ``gateway-id`` header every uplink
record carries, and computes the same `return_topic_of`.

Before, a gateway read two topics, ``{commands_topic}.{gateway_id}`` and
``{config_topic}.{gateway_id}`` in ``stream`` (``edge``), of ``iggy.partitions``
partitions each (`legacy_topics`); the return poll reads what is pending
there once after the upgrade (docs/return-path.md, "Migration").

Wire formats (JSON objects, UTF-8)::

    command  {"id": str, "device": str, "name": str, "args": {...},
              "created_at": unix_s, "expires_at": unix_s}
    config   {"device": str, "config": {...}, "id": str, "created_at": unix_s}
    ack      {"id": str, "status": "ok" | "error" | "unknown_command" | "expired", ...}

``args``, ``created_at`` and ``expires_at`` may be left out (empty args; the
time the agent read it; ``created_at + default_ttl_s``, at most `MAX_TIME`).  Anything else that
does not fit is an `InvalidCommand`; the return poll dead-letters it with
reason ``invalid_command``.  That includes a command or config whose payload
for the device (``device_payload()``) is over `MAX_DEVICE_PAYLOAD_BYTES`:
the device library throws such messages away unread (its ``msg_max_bytes``,
4096 by default), so sending one could only lose it.

The trust boundary
------------------
An Iggy message is whatever the cloud side (or anyone with write access to
the gateway's topics) put there: any bytes.  `read_command` and
`read_config` are the boundary functions: they turn ANY payload into a
value or a `Refused` (reason and detail) and never raise, so one message
can never stop the return poll.  What passes is safe for every later step
(the inbox insert, ``device_payload()``, a PUBLISH, ``command list``):

* the message is at most `MAX_MESSAGE_BYTES` before it is parsed;
* every string (keys included) is encodable as UTF-8 (no lone surrogates);
* nesting is at most `MAX_DEPTH` levels; integers fit in 64 bits signed;
  floats are finite (``NaN``/``Infinity`` are refused);
* times are unix seconds in 0..`MAX_TIME` (the end of year 9999): a time
  beyond that is refused, not clamped -- it cannot be printed, and a sender
  that means "never expires" should say so with a long TTL it can read back.
"""

from __future__ import annotations

import json
import math
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Final, TypeVar

from ..config import DownlinkSettings, Settings
from ..device_ids import device_id_problem
from ..uplink.partition import partition_for

MAX_ID_CHARS: Final = 64  # the device library keeps recent ids; it accepts 1..64 characters
MAX_NAME_CHARS: Final = 64
# What a device accepts on down/cmd and down/config: the device library's
# default msg_max_bytes (device/iggy_device/config.py).
MAX_DEVICE_PAYLOAD_BYTES: Final = 4096
# An Iggy message bigger than this is refused before it is parsed: what the
# device accepts is 4096 bytes, so 64 KiB leaves room for whitespace and
# escapes while bounding what one message can cost to parse.
MAX_MESSAGE_BYTES: Final = 64 * 1024
MAX_DEPTH: Final = 32  # nesting levels of args / config (the device parses with recursion)
MAX_INT: Final = 2**63 - 1
MAX_TIME: Final = 253_402_300_799.0  # 9999-12-31T23:59:59Z: the last second datetime can print
INVALID_COMMAND: Final = "invalid_command"  # the dead-letter reason of a refused message
_SEP: Final = (",", ":")


class CommandState(StrEnum):
    """Per-command states recorded in the inbox (and metric labels)."""

    RECEIVED = "received"  # read from Iggy and committed; waiting for delivery
    DELIVERED = "delivered"  # the broker acknowledged the QoS1 publish (PUBACK)
    ACKED = "acked"  # the device acknowledged it with status "ok"
    EXPIRED = "expired"  # expired before delivery, or the device said so
    FAILED = "failed"  # the broker refused it, or the device acked an error


class InvalidCommand(ValueError):
    """A command or config message that cannot be used; the text is the detail."""


@dataclass(frozen=True, slots=True)
class Command:
    id: str
    device: str
    name: str
    args: dict[str, Any]
    created_at: float
    expires_at: float

    def expired(self, now: float) -> bool:
        return now >= self.expires_at

    def device_payload(self) -> bytes:
        """What the device receives on ``down/cmd`` (device/iggy_device/codec.py).

        Times go as whole seconds: MicroPython on an ESP32 parses a JSON
        float as float32, which holds a 2020s Unix time only to 128 s."""
        doc = {
            "id": self.id,
            "name": self.name,
            "args": self.args,
            "created_at": math.floor(self.created_at),
            "expires_at": math.floor(self.expires_at),
        }
        return json.dumps(doc, separators=_SEP).encode()

    def wire(self) -> bytes:
        """The Iggy message, as the cloud side sends it."""
        doc = {
            "id": self.id,
            "device": self.device,
            "name": self.name,
            "args": self.args,
            "created_at": self.created_at,
            "expires_at": self.expires_at,
        }
        return json.dumps(doc, separators=_SEP).encode()

    def headers(self) -> dict[str, str]:
        """The Iggy user headers the cloud side sends it with."""
        return {KIND_HEADER: KIND_COMMAND}


@dataclass(frozen=True, slots=True)
class DesiredConfig:
    id: str
    device: str
    config: dict[str, Any]
    created_at: float

    def device_payload(self) -> bytes:
        """What is retained on ``down/config``: the desired config object itself."""
        return json.dumps(self.config, separators=_SEP, sort_keys=True).encode()

    def wire(self) -> bytes:
        doc = {"id": self.id, "device": self.device, "config": self.config, "created_at": self.created_at}
        return json.dumps(doc, separators=_SEP).encode()

    def headers(self) -> dict[str, str]:
        return {KIND_HEADER: KIND_CONFIG}


@dataclass(frozen=True, slots=True)
class Ack:
    id: str
    status: str
    error: str | None
    result: str | None = None  # the device's result (JSON text, cut to 200 characters), when it sent one

    @property
    def state(self) -> CommandState:
        if self.status == "ok":
            return CommandState.ACKED
        if self.status == "expired":
            return CommandState.EXPIRED
        return CommandState.FAILED


# -- addressing -----------------------------------------------------------------

KIND_HEADER: Final = "kind"  # user header of every return-path message
KIND_COMMAND: Final = "command"
KIND_CONFIG: Final = "config"
KIND_OTA: Final = "ota"  # a board update's chunk or request, for ota/cloud.py
KINDS: Final = (KIND_COMMAND, KIND_CONFIG, KIND_OTA)
RETURN_PARTITION: Final = 0  # the return-path topic has one partition


@dataclass(frozen=True, slots=True)
class ReturnTopic:
    """Where a gateway's commands and configs go: stream, topic, partition."""

    stream: str
    topic: str
    partition: int = RETURN_PARTITION


def stream_shard(gateway_id: str, shards: int) -> int:
    """The gateway's return-path stream number, 0..shards-1 (stable: blake2b)."""
    return partition_for(gateway_id, shards)


def return_topic_of(gateway_id: str, downlink: DownlinkSettings) -> ReturnTopic:
    """Any gateway's return-path topic (the cloud side's view)."""
    n = stream_shard(gateway_id, downlink.stream_shards)
    return ReturnTopic(f"{downlink.stream_prefix}-{n}", f"{downlink.return_topic}.{gateway_id}")


def return_topic(settings: Settings) -> ReturnTopic:
    """This gateway's return-path topic."""
    return return_topic_of(settings.gateway_id, settings.downlink)


def legacy_topics(gateway_id: str, downlink: DownlinkSettings) -> tuple[str, str]:
    """The two topics of the earlier scheme (in ``downlink.stream``): commands, config."""
    return f"{downlink.commands_topic}.{gateway_id}", f"{downlink.config_topic}.{gateway_id}"


def message_kind(headers: Mapping[str, str]) -> str | Refused:
    """Trust boundary for the ``kind`` header: one of `KINDS`, or why the
    message is refused (missing, or another value).  Never raises."""
    kind = headers.get(KIND_HEADER)
    if kind in KINDS:
        return kind
    expected = ", ".join(repr(k) for k in KINDS)
    if kind is None:
        return Refused(INVALID_COMMAND, f"no {KIND_HEADER!r} header (expected one of {expected})")
    detail = f"{KIND_HEADER!r} header is '{printable(str(kind), 80)}', not one of {expected}"
    return Refused(INVALID_COMMAND, printable(detail))


def deliver_client_id(settings: Settings) -> str:
    return settings.downlink.client_id or f"{settings.mqtt_client_id}-deliver"


def device_topic(template: str, device: str) -> str:
    return template.replace("{device}", device)


# -- parsing --------------------------------------------------------------------


def _object(payload: bytes) -> dict[str, Any]:
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise InvalidCommand(f"payload must be bytes, got {type(payload).__name__}")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise InvalidCommand(f"payload is {len(payload)} bytes, over the {MAX_MESSAGE_BYTES}-byte limit")
    try:
        doc = json.loads(bytes(payload))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCommand(f"payload is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidCommand(f"payload must be a JSON object, got {type(doc).__name__}")
    return doc


def _text(doc: dict[str, Any], key: str, limit: int) -> str:
    value = doc.get(key)
    if not isinstance(value, str) or not 1 <= len(value) <= limit:
        raise InvalidCommand(f"{key!r} must be a string of 1..{limit} characters")
    return value


def _device(doc: dict[str, Any]) -> str:
    device = doc.get("device")
    problem = device_id_problem(device)
    if problem is not None:
        raise InvalidCommand(f"'device': {problem}")
    assert isinstance(device, str)
    return device


def _time(doc: dict[str, Any], key: str, default: float) -> float:
    value = doc.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidCommand(f"{key!r} must be a unix time in seconds")
    if not 0 <= value <= MAX_TIME:  # no float(): a 400-digit int would overflow it
        raise InvalidCommand(f"{key!r} must be a unix time in seconds, 0..{MAX_TIME:.0f} (year 9999)")
    return float(value)


def parse_command(payload: bytes, *, now: float, default_ttl_s: float) -> Command:
    doc = _object(payload)
    cid = _text(doc, "id", MAX_ID_CHARS)
    device = _device(doc)
    name = _text(doc, "name", MAX_NAME_CHARS)
    _check_value(cid, "id")
    _check_value(name, "name")
    args = doc.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise InvalidCommand("'args' must be a JSON object")
    _check_value(args, "args")
    created = _time(doc, "created_at", now)
    expires = _time(doc, "expires_at", min(created + default_ttl_s, MAX_TIME))  # a default ends there too
    return _fits(Command(cid, device, name, args, created, expires))


def parse_config(payload: bytes, *, now: float, fallback_id: str) -> DesiredConfig:
    doc = _object(payload)
    device = _device(doc)
    config = doc.get("config")
    if not isinstance(config, dict):
        raise InvalidCommand("'config' must be a JSON object")
    _check_value(config, "config")
    raw_id = doc.get("id", doc.get("version"))
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, str | int)):
        raise InvalidCommand("config 'id'/'version' must be a string or an integer")
    if isinstance(raw_id, int) and abs(raw_id) > MAX_INT:
        raise InvalidCommand("config 'id'/'version' must be an integer of 64 bits")
    cid = fallback_id if raw_id is None else str(raw_id)
    _check_value(cid, "id")
    if not 1 <= len(cid) <= MAX_ID_CHARS:
        raise InvalidCommand(f"config 'id'/'version' must be 1..{MAX_ID_CHARS} characters")
    return _fits(DesiredConfig(cid, device, config, _time(doc, "created_at", now)))


def _check_value(value: Any, where: str, depth: int = 0) -> None:
    """Refuse what a later step could not encode (module docstring: the trust boundary)."""
    if depth > MAX_DEPTH:
        raise InvalidCommand(f"{where!r} nests deeper than {MAX_DEPTH} levels")
    if isinstance(value, str):
        try:
            value.encode()
        except UnicodeEncodeError:
            raise InvalidCommand(
                f"{where!r} holds a string that is not valid Unicode (a lone surrogate)"
            ) from None
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if abs(value) > MAX_INT:
            raise InvalidCommand(f"{where!r} holds an integer beyond 64 bits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidCommand(f"{where!r} holds NaN or Infinity, which JSON does not have")
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_value(k, where, depth + 1)
            _check_value(v, where, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _check_value(v, where, depth + 1)
    else:
        raise InvalidCommand(f"{where!r} holds a {type(value).__name__}, not a JSON value")


_Msg = TypeVar("_Msg", Command, DesiredConfig)


def _fits(msg: _Msg) -> _Msg:
    size = len(msg.device_payload())
    if size > MAX_DEVICE_PAYLOAD_BYTES:
        kind = "command" if isinstance(msg, Command) else "config"
        raise InvalidCommand(
            f"{kind} for the device is {size} bytes, over the {MAX_DEVICE_PAYLOAD_BYTES}-byte limit"
            " devices accept (msg_max_bytes)"
        )
    return msg


@dataclass(frozen=True, slots=True)
class Refused:
    """Why a message cannot be used: the dead-letter reason and a printable detail."""

    reason: str
    detail: str


MAX_DETAIL_CHARS: Final = 500


def printable(text: str, limit: int = MAX_DETAIL_CHARS) -> str:
    """`text` with everything a terminal or an encoder could trip on escaped
    (control and format characters, surrogates), at most `limit` characters."""
    out = "".join(
        c if c.isprintable() else c.encode("unicode_escape", "backslashreplace").decode() for c in text
    )
    return out if len(out) <= limit else out[: limit - 3] + "..."


def read_command(payload: bytes, *, now: float, default_ttl_s: float) -> Command | Refused:
    """Trust boundary: ANY Iggy payload -> a usable command, or why not.  Never raises."""
    try:
        return parse_command(payload, now=now, default_ttl_s=default_ttl_s)
    except InvalidCommand as e:
        return Refused(INVALID_COMMAND, printable(str(e)))
    except Exception as e:  # noqa: BLE001 - the boundary: whatever breaks on this input is its fault
        return Refused(INVALID_COMMAND, printable(f"cannot parse the command: {type(e).__name__}: {e}"))


def read_config(payload: bytes, *, now: float, fallback_id: str) -> DesiredConfig | Refused:
    """Trust boundary: ANY Iggy payload -> a usable desired config, or why not.  Never raises."""
    try:
        return parse_config(payload, now=now, fallback_id=fallback_id)
    except InvalidCommand as e:
        return Refused(INVALID_COMMAND, printable(str(e)))
    except Exception as e:  # noqa: BLE001 - the boundary, as read_command
        return Refused(INVALID_COMMAND, printable(f"cannot parse the config: {type(e).__name__}: {e}"))


def parse_ack(payload: bytes) -> Ack | None:
    """A device ack, or None when the payload is not one (it still travels uplink)."""
    try:
        doc = json.loads(payload)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(doc, dict):
        return None
    cid, status = doc.get("id"), doc.get("status")
    if not isinstance(cid, str) or not cid or not isinstance(status, str) or not status:
        return None
    error, result = doc.get("error"), doc.get("result")
    shown = None
    if result is not None:
        try:
            shown = json.dumps(result, separators=_SEP, ensure_ascii=False)[:200]
        except (TypeError, ValueError, RecursionError):  # parsed JSON re-serialises; bounded anyway
            shown = None
    return Ack(cid, status, None if error is None else str(error)[:200], shown)


# -- building (the cloud side's view: CLI, tests, benchmarks) ---------------------


def new_command_id() -> str:
    return secrets.token_hex(8)


def make_command(
    device: str,
    name: str,
    args: dict[str, Any] | None = None,
    *,
    ttl_s: float = 3600,
    command_id: str | None = None,
    now: float | None = None,
) -> Command:
    """A valid command (raises InvalidCommand otherwise)."""
    created = time.time() if now is None else now
    cmd = Command(command_id or new_command_id(), device, name, dict(args or {}), created, created + ttl_s)
    return parse_command(cmd.wire(), now=created, default_ttl_s=ttl_s)


def make_config(
    device: str, config: dict[str, Any], *, config_id: str | None = None, now: float | None = None
) -> DesiredConfig:
    created = time.time() if now is None else now
    cfg = DesiredConfig(config_id or new_command_id(), device, dict(config), created)
    return parse_config(cfg.wire(), now=created, fallback_id=cfg.id)
