# Environmental sensor: BME280/BMP280 on I2C (or a DHT22), publishing on
# edge/{device}/up/env every period_ms.  With no sensor answering it sends
# simulated values marked "sim": 1, so a board can be tested on a desk.
#
# Files on the board: /main.py, /bme280.py, /config.json (+ config.local.json
# with secrets), /lib/iggy_device/, /lib/umqtt/simple.py.
import json
import math

from machine import I2C, Pin

# the library first, bme280 after it: compiled on the board from source,
# node.py needs the most heap of all, and gets it before anything else is
# loaded beside it (bench/device_min_heap.py --source: 72k fails otherwise)
from iggy_device.node import Device
from iggy_device import hw

# isort: split
import bme280


def find_sensor(app, log):
    try:
        i2c = I2C(
            app.get("i2c_bus", 0), scl=Pin(app.get("scl", 22)), sda=Pin(app.get("sda", 21)), freq=100000
        )
        s = bme280.probe(i2c)
        if s is not None:
            log("sensor: BME280" if s.chip == bme280.CHIP_BME280 else "sensor: BMP280")
            return s.read
    except OSError as e:
        log("i2c:", repr(e))
    pin = app.get("dht_pin")
    if pin is not None:
        import dht

        d = dht.DHT22(Pin(pin))

        def read_dht():
            d.measure()
            return {"temp_c": d.temperature(), "humidity_pct": d.humidity()}

        try:
            read_dht()
            log("sensor: DHT22")
        except OSError as e:  # nothing answers on the pin
            log("dht22:", repr(e))
        except Exception as e:  # noqa: BLE001 - the dht driver's "checksum error": a sensor that is there
            log("sensor: DHT22 (first read:", repr(e) + ")")
            return read_dht
        else:
            return read_dht
    log("sensor: none answers, sending simulated readings")
    return None


class Simulated:
    """Smooth, plausible values (a slow daily-like wave), clearly marked."""

    def __init__(self):
        self.k = 0

    def read(self):
        self.k += 1
        x = self.k / 60
        return {
            "temp_c": round(21 + 2 * math.sin(x), 2),
            "humidity_pct": round(45 + 5 * math.cos(x), 2),
            "pressure_pa": round(101325 + 80 * math.sin(x / 3), 1),
            "sim": 1,
        }


def main(cfg):
    dev = Device(cfg)
    app = cfg.app
    sensor = find_sensor(app, dev.log)
    errors = [0]

    if sensor is None:
        read = Simulated().read
    else:

        def read():
            try:
                return sensor()
            except Exception as e:  # noqa: BLE001 - a loose wire (OSError), a DHT checksum
                # error (plain Exception): count it, keep running
                errors[0] += 1
                dev.log("sensor read failed:", repr(e))
                return None

    @dev.on_config
    def apply(desired):
        # {"period_ms": n} changes the reporting interval at run time
        p = desired.get("period_ms")
        if isinstance(p, int) and p >= 100:
            cfg.period_ms = p
            dev.log("config: period_ms ->", p)

    n = dev.run(read, "env")
    # only reached when config "cycles" limits the run (tests, bench)
    dev.flush()
    dev.shutdown()
    # printed key by key: the whole document as one string was the block a
    # 56k heap lacked at the end of the run
    d = dev.diag()
    print("IGGY-DONE {", end="")
    for k in d:
        print(json.dumps(k) + ":", json.dumps(d[k]), end=", ")
    d = None
    print('"cycles":', n, end=", ")
    print('"sensor_errors":', errors[0], end="}\n")


# safe mode (/safe or safe_pin held low) starts nothing; an uncaught error
# is logged, then the board resets (hw.start)
hw.start(main)
