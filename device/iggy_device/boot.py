# Boot-only: safe mode and the config (loaded by hw.start, then unloaded),
# and the last resort for an exception nothing else caught (loaded again
# only then: the stack has unwound, so the heap has room for it).
import gc
import sys
import time

import machine

from . import fsutil

SAFE_FILE = "safe"  # /safe on the board: boot to the REPL, start nothing
FATAL_FILE = "fatal.txt"  # the last uncaught exception, for a board without a console


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


def load():
    """The config, or None in safe mode (said on the console)."""
    from . import config

    cfg = None
    why = safe_mode()
    if why is None:
        gc.collect()  # the imports' garbage: Config's attribute table needs one contiguous block
        cfg = config.load()
        why = safe_mode(cfg.safe_pin)
    if why is not None:
        print("[iggy] safe mode:", why, "- not starting")
        return None
    return cfg


def fatal(e, cfg, battery):
    """An exception nothing else caught is printed and kept in ``fatal.txt``;
    then the board deep-sleeps ``period_ms`` (battery) or resets after 10 s
    (mains) instead of sitting at the REPL until someone comes.  RTC memory
    is cleared: it may hold a sequence number this run used (a gap is fine,
    a repeat is not).  KeyboardInterrupt (Ctrl-C, mpremote) and SystemExit
    are not caught (hw.start catches Exception only)."""
    sleep = cfg.deep_sleep if cfg else battery
    print("[iggy] fatal:", repr(e), "- deep sleep" if sleep else "- reset in 10 s")
    getattr(sys, "print_exception", print)(e)
    try:
        machine.RTC().memory(b"")
    except (AttributeError, OSError):
        pass
    try:
        fsutil.write_atomic(FATAL_FILE, repr(e)[:200].encode())
    except OSError:
        pass  # a full or broken filesystem: the console has it
    if sleep:
        machine.deepsleep(cfg.period_ms if cfg else 300000)  # the radio sleeps with the chip
    time.sleep_ms(10000)  # a boot loop slow enough to interrupt (Ctrl-C)
    machine.reset()
