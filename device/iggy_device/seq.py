# Device sequence numbers that survive reboots without a flash write per
# reading: the file holds the end of a reserved block; a boot resumes at that
# end (numbers handed out before a crash are never reused; a crash costs at
# most one block of gaps).  A deep-sleep wake may resume exactly where it
# stopped with ``resume()`` (RTC memory survives deep sleep, not power loss).
from . import fsutil


class Sequence:
    def __init__(self, path, block=64):
        if block < 1:
            raise ValueError("seq: block must be >= 1")
        self.path = path
        self.block = block
        raw = fsutil.read(path, b"0")
        try:
            reserved = int(raw)
        except ValueError:
            # A corrupt file must not restart the sequence at 0: that would
            # repeat numbers.  There is nothing better to resume from, so the
            # device says so in its diagnostics (``recovered``).
            reserved = 0
            self.recovered = True
        else:
            self.recovered = False
        self._next = reserved
        self._limit = reserved
        self.writes = 0

    def resume(self, next_value):
        """Continue at ``next_value`` (from RTC memory after deep sleep) when
        it lies inside the last reserved block; returns whether it did."""
        lo = self._limit - self.block
        if lo <= next_value <= self._limit:
            self._next = next_value
            return True
        return False

    def peek(self):
        return self._next

    def next(self):
        if self._next >= self._limit:
            self._limit = self._next + self.block
            fsutil.write_atomic(self.path, str(self._limit).encode())
            self.writes += 1
        n = self._next
        self._next = n + 1
        return n
