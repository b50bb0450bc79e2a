# Stand-in for MicroPython's ``network`` (ESP32 station interface).  The
# link is up after connect() unless a file ``_hw_wifi_down`` exists in the
# current directory (a test creates it to take the access point away).
#
# Like the ESP32 driver (reconnects unlimited, the default), a station that
# was asked to connect keeps trying by itself while the access point is
# away: status() is STAT_CONNECTING and the link comes back on its own.
# disconnect() cancels that (the station stays down until connect()).
# Every connect()/disconnect() is appended to ``_hw_wifi.log`` so a test
# can see what the library asked of the driver.
import os

STA_IF = 0
AP_IF = 1
STAT_IDLE = 1000
STAT_CONNECTING = 1001
STAT_GOT_IP = 1010
STAT_NO_AP_FOUND = 201


def _ap_present():
    try:
        os.stat("_hw_wifi_down")
        return False
    except OSError:
        return True


def _log(what):
    with open("_hw_wifi.log", "a") as f:
        f.write(what + "\n")


class WLAN:
    def __init__(self, interface=STA_IF):
        self._active = False
        self._ssid = None

    def active(self, v=None):
        if v is None:
            return self._active
        self._active = bool(v)
        if not v:
            self._ssid = None
        return None

    def connect(self, ssid=None, key=None):
        _log("connect")
        if not self._active:
            raise OSError("Wifi Not Started")
        self._ssid = ssid

    def disconnect(self):
        _log("disconnect")
        self._ssid = None

    def isconnected(self):
        return self._active and self._ssid is not None and _ap_present()

    def status(self, param=None):
        if self.isconnected():
            return STAT_GOT_IP
        return STAT_CONNECTING if self._ssid is not None else STAT_IDLE

    def ifconfig(self, cfg=None):
        return ("127.0.0.1", "255.0.0.0", "127.0.0.1", "127.0.0.1")

    def config(self, *args, **kwargs):
        return None
