# The thin hardware layer: everything that touches ``machine``, ``network``
# or the RTC lives here, so the rest of the library is pure logic and the
# tests can put small stand-ins for these two modules on the path.
# ``start()`` is how an example boots: safe mode, then its main() under a
# last-resort guard.
import gc
import sys
import time

import machine
import network

from . import fsutil

_EPOCH_2000 = 946684800  # ports whose time() counts from 2000
_CLOCK_VALID = 1672531200  # 2023-01-01: anything earlier means "not set"


SAFE_FILE = "safe"  # /safe on the board: boot to the REPL, start nothing
FATAL_FILE = "fatal.txt"  # the last uncaught exception, for a board without a console


class Hardware:
    def __init__(self, wdt_ms=0, log=None, ntp_host=None, budget_ms=0):
        # budget_ms: a watchdog that is never fed, so the board resets after
        # that long awake whatever hangs (battery boards: the deep sleep that
        # follows the reset is what saves the cell).  It takes the one
        # hardware watchdog, so it replaces wdt_ms.
        self._budget = budget_ms > 0
        ms = budget_ms if budget_ms > 0 else wdt_ms
        self._wdt = machine.WDT(timeout=ms) if ms else None
        self._wlan = None
        self._log = log or _nolog
        self._ntp_host = ntp_host
        self._epoch_offset = _EPOCH_2000 if time.gmtime(0)[0] == 2000 else 0

    @classmethod
    def from_config(cls, cfg, log=None):
        return cls(cfg.wdt_ms, log, cfg.ntp_host, cfg.awake_budget_ms)

    # -- watchdog ------------------------------------------------------------
    def feed(self):
        if self._wdt is not None and not self._budget:
            self._wdt.feed()

    # -- WiFi ----------------------------------------------------------------
    def wifi_connected(self):
        return self._wlan is not None and self._wlan.isconnected()

    def wifi_begin(self, ssid, password):
        """Start joining the access point and return at once (the caller
        polls wifi_connected()).  While the driver is reconnecting by itself
        (ESP32: after a lost link) it is left alone: disconnect() would
        cancel that."""
        if self._wlan is None:
            self._wlan = network.WLAN(network.STA_IF)
        wlan = self._wlan
        wlan.active(True)
        if wlan.isconnected() or wlan.status() == getattr(network, "STAT_CONNECTING", None):
            return
        try:
            wlan.connect(ssid, password)
        except OSError as e:
            # a stale attempt the driver gave up on: clear it, start again
            self._log("wifi:", repr(e))
            try:
                wlan.disconnect()
                wlan.connect(ssid, password)
            except OSError as e2:
                self._log("wifi:", repr(e2))

    def wifi_off(self):
        if self._wlan is not None:
            self._wlan.active(False)

    # -- clock -----------------------------------------------------------------
    def unix_time(self):
        """Seconds since 1970, or None while the clock is not set."""
        t = int(time.time()) + self._epoch_offset
        return t if t >= _CLOCK_VALID else None

    def sync_clock(self):
        try:
            import ntptime
        except ImportError:
            return False
        if self._ntp_host:
            ntptime.host = self._ntp_host  # default: the broker (an isolated LAN has no pool.ntp.org)
        try:
            ntptime.settime()
            return True
        except (OSError, OverflowError, IndexError) as e:
            self._log("ntp:", repr(e))
            return False

    # -- power -----------------------------------------------------------------
    def reset_cause(self):
        cause = machine.reset_cause()
        for name in ("PWRON_RESET", "HARD_RESET", "WDT_RESET", "DEEPSLEEP_RESET", "SOFT_RESET"):
            if getattr(machine, name, None) == cause:
                return name[:-6].lower()
        return str(cause)

    def woke_from_deepsleep(self):
        return machine.reset_cause() == getattr(machine, "DEEPSLEEP_RESET", -1)

    def deepsleep(self, ms):
        self.wifi_off()
        machine.deepsleep(ms)

    def rtc_load(self):
        try:
            return bytes(machine.RTC().memory())
        except (AttributeError, OSError):
            return b""

    def rtc_save(self, data):
        try:
            machine.RTC().memory(data)
        except (AttributeError, OSError):
            pass

    def heap(self):
        gc.collect()
        return gc.mem_free(), gc.mem_alloc()


def _nolog(*args):
    pass


# -- boot ----------------------------------------------------------------------
def safe_mode(pin=None):
    """Why the board must not start its application (None: start it).

    ``/safe`` exists (provisioning writes it, and removes it as its last
    step), or ``pin`` is held low at boot (the BOOT button on GPIO0 of most
    ESP32 boards, for a board that deep-sleeps and cannot be reached).
    Nothing is started in safe mode, the watchdog least of all: on ESP32 a
    soft reset does not stop a started ``machine.WDT``."""
    if fsutil.exists(SAFE_FILE):
        return "/" + SAFE_FILE + " exists"
    if pin is not None and machine.Pin(pin, machine.Pin.IN, machine.Pin.PULL_UP).value() == 0:
        return "pin " + str(pin) + " held low"
    return None


def start(main, battery=False):
    """Boot an example: ``main(cfg)`` unless in safe mode, under a last
    resort guard.  An exception nothing else caught is printed and kept in
    ``fatal.txt``; then the board deep-sleeps ``period_ms`` (battery) or
    resets after 10 s (mains) instead of sitting at the REPL until someone
    comes.  RTC memory is cleared: it may hold a sequence number this run
    used (a gap is fine, a repeat is not).  KeyboardInterrupt (Ctrl-C,
    mpremote) and SystemExit are not caught."""
    from . import config

    cfg = None
    try:
        why = safe_mode()
        if why is None:
            gc.collect()  # the imports' garbage: Config's attribute table needs one contiguous block
            cfg = config.load()
            why = safe_mode(cfg.safe_pin)
        if why is not None:
            print("[iggy] safe mode:", why, "- not starting")
            return
        main(cfg)
    except Exception as e:  # noqa: BLE001 - the last resort: nothing above it would
        sleep = cfg.deep_sleep if cfg else battery
        print("[iggy] fatal:", repr(e), "- deep sleep" if sleep else "- reset in 10 s")
        getattr(sys, "print_exception", print)(e)
        Hardware().rtc_save(b"")
        try:
            fsutil.write_atomic(FATAL_FILE, repr(e)[:200].encode())
        except OSError:
            pass  # a full or broken filesystem: the console has it
        if sleep:
            machine.deepsleep(cfg.period_ms if cfg else 300000)  # the radio sleeps with the chip
        time.sleep_ms(10000)  # a boot loop slow enough to interrupt (Ctrl-C)
        machine.reset()
