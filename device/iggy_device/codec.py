# Wire formats of the iggy-edge topic conventions (see shared DESIGN.md):
#   device -> gateway  {prefix}/{device}/up/{channel}   telemetry JSON with "seq"
#                      {prefix}/{device}/up/ack         command acks
#                      {prefix}/{device}/status         "online" / "offline", retained
#   gateway -> device  {prefix}/{device}/down/cmd       {"id", "name", "args", "expires_at"}
#                      {prefix}/{device}/down/config    retained JSON object
# (parsing those and the acks: commands.py, loaded with the first of them)
# Pure: json only, runs under CPython and MicroPython.
import json

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
