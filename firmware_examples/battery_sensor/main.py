# Battery sensor: wakes, measures the battery through a divider on an ADC
# pin, stores the reading in the flash ring buffer, and goes back to deep
# sleep.  It connects only every ``upload_every`` wakes (WiFi is what drains
# a battery) and then sends everything buffered, oldest first, and listens
# ``awake_ms`` for commands.  The buffer and the sequence number survive
# the sleeps: the ring is in flash, the next sequence number in RTC memory.
#
# A deep sleep ends in a reset, so main.py runs from the top on every wake.
import json

from machine import ADC, Pin

from iggy_device import config
from iggy_device.node import Device


def main():
    cfg = config.load()
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

    if (wakes + 1) % cfg.upload_every == 0 or mv < low_mv:
        if dev.connect():
            dev.flush(budget_ms=cfg.awake_ms * 4)
            dev.wait(cfg.awake_ms)  # commands queued for us arrive now
    period = dev.wake.get("period_ms", cfg.period_ms)
    if not cfg.deep_sleep:
        dev.shutdown()
        print("IGGY-DONE", json.dumps(dev.diag()))
        return
    dev.sleep(period)  # does not return: the board resets on wake


main()
