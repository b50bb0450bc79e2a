# Battery sensor: wakes, measures the battery through a divider on an ADC
# pin, stores the reading in the flash ring buffer, and goes back to deep
# sleep.  It connects only every ``upload_every`` wakes (WiFi is what drains
# a battery) and then sends everything buffered, oldest first, and listens
# ``awake_ms`` for commands.  The buffer and the sequence number survive
# the sleeps: the ring is in flash, the next sequence number in RTC memory.
#
# A deep sleep ends in a reset, so main.py runs from the top on every wake.
#
# Awake budget: ``awake_budget_ms`` starts a watchdog that nothing feeds, so
# whatever hangs (a broker that never answers, a driver) the board resets
# within it; the wake after such a reset skips the upload and sleeps.  An
# uncaught error deep-sleeps too (hw.start).  A low cell (``low_mv``) is
# reported at once, then uploads happen only every ``low_upload_every``
# wakes (default 4 x upload_every): each connect costs more than a reading.
import json

from machine import ADC, Pin

from iggy_device.node import Device  # first: compiling node.py from source needs the most heap
from iggy_device import hw


def main(cfg):
    dev = Device(cfg)
    app = cfg.app
    adc = ADC(Pin(app.get("adc_pin", 35)))
    adc.atten(ADC.ATTN_11DB)
    ratio = app.get("divider", 2.0)  # 100k/100k divider halves the cell voltage
    low_mv = app.get("low_mv", 3400)

    @dev.command("set_period")
    def set_period(args):
        ms = args.get("period_ms")
        if not isinstance(ms, int) or ms < 1000:
            raise ValueError("period_ms must be an integer >= 1000")
        dev.wake["period_ms"] = ms  # kept in RTC memory across sleeps
        return {"period_ms": ms}

    wakes = dev.wake.get("n", 0)
    mv = int(adc.read_uv() * ratio) // 1000
    dev.publish("battery", {"mv": mv, "wake": wakes})
    dev.wake["n"] = wakes + 1

    upload = (wakes + 1) % cfg.upload_every == 0
    if mv < low_mv:
        if not dev.wake.get("low"):
            upload = True  # say it once, as it happens
            dev.log("battery low:", mv, "mV")
        else:
            upload = (wakes + 1) % app.get("low_upload_every", 4 * cfg.upload_every) == 0
        dev.wake["low"] = 1
    else:
        dev.wake["low"] = 0
    if dev.reset_cause == "wdt":
        # the last wake ran out of its awake budget: do not spend another now
        dev.log("woke from the watchdog (awake budget): no upload this wake")
        upload = False
    if upload and dev.connect():
        dev.flush(budget_ms=cfg.awake_ms * 4)
        dev.wait(cfg.awake_ms)  # commands queued for us arrive now
    period = dev.wake.get("period_ms", cfg.period_ms)
    if not cfg.deep_sleep:
        dev.shutdown()
        print("IGGY-DONE", json.dumps(dev.diag()))
        return
    dev.sleep(period)  # does not return: the board resets on wake


# safe mode (/safe or safe_pin held low) starts nothing; an uncaught error
# is logged, then the board deep-sleeps for period_ms (hw.start)
hw.start(main, battery=True)
