# Capped exponential backoff with jitter ("equal jitter": half fixed, half
# random), so a fleet of sensors that lost the same access point does not
# reconnect in lockstep, and a retry never comes sooner than base/2.
import random


class Backoff:
    def __init__(self, base_ms=500, cap_ms=60000, rand=None):
        if base_ms <= 0 or cap_ms < base_ms:
            raise ValueError("backoff: need 0 < base_ms <= cap_ms")
        self.base_ms = base_ms
        self.cap_ms = cap_ms
        self.attempts = 0
        # rand(n) -> int in [0, n]; injectable so tests are deterministic
        self._rand = rand or _rand

    def next_ms(self):
        """Delay before the next attempt; each call counts one failure."""
        limit = min(self.base_ms << min(self.attempts, 20), self.cap_ms)
        self.attempts += 1
        half = limit // 2
        return half + self._rand(limit - half)

    def reset(self):
        self.attempts = 0


def _rand(n):
    if n <= 0:
        return 0
    # getrandbits exists on every MicroPython port and on CPython
    return random.getrandbits(24) % (n + 1)
