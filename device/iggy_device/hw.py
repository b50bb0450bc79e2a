# The thin hardware layer: everything that touches ``machine``, ``network``
# or the RTC lives here, so the rest of the library is pure logic and the
# tests can put small stand-ins for these two modules on the path.
# ``start()`` is how an example boots: safe mode, then its main() under a
# last-resort guard.
import gc
import time

import machine
import network
from micropython import const


_EPOCH_2000 = const(946684800)  # ports whose time() counts from 2000
_CLOCK_VALID = const(1672531200)  # 2023-01-01: anything earlier means "not set"


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
        w = self._wlan
        w.active(True)
        if w.isconnected() or w.status() == getattr(network, "STAT_CONNECTING", None):
            return
        try:
            w.connect(ssid, password)
        except OSError as e:
            # a stale attempt the driver gave up on: clear it, start again
            self._log("wifi:", repr(e))
            try:
                w.disconnect()
                w.connect(ssid, password)
            except OSError as err:
                self._log("wifi:", repr(err))

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
        c = machine.reset_cause()
        for name in ("PWRON_RESET", "HARD_RESET", "WDT_RESET", "DEEPSLEEP_RESET", "SOFT_RESET"):
            if getattr(machine, name, None) == c:
                return name[:-6].lower()
        return str(c)

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
def start(main, battery=False):
    """Boot an example: ``main(cfg)`` unless in safe mode, under a last
    resort guard (boot.py: safe mode, the config, and what the guard does
    with an exception nothing else caught).  boot.py is loaded for the
    config and dropped before ``main`` runs, and again only for a fatal
    error: this frame lives as long as the board runs, so it stays small."""
    from . import unload

    cfg = None
    try:
        from . import boot

        try:
            cfg = boot.load()  # None: safe mode
        finally:
            unload("boot")
        if cfg is not None:
            main(cfg)
    except Exception as e:  # noqa: BLE001 - the last resort: nothing above it would
        gc.collect()  # main's frames are gone: their objects too
        try:
            from . import boot
        except MemoryError:
            machine.reset()  # no room even for the last resort: a reset is what it would end in
        boot.fatal(e, cfg, battery)
