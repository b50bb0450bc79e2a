# Wire formats of the iggy-edge topic conventions (see shared DESIGN.md):
#   device -> gateway  {prefix}/{device}/up/{channel}   telemetry JSON with "seq"
#                      {prefix}/{device}/up/ack         command acks
#                      {prefix}/{device}/status         "online" / "offline", retained
#   gateway -> device  {prefix}/{device}/down/cmd       {"id", "name", "args", "expires_at"}
#                      {prefix}/{device}/down/config    retained JSON object
# Pure: json only, runs under CPython and MicroPython.
import json

ACK_OK = "ok"
ACK_ERROR = "error"
ACK_UNKNOWN = "unknown_command"
ACK_EXPIRED = "expired"

_SEP = (",", ":")
_BAD_CHANNEL = " /+#"


def check_channel(channel):
    if not channel or len(channel) > 32:
        raise ValueError("channel must be 1..32 characters")
    for c in channel:
        if c in _BAD_CHANNEL:
            raise ValueError("channel must not contain space, '/', '+' or '#'")
    return channel


def topic(prefix, device, *parts):
    return prefix + "/" + device + "/" + "/".join(parts)


def encode_reading(seq, ts, reading):
    """Compact JSON: {"seq": n, "ts": unix s, ...reading}.  ``ts`` is left
    out when the clock is not set (the gateway stamps receive time)."""
    doc = {"seq": seq}
    if ts is not None:
        doc["ts"] = ts
    for k in reading:
        if k == "seq" or k == "ts":
            raise ValueError("reading must not use the reserved keys seq/ts")
        doc[k] = reading[k]
    return json.dumps(doc, separators=_SEP)


def parse_command(raw):
    """(id, name, args, expires_at) from a down/cmd payload; ValueError with
    a reason otherwise.  ``id`` is returned as soon as it is known, so the
    caller can still acknowledge a malformed command: see ``CommandError``."""
    try:
        doc = json.loads(raw)
    except ValueError:
        raise CommandError(None, "payload is not JSON") from None
    if not isinstance(doc, dict):
        raise CommandError(None, "command must be a JSON object")
    cid = doc.get("id")
    if not isinstance(cid, str) or not cid or len(cid) > 64:
        raise CommandError(None, "command id must be a string of 1..64 characters")
    name = doc.get("name")
    if not isinstance(name, str) or not name:
        raise CommandError(cid, "command name must be a non-empty string")
    args = doc.get("args")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise CommandError(cid, "args must be a JSON object")
    exp = doc.get("expires_at")
    if exp is not None and not isinstance(exp, (int, float)):
        raise CommandError(cid, "expires_at must be a number or null")
    return cid, name, args, exp


class CommandError(ValueError):
    def __init__(self, cid, reason):
        super().__init__(reason)  # MicroPython has no ValueError.__init__ to call
        self.cid = cid
        self.reason = reason


def encode_ack(cid, status, result=None, error=None):
    doc = {"id": cid, "status": status}
    if status == ACK_OK:
        doc["result"] = result
    else:
        doc["error"] = error
    return json.dumps(doc, separators=_SEP)


def is_expired(expires_at, now):
    """Only a set clock can judge expiry; without one the command runs (the
    gateway does not deliver commands that expired before delivery)."""
    return expires_at is not None and now is not None and now > expires_at


def parse_config(raw):
    """Desired config: a JSON object, or None for an empty retained message
    (a cleared retain)."""
    if not raw:
        return None
    doc = json.loads(raw)
    if not isinstance(doc, dict):
        raise ValueError("config must be a JSON object")
    return doc
