# Stand-in for MicroPython's ``dht``.  With no ``_hw_dht.txt`` in the
# current directory there is no sensor on the wire, so measure() times out
# the way the real driver does when nothing answers (OSError ETIMEDOUT).
# ``_hw_dht.txt`` holds a cycle of outcomes, one word per measure() call:
#   ok        a reading (21.5 C, 40.0 %)
#   checksum  the real driver's ``raise Exception("checksum error")``: a bit
#             flipped on a long wire (it is not an OSError)
#   timeout   OSError(110), as with nothing connected
_calls = [0]


def _plan():
    try:
        with open("_hw_dht.txt") as f:
            words = f.read().split()
    except OSError:
        return None
    return words or None


class _DHT:
    def __init__(self, pin):
        self.pin = pin
        self._ok = False

    def measure(self):
        plan = _plan()
        if plan is None:
            raise OSError(110)  # ETIMEDOUT
        word = plan[_calls[0] % len(plan)]
        _calls[0] += 1
        if word == "ok":
            self._ok = True
            return
        self._ok = False
        if word == "checksum":
            raise Exception("checksum error")  # what micropython's dht.py raises
        raise OSError(110)

    def temperature(self):
        if not self._ok:
            raise OSError(110)
        return 21.5

    def humidity(self):
        if not self._ok:
            raise OSError(110)
        return 40.0


class DHT11(_DHT):
    pass


class DHT22(_DHT):
    pass
