# Commands and desired config from the gateway (down/cmd, down/config):
# parsing, acks, the recent command ids, the persisted desired config.
#
# Loaded by the Device on the first message on either topic (or at boot when
# a persisted config is there to apply), not at import: a sensor that never
# gets a command or a config never holds this code (about 3.5 kB of heap on
# a 32-bit port, loaded from .mpy).
#   gateway -> device  {prefix}/{device}/down/cmd     {"id", "name", "args", "expires_at"}
#                      {prefix}/{device}/down/config  retained JSON object
#   device -> gateway  {prefix}/{device}/up/ack       {"id", "status", "result" | "error"}
# Pure: json + fsutil, runs under CPython and MicroPython.
import json
from micropython import const

from . import fsutil

ACK_OK = "ok"
ACK_ERROR = "error"
ACK_UNKNOWN = "unknown_command"
ACK_EXPIRED = "expired"

_SEP = const((",", ":"))
_MAX_ACK = const(240)  # bytes of stored ack; a longer result is kept as status only
_TOO_LONG = const("(result too long to keep)")


class CommandError(ValueError):
    def __init__(self, cid, reason):
        super().__init__(reason)  # MicroPython has no ValueError.__init__ to call
        self.cid = cid
        self.reason = reason


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


def command_id(raw):
    """The command id of a raw down/cmd payload found without parsing it
    (no allocation beyond the id): for a command too large to parse in the
    heap left, so it can still be refused by id.  None when not found."""
    i = raw.find(b'"id"')
    if i < 0:
        return None
    i = raw.find(b'"', raw.find(b":", i + 4) + 1) + 1
    j = raw.find(b'"', i)
    if i <= 0 or j < 0 or j - i > 64 or j == i or b"\\" in raw[i:j]:
        return None
    return bytes(raw[i:j]).decode()


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


class RecentCommands:
    """Recently executed command ids with the ack that was sent, persisted,
    so a command the broker redelivers (QoS1 after a lost PUBACK, a reboot, a
    retry by the gateway) is acknowledged again without running twice.  A
    small ring: ids older than the last ``size`` commands are forgotten."""

    def __init__(self, path, size=16):
        self.path = path
        self.size = size
        self._items = []  # [[id, ack], ...] oldest first
        raw = fsutil.read(path)
        if raw:
            try:
                items = json.loads(raw)
                if isinstance(items, list):
                    self._items = items[-size:]
            except ValueError:
                pass

    def get(self, cid):
        for item in self._items:
            if item[0] == cid:
                return item[1]
        return None

    def put(self, cid, ack, short_ack=None):
        if len(ack) > _MAX_ACK and short_ack is not None:
            ack = short_ack
        self._items.append([cid, ack])
        if len(self._items) > self.size:
            self._items.pop(0)
        fsutil.write_atomic(self.path, json.dumps(self._items).encode())

    def __len__(self):
        return len(self._items)


class Inbound:
    """What the Device does with a command or a desired config (``dev``:
    the Device; it sends acks through ``dev._send``, the buffered path)."""

    def __init__(self, dev):
        self.dev = dev
        self.recent = RecentCommands(dev.cfg.data_dir + "/cmds")
        self.config_path = dev.cfg.data_dir + "/desired.json"

    def command(self, raw):
        dev = self.dev
        try:
            cid, name, args, exp = parse_command(raw)
        except CommandError as e:
            dev.stats["bad_messages"] += 1
            dev.log("bad command:", e.reason)
            if e.cid is not None:
                self._ack(e.cid, ACK_ERROR, encode_ack(e.cid, ACK_ERROR, error=e.reason))
            return
        prior = self.recent.get(cid)
        if prior is not None:
            # redelivered: acknowledge again, do not run again
            dev.stats["duplicates"] += 1
            dev._send("ack", prior)
            return
        dev.stats["commands"] += 1
        fn = dev._handlers.get(name)
        status = ACK_ERROR
        if is_expired(exp, dev.hw.unix_time()):
            status, err = ACK_EXPIRED, "expired"
        elif fn is None:
            status, err = ACK_UNKNOWN, name
        else:
            try:
                result = fn(args)
                status = ACK_OK
            except Exception as e:  # noqa: BLE001 - the handler boundary: any failure becomes an "error" ack
                err = repr(e)
        if status == ACK_OK:
            self._ack(cid, status, encode_ack(cid, status, result=result))
        else:
            self._ack(cid, status, encode_ack(cid, status, error=err))

    def refuse(self, raw, why):
        """A command that could not be handled (out of memory): answer it
        with an "error" ack when its id can be found, so the gateway hears
        of it instead of the command being acknowledged to the broker and
        lost.  Not remembered: a retry may fit."""
        cid = command_id(raw)
        if cid is None:
            return False
        self.dev._send("ack", encode_ack(cid, ACK_ERROR, error=why))
        return True

    def _ack(self, cid, status, ack):
        short = encode_ack(cid, status, _TOO_LONG, _TOO_LONG)
        # a reply must fit one record of the flash ring with its channel
        # (segment_bytes: 1 KiB on battery boards); a longer one goes as
        # its status only, as the recent ids keep it
        if len(ack) + 5 > self.dev.ring.segment_bytes:
            ack = short
        self.recent.put(cid, ack, short)
        self.dev._send("ack", ack)

    def boot_config(self, fn):
        raw = fsutil.read(self.config_path)
        if raw:
            try:
                fn(parse_config(raw))
            except ValueError as e:
                self.dev.log("config: persisted copy unusable:", repr(e))

    def config(self, raw):
        dev = self.dev
        if raw == fsutil.read(self.config_path):
            return  # the retained copy we already applied (every reconnect)
        try:
            desired = parse_config(raw)
        except ValueError as e:
            dev.stats["bad_messages"] += 1
            dev.log("bad config:", repr(e))
            return
        if desired is None:
            return
        if dev._config_cb is not None:
            try:
                dev._config_cb(desired)
            except Exception as e:  # noqa: BLE001 - application callback boundary
                dev.log("config callback failed:", repr(e))
                return
        fsutil.write_atomic(self.config_path, raw)
        dev.log("config applied")
