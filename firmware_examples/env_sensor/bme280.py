# Minimal Bosch BME280 / BMP280 driver for MicroPython (I2C, forced mode).
#
# Register map and the integer compensation formulas follow the Bosch
# BME280 datasheet (section 4.2.3, "compensation formulas in 32/64-bit
# fixed point"): integers keep the results exact on ports whose floats are
# single precision, such as the ESP32.  Pure: needs only an object with
# readfrom_mem / writeto_mem (machine.I2C), so it is tested on CPython.
import time
from micropython import const

ADDRESSES = (0x76, 0x77)
CHIP_BME280 = 0x60
CHIP_BMP280 = 0x58

_REG_ID = const(0xD0)
_REG_CALIB_TP = const(0x88)  # 26 bytes: T1..T3, P1..P9, (0xA0), H1 at 0xA1
_REG_CALIB_H = const(0xE1)  # 7 bytes: H2..H6
_REG_CTRL_HUM = const(0xF2)
_REG_STATUS = const(0xF3)
_REG_CTRL_MEAS = const(0xF4)
_REG_DATA = const(0xF7)  # 8 bytes: press[3] temp[3] hum[2]

_sleep_ms = getattr(time, "sleep_ms", None) or (lambda ms: time.sleep(ms / 1000))


def _u16(b, i):
    return b[i] | (b[i + 1] << 8)


def _s16(b, i):
    v = _u16(b, i)
    return v - 65536 if v & 0x8000 else v


def _s8(v):
    return v - 256 if v & 0x80 else v


def _s12(v):
    return v - 4096 if v & 0x800 else v


def _tdiv(a, b):
    # C integer division truncates toward zero
    q = abs(a) // abs(b)
    return q if (a >= 0) == (b >= 0) else -q


class Calibration:
    def __init__(self, data, h=None):
        self.T1 = _u16(data, 0)
        self.T2 = _s16(data, 2)
        self.T3 = _s16(data, 4)
        self.P1 = _u16(data, 6)
        self.P = [_s16(data, 8 + 2 * i) for i in range(8)]  # P2..P9
        self.has_h = h is not None
        if h is not None:
            self.H1 = data[25]
            self.H2 = _s16(h, 0)
            self.H3 = h[2]
            self.H4 = _s12((h[3] << 4) | (h[4] & 0x0F))
            self.H5 = _s12((h[5] << 4) | (h[4] >> 4))
            self.H6 = _s8(h[6])

    @classmethod
    def from_values(cls, t, p, h=None):
        """Calibration from datasheet-style numbers (tests, examples)."""
        self = cls.__new__(cls)
        self.T1, self.T2, self.T3 = t
        self.P1 = p[0]
        self.P = list(p[1:])
        self.has_h = h is not None
        if h is not None:
            self.H1, self.H2, self.H3, self.H4, self.H5, self.H6 = h
        return self


def compensate(cal, adc_t, adc_p, adc_h=None):
    """(temperature in 0.01 degC, pressure in Pa * 256, humidity in %RH *
    1024 or None) from raw ADC values."""
    v1 = (((adc_t >> 3) - (cal.T1 << 1)) * cal.T2) >> 11
    d = (adc_t >> 4) - cal.T1
    v2 = (((d * d) >> 12) * cal.T3) >> 14
    t_fine = v1 + v2
    t = (t_fine * 5 + 128) >> 8

    P2, P3, P4, P5, P6, P7, P8, P9 = cal.P
    v1 = t_fine - 128000
    v2 = v1 * v1 * P6
    v2 = v2 + ((v1 * P5) << 17)
    v2 = v2 + (P4 << 35)
    v1 = ((v1 * v1 * P3) >> 8) + ((v1 * P2) << 12)
    v1 = (((1 << 47) + v1) * cal.P1) >> 33
    if v1 == 0:
        p = 0
    else:
        p = 1048576 - adc_p
        p = _tdiv(((p << 31) - v2) * 3125, v1)
        v1 = (P9 * (p >> 13) * (p >> 13)) >> 25
        v2 = (P8 * p) >> 19
        p = ((p + v1 + v2) >> 8) + (P7 << 4)

    h = None
    if adc_h is not None and cal.has_h:
        x = t_fine - 76800
        x = ((((adc_h << 14) - (cal.H4 << 20) - (cal.H5 * x)) + 16384) >> 15) * (
            ((((((x * cal.H6) >> 10) * (((x * cal.H3) >> 11) + 32768)) >> 10) + 2097152) * cal.H2 + 8192)
            >> 14
        )
        x = x - (((((x >> 15) * (x >> 15)) >> 7) * cal.H1) >> 4)
        x = 0 if x < 0 else x
        x = 419430400 if x > 419430400 else x
        h = x >> 12
    return t, p, h


class BME280:
    def __init__(self, i2c, address=0x76):
        self.i2c = i2c
        self.address = address
        chip = i2c.readfrom_mem(address, _REG_ID, 1)[0]
        if chip not in (CHIP_BME280, CHIP_BMP280):
            raise OSError("no BME280/BMP280 at 0x%02x (chip id 0x%02x)" % (address, chip))
        self.chip = chip
        data = i2c.readfrom_mem(address, _REG_CALIB_TP, 26)
        h = i2c.readfrom_mem(address, _REG_CALIB_H, 7) if chip == CHIP_BME280 else None
        self.cal = Calibration(data, h)

    def read_raw(self):
        a = self.address
        if self.chip == CHIP_BME280:
            self.i2c.writeto_mem(a, _REG_CTRL_HUM, b"\x01")  # humidity x1
        self.i2c.writeto_mem(a, _REG_CTRL_MEAS, b"\x25")  # T x1, P x1, forced
        for _ in range(20):  # x1 oversampling takes < 10 ms
            _sleep_ms(2)
            if not self.i2c.readfrom_mem(a, _REG_STATUS, 1)[0] & 0x08:
                break
        d = self.i2c.readfrom_mem(a, _REG_DATA, 8)
        adc_p = (d[0] << 12) | (d[1] << 4) | (d[2] >> 4)
        adc_t = (d[3] << 12) | (d[4] << 4) | (d[5] >> 4)
        adc_h = (d[6] << 8) | d[7] if self.chip == CHIP_BME280 else None
        return adc_t, adc_p, adc_h

    def read(self):
        """{"temp_c", "pressure_pa", "humidity_pct"?} with two decimals."""
        t, p, h = compensate(self.cal, *self.read_raw())
        out = {"temp_c": t / 100, "pressure_pa": round(p / 256, 2)}
        if h is not None:
            out["humidity_pct"] = round(h / 1024, 2)
        return out


def probe(i2c):
    """The first BME280/BMP280 that answers on ``i2c``, or None."""
    try:
        found = i2c.scan()
    except OSError:
        return None
    for a in ADDRESSES:
        if a in found:
            try:
                return BME280(i2c, a)
            except OSError:
                pass
    return None
