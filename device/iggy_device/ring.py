# Offline ring buffer in flash, bounded in bytes, oldest first.
#
# Design (kept small enough for an ESP32 without PSRAM):
# - Records live in append-only segment files ``<n>.seg`` inside ``dir``,
#   one record per line: ``<channel> <payload>\n``.  Appending opens the tail
#   segment in "ab", writes one line and closes it, so littlefs only rewrites
#   the last block, and a power cut can tear at most the last line.  A line
#   without its newline is never read, and the segment it sits in is never
#   appended to again.
# - The bound is ``max_bytes // segment_bytes`` segments of at most
#   ``segment_bytes`` each.  When a new segment is needed and all slots are
#   taken, the oldest segment is deleted and the unread records in it are
#   added to ``dropped`` (persisted; the device reports it).  Dropping is
#   therefore by segment: the oldest records go first, never the newest.
# - The read cursor (head segment, byte offset, records read, dropped total)
#   lives in ``meta`` and is written atomically every ``cursor_every`` pops,
#   when a segment is finished or dropped, and on ``flush()``.  A crash
#   between cursor writes re-sends at most ``cursor_every - 1`` records that
#   the broker already had: delivery is at-least-once and the records carry
#   their device sequence number, so consumers can drop the copies.
# - A finished segment is deleted only after ``meta`` points past it; a
#   leftover file below the head is removed at open.
# - Only the segment list (a few small lists) is held in RAM; records are read
#   one line at a time.
# - Receipts (``hold``): a sent record (PUBACK) stays in flash until the
#   gateway's receipt covers it.  Two cursors: the send cursor (RAM only) is
#   where ``peek()`` reads; the read cursor in ``meta`` is the receipt's.
#   ``receipts.release(ring, seq, crc)`` walks the records and moves the read
#   cursor past the one the receipt names (and the seq-less command acks
#   right after it); a receipt that names no record releases nothing.  ``rewind()``
#   sends again from the read cursor (every new connection: the broker may
#   have lost what it acknowledged).  A seq-less record sent with nothing held
#   before it leaves at PUBACK (no receipt can name it).  Without ``hold``
#   both cursors move together at ``pop()``, as before receipts.
import json
import os
from micropython import const

from . import fsutil

_SEQ = const(b'"seq":')


def seq_of(payload, start=0):
    """The ``"seq":n`` of a reading payload (bytes; or a whole ring line
    with ``start`` where its payload begins), or None (command acks carry
    none).  MicroPython's json does not keep key order: search."""
    i = payload.find(_SEQ, start) + 6
    if i < start + 6:
        return None
    j = i
    while payload[j : j + 1].isdigit():
        j += 1
    return int(payload[i:j]) if j > i else None


class Ring:
    def __init__(self, dir, max_bytes=32768, segment_bytes=2048, cursor_every=8):
        if segment_bytes < 64:
            raise ValueError("ring: segment_bytes must be >= 64")
        if max_bytes < 2 * segment_bytes:
            raise ValueError("ring: max_bytes must hold at least two segments")
        self.dir = dir
        self.segment_bytes = segment_bytes
        self.max_segments = max_bytes // segment_bytes
        self.cursor_every = cursor_every
        # hold: keep sent records until receipts.release() covers them;
        # off: a sent record leaves at pop() (the broker's PUBACK)
        self.hold = False
        fsutil.makedirs(dir)
        m = self._load_meta()
        h = m.get("h", 0)
        self.dropped = m.get("d", 0)
        self.evicted = 0  # held records that had to go before their receipt
        self._off = m.get("o", 0)
        self._read = m.get("r", 0)
        names = []
        for name in os.listdir(dir):
            if name.endswith(".seg"):
                try:
                    names.append(int(name[:-4]))
                except ValueError:
                    pass
        names.sort()
        self._segs = []  # [number, bytes, complete lines]
        cut = False
        for n in names:
            if n < h:
                fsutil.remove(self._path(n))  # finished before a crash
                continue
            size, count, cut = self._scan(n)
            self._segs.append([n, size, count])
        if not self._segs or self._segs[0][0] != h:
            self._off = 0
            self._read = 0
        elif self._read > self._segs[0][2]:
            self._read = self._segs[0][2]
        self._tail_torn = cut
        self._next_n = self._segs[-1][0] + 1 if self._segs else h
        self._reader = None  # open on the send cursor's segment
        self._peeked = 0
        self._peek_seq = None
        self._unsaved = 0
        self.rewind()

    # -- queries -----------------------------------------------------------
    def __len__(self):
        """Records still in the ring: unsent, and sent but not released."""
        n = -self._read
        for s in self._segs:
            n += s[2]
        return n

    def unreceipted(self):
        """Records sent (PUBACK) and held for a receipt."""
        return self._unreceipted

    def bytes_used(self):
        n = 0
        for s in self._segs:
            n += s[1]
        return n

    def stats(self):
        return {
            "buffered": len(self),
            "bytes": self.bytes_used(),
            "dropped": self.dropped,
            "unreceipted": self._unreceipted,
            "evicted": self.evicted,
        }

    # -- writer ------------------------------------------------------------
    def append(self, channel, payload):
        """Store one record; returns how many older records were dropped to
        make room (0 while the ring has room)."""
        if isinstance(payload, str):
            payload = payload.encode()
        # written in pieces: a line built by concatenation took two more
        # payload-sized blocks, which a fragmented heap may not have
        n = len(channel) + len(payload) + 2  # channels are ASCII (codec.check_channel)
        if n > self.segment_bytes:
            raise ValueError("ring: record larger than a segment")
        lost = 0
        seg = self._segs[-1] if self._segs else None
        if seg is None or self._tail_torn or seg[1] + n > self.segment_bytes:
            while len(self._segs) >= self.max_segments:
                lost += self._drop_head()
            seg = [self._next_n, 0, 0]
            self._next_n += 1
            self._segs.append(seg)
            self._tail_torn = False
        with open(self._path(seg[0]), "ab") as f:
            f.write(channel.encode())
            f.write(b" ")
            f.write(payload)
            f.write(b"\n")
        seg[1] += n
        seg[2] += 1
        if seg is self._segs[self._si]:
            self._close_reader()  # a cached reader may not see the new line
        return lost

    # -- reader (the send cursor) ------------------------------------------
    def peek(self):
        """Oldest unsent record as (channel, payload memoryview), or None.  It
        stays in the ring until ``pop()`` confirms it was delivered (and,
        with ``hold``, until ``receipts.release()`` covers it)."""
        while self._segs:
            seg = self._segs[self._si]
            if self._sread >= seg[2]:
                if self._si + 1 >= len(self._segs):
                    return None
                self._close_reader()
                self._si += 1
                self._soff = self._sread = 0
                continue
            if self._reader is None:
                self._reader = open(self._path(seg[0]), "rb")
                self._reader.seek(self._soff)
            line = self._reader.readline()
            if not line.endswith(b"\n"):
                # count said there was a complete line: the file changed
                # under us (or was torn); treat the segment as finished
                seg[2] = self._sread
                continue
            self._peeked = len(line)
            i = line.find(b" ")
            # a view, not a slice: a copy was a second block of the
            # record's size, which a board near its smallest heap lacks
            self._peek_seq = seq_of(line, i + 1)
            return line[:i].decode(), memoryview(line)[i + 1 : -1]
        return None

    def pop(self):
        """The peeked record was sent (PUBACK)."""
        if not self._peeked:
            raise ValueError("ring: pop() without peek()")
        self._soff += self._peeked
        self._peeked = 0
        self._sread += 1
        if not self.hold or (self._unreceipted == 0 and self._peek_seq is None):
            # PUBACK is enough: without hold, or for a record without seq
            # (a command ack: no receipt can name it) with nothing held before it
            self._release_to(self._si, self._soff, self._sread)
        else:
            self._unreceipted += 1

    def rewind(self):
        """Send again from the oldest held record (after a reconnect: the
        broker may have lost what it acknowledged)."""
        self._close_reader()
        self._si = 0
        self._soff = self._off
        self._sread = self._read
        self._peeked = 0
        self._unreceipted = 0

    def release_all(self):
        """Release every sent record (falling back to PUBACK)."""
        n = self._unreceipted
        self._release_to(self._si, self._soff, self._sread)
        return n

    def flush(self):
        """Persist the read cursor (call before deep sleep or reset)."""
        if self._unsaved:
            self._save_meta()
        self._close_reader()

    def clear(self):
        self._close_reader()
        while self._segs:
            n = self._segs.pop(0)[0]
            self._off = self._read = 0
            self._save_meta()
            fsutil.remove(self._path(n))
        self.rewind()

    # -- internals -----------------------------------------------------------
    def _path(self, n):
        return self.dir + "/" + str(n) + ".seg"

    def _head_number(self):
        return self._segs[0][0] if self._segs else self._next_n

    def _release_to(self, i, off, read):
        """Move the read (receipt) cursor to (segment index, offset, records
        read).  Records released before the send cursor were held."""
        if i > self._si or (i == self._si and read >= self._sread):
            # at or past the send cursor: nothing stays held, send from here
            self._close_reader()
            self._si, self._soff, self._sread = i, off, read
            self._peeked = 0
            self._unreceipted = 0
            hold = False
        else:
            hold = True
        n = 0
        while i > 0:
            n += self._segs[0][2] - self._read
            self._finish_head()
            i -= 1
        n += read - self._read
        self._off = off
        self._read = read
        if hold:
            self._unreceipted -= n
        self._unsaved += n
        while self._segs and self._read >= self._segs[0][2]:
            if self._si == 0:
                # the send cursor is at the end of this segment too
                self._close_reader()
                self._si = 1
                self._soff = self._sread = 0
            self._finish_head()  # drained segments leave flash at once
        if self._unsaved >= self.cursor_every:
            self._save_meta()

    def _finish_head(self):
        if self._si == 0:
            self._close_reader()
        n = self._segs.pop(0)[0]
        self._si -= 1
        self._off = self._read = 0
        self._save_meta()
        fsutil.remove(self._path(n))

    def _drop_head(self):
        # Held records (sent, PUBACK, no receipt yet) in the dropped segment
        # are ``evicted``, not ``dropped``: the broker acknowledged them.
        n, _, count = self._segs.pop(0)
        if self._si == 0:
            self._close_reader()
            sent = self._sread - self._read
            self._soff = self._sread = 0
            self._peeked = 0
        else:
            sent = count - self._read
            self._si -= 1
        self._unreceipted -= sent
        self.evicted += sent
        lost = count - self._read - sent
        self.dropped += lost
        self._off = self._read = 0
        self._save_meta()
        fsutil.remove(self._path(n))
        return lost

    def _close_reader(self):
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def _scan(self, n):
        size = count = 0
        last = b"\n"
        buf = bytearray(256)
        with open(self._path(n), "rb") as f:
            while True:
                k = f.readinto(buf)
                if not k:
                    break
                b = bytes(buf[:k])
                count += b.count(b"\n")
                last = b[k - 1 :]
                size += k
        return size, count, last != b"\n"

    def _load_meta(self):
        raw = fsutil.read(self.dir + "/meta")
        if raw:
            try:
                m = json.loads(raw)
                if isinstance(m, dict):
                    return m
            except ValueError:
                pass
        return {}

    def _save_meta(self):
        m = {"h": self._head_number(), "o": self._off, "r": self._read, "d": self.dropped}
        fsutil.write_atomic(self.dir + "/meta", json.dumps(m).encode())
        self._unsaved = 0
