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
            n = int(raw)
        except ValueError:
            # A corrupt file must not restart the sequence at 0: that would
            # repeat numbers.  There is nothing better to resume from, so the
            # device says so in its diagnostics (``recovered``).
            n = 0
            self.recovered = True
        else:
            self.recovered = False
        self._next = n
        self._limit = n
        self.writes = 0

    def resume(self, value):
        """Continue at ``value`` (from RTC memory after deep sleep) when
        it lies inside the last reserved block; returns whether it did."""
        start = self._limit - self.block
        if start <= value <= self._limit:
            self._next = value
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
