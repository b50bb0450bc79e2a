# Actuator: a relay and a status LED that obey commands from the gateway.
#
#   edge/{device}/down/cmd  {"id": "c1", "name": "set_relay", "args": {"on": true}}
#   edge/{device}/up/ack    {"id": "c1", "status": "ok", "result": {"relay": 1, ...}}
#
# Commands: set_relay {"on": bool}, blink {"times": 1..20, "ms": 20..1000},
# get_state {}.  A command id the library has seen recently (a broker
# redelivery, a retry) is acknowledged again without switching again.
# The relay state is reported on edge/{device}/up/state every period_ms and
# right after each change; it is persisted so a reboot restores it.
import json
import time

from machine import Pin

from iggy_device.node import Device  # first: compiling node.py from source needs the most heap
from iggy_device import fsutil, hw

STATE_FILE = "relay.json"


def main(cfg):
    dev = Device(cfg)
    app = cfg.app
    saved = json.loads(fsutil.read(STATE_FILE, b'{"on": false}'))
    relay = Pin(app.get("relay_pin", 26), Pin.OUT, value=1 if saved.get("on") else 0)
    led = Pin(app.get("led_pin", 2), Pin.OUT, value=0)
    state = {"switches": 0, "blinks": 0}

    def snapshot():
        return {"relay": relay.value(), "switches": state["switches"], "blinks": state["blinks"]}

    @dev.command("set_relay")
    def set_relay(args):
        on = args.get("on")
        if not isinstance(on, bool):
            raise ValueError("args.on must be true or false")
        relay.value(1 if on else 0)
        state["switches"] += 1
        fsutil.write_atomic(STATE_FILE, json.dumps({"on": on}).encode())
        dev.publish("state", snapshot())
        return snapshot()

    @dev.command("blink")
    def blink(args):
        times = args.get("times", 3)
        ms = args.get("ms", 100)
        if not (isinstance(times, int) and 1 <= times <= 20 and isinstance(ms, int) and 20 <= ms <= 1000):
            raise ValueError("blink: times 1..20, ms 20..1000")
        for _ in range(times):
            led.on()
            time.sleep_ms(ms)
            led.off()
            time.sleep_ms(ms)
            dev.hw.feed()
        state["blinks"] += times
        return snapshot()

    @dev.command("get_state")
    def get_state(args):
        return snapshot()

    @dev.on_config
    def apply(desired):
        p = desired.get("period_ms")
        if isinstance(p, int) and p >= 100:
            cfg.period_ms = p

    n = dev.run(snapshot, "state")
    dev.flush()
    dev.shutdown()
    d = dev.diag()
    d["cycles"] = n
    print("IGGY-DONE", json.dumps(d))


# safe mode (/safe or safe_pin held low) starts nothing; an uncaught error
# is logged, then the board resets (hw.start)
hw.start(main)
