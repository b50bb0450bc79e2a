# Wire formats of the iggy-edge topic conventions (see shared DESIGN.md):
#   device -> gateway  {prefix}/{device}/up/{channel}   telemetry JSON with "seq"
#                      {prefix}/{device}/up/ack         command acks
#                      {prefix}/{device}/status         "online" / "offline", retained
#   gateway -> device  {prefix}/{device}/down/cmd       {"id", "name", "args", "expires_at"}
#                      {prefix}/{device}/down/config    retained JSON object
# (parsing those and the acks: commands.py, loaded with the first of them)
# Pure: json only, runs under CPython and MicroPython.
import json
from micropython import const

_SEP = const((",", ":"))
_BAD_CHANNEL = const(" /+#")


def check_channel(channel):
    if not channel or len(channel) > 32:
        raise ValueError("channel must be 1..32 characters")
    for c in channel:
        if c in _BAD_CHANNEL:
            raise ValueError("channel must not contain space, '/', '+' or '#'")
    return channel


def topic(p, dev, *parts):
    return p + "/" + dev + "/" + "/".join(parts)


def encode_reading(seq, ts, reading, own=False):
    """Compact JSON: {"seq": n, "ts": unix s, ...reading}.  ``ts`` is left
    out when the clock is not set (the gateway stamps receive time).
    ``own``: ``reading`` is the caller's to change (the diag document):
    seq and ts go into it instead of into a copy, whose table (about 25
    keys) was the one block the heap of a 56k board lacked at connect."""
    if "seq" in reading or "ts" in reading:
        raise ValueError("reading must not use the reserved keys seq/ts")
    doc = reading if own else {}
    doc["seq"] = seq
    if ts is not None:
        doc["ts"] = ts
    if not own:
        for k in reading:
            doc[k] = reading[k]
    return json.dumps(doc, separators=_SEP)
