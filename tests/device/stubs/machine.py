# Stand-in for MicroPython's ``machine`` on the Unix port: hardware only.
# State that real hardware keeps outside the program lives in files in the
# current directory (the simulated flash), so a test can read it:
#   _hw_reset      reset cause for the next boot (deep sleep, watchdog, reset())
#   _hw_rtc.bin    RTC slow memory: survives deep sleep, the watchdog and
#                  machine.reset(); cleared at power-on (a boot with no
#                  _hw_reset: the test killed the process, a power cut)
#   _hw_pins.log   every write to an output pin: "<pin> <value>"
#   _hw_sleeps.log every deepsleep(ms) call
#   _hw_adc.txt    optional: the raw value ADC.read_u16() returns ("fail":
#                  the read raises OSError, a broken divider or pin)
#   _hw_wdt.log    every machine.WDT(timeout=ms) started: "<ms>"
#   _hw_inputs.txt optional: levels of input pins, "<pin> <0|1>" a line
#                  (a pin not listed reads its pull: 1 with PULL_UP)
# ruff: noqa: SIM105, RUF005, UP031 - MicroPython code: no contextlib on the Unix port
import os
import sys
import time

PWRON_RESET = 1
HARD_RESET = 2
WDT_RESET = 3
DEEPSLEEP_RESET = 4
SOFT_RESET = 5

DEEPSLEEP_EXIT = 75  # process exit code that means "went to deep sleep"
WDT_EXIT = 76  # "the watchdog would have reset the board"
RESET_EXIT = 77  # machine.reset()


def _read(name):
    try:
        with open(name) as f:
            return f.read()
    except OSError:
        return None


def _write(name, text, mode="w"):
    with open(name, mode) as f:
        f.write(text)


def _remove(name):
    try:
        os.remove(name)
    except OSError:
        pass


_cause = _read("_hw_reset")
_cause = int(_cause) if _cause else PWRON_RESET
_remove("_hw_reset")
if _cause == PWRON_RESET:
    _remove("_hw_rtc.bin")  # RTC memory does not survive power loss


def reset_cause():
    return _cause


def unique_id():
    return b"\x24\x0a\xc4\x00\x00\x01"


def freq(hz=None):
    return 160000000


def idle():
    pass


def lightsleep(ms=0):
    time.sleep_ms(ms)


def deepsleep(ms=0):
    _write("_hw_sleeps.log", str(ms) + "\n", "a")
    _write("_hw_reset", str(DEEPSLEEP_RESET))
    sys.exit(DEEPSLEEP_EXIT)


def reset():
    _write("_hw_reset", str(HARD_RESET))
    sys.exit(RESET_EXIT)


class WDT:
    def __init__(self, id=0, timeout=5000):
        self.timeout = timeout
        self._last = time.ticks_ms()
        _write("_hw_wdt.log", str(timeout) + "\n", "a")

    def feed(self):
        now = time.ticks_ms()
        late = time.ticks_diff(now, self._last)
        if late > self.timeout:
            # a real WDT would already have reset the board
            print("machine stand-in: watchdog starved for", late, "ms")
            _write("_hw_reset", str(WDT_RESET))
            sys.exit(WDT_EXIT)
        self._last = now


class RTC:
    def memory(self, data=None):
        if data is None:
            try:
                with open("_hw_rtc.bin", "rb") as f:
                    return f.read()
            except OSError:
                return b""
        if len(data) > 2048:
            raise ValueError("RTC memory holds at most 2048 bytes")
        with open("_hw_rtc.bin", "wb") as f:
            f.write(data)
        return None

    def datetime(self, dt=None):
        return time.localtime()[:7] + (0,)


class Pin:
    IN = 1
    OUT = 3
    OPEN_DRAIN = 7
    PULL_UP = 2
    PULL_DOWN = 1

    def __init__(self, id, mode=-1, pull=-1, value=None):
        self.id = id
        self.mode = mode
        self._v = 0
        if mode == Pin.IN:
            self._v = 1 if pull == Pin.PULL_UP else 0
            for line in (_read("_hw_inputs.txt") or "").splitlines():
                parts = line.split()
                if len(parts) == 2 and parts[0] == str(id):
                    self._v = int(parts[1])
        if value is not None:
            self.value(value)

    def value(self, v=None):
        if v is None:
            return self._v
        self._v = 1 if v else 0
        if self.mode == Pin.OUT:
            _write("_hw_pins.log", "%s %d\n" % (self.id, self._v), "a")
        return None

    def __call__(self, v=None):
        return self.value(v)

    def on(self):
        self.value(1)

    def off(self):
        self.value(0)


class I2C:
    """A bus with nothing attached: every device address stays silent."""

    def __init__(self, id=0, scl=None, sda=None, freq=400000, timeout=50000):
        self.id = id

    def scan(self):
        return []

    def readfrom_mem(self, addr, reg, n):
        raise OSError(19)  # ENODEV, as the ESP32 port reports a NACK

    def readfrom_mem_into(self, addr, reg, buf):
        raise OSError(19)

    def writeto_mem(self, addr, reg, buf):
        raise OSError(19)


SoftI2C = I2C


class ADC:
    ATTN_0DB = 0
    ATTN_11DB = 3

    def __init__(self, pin, atten=None):
        self.pin = pin

    def atten(self, a):
        pass

    def read_u16(self):
        raw = _read("_hw_adc.txt")
        if raw and raw.strip() == "fail":
            raise OSError(5)  # EIO
        return int(raw) if raw else 40000

    def read_uv(self):
        # 11 dB attenuation: full scale is about 3.1 V on an ESP32
        return self.read_u16() * 3100000 // 65535
