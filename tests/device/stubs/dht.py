# Stand-in for MicroPython's ``dht``: no sensor on the wire, so measure()
# times out the way the real driver does when nothing answers.
class _DHT:
    def __init__(self, pin):
        self.pin = pin

    def measure(self):
        raise OSError(110)  # ETIMEDOUT

    def temperature(self):
        raise OSError(110)

    def humidity(self):
        raise OSError(110)


class DHT11(_DHT):
    pass


class DHT22(_DHT):
    pass
