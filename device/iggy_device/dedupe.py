# Recently executed command ids with the ack that was sent, persisted, so a
# command the broker redelivers (QoS1 after a lost PUBACK, a reboot, a retry
# by the gateway) is acknowledged again without running twice.  A small ring:
# ids older than the last ``size`` commands are forgotten.
import json

from . import fsutil

_MAX_ACK = 240  # bytes of stored ack; a longer result is kept as status only


class RecentCommands:
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
