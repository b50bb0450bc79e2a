"""The device library's pure modules under CPython: ring buffer, sequence,
backoff, command codec, recent-command ring, config, BME280 maths.  The same
modules run under the MicroPython Unix port in test_pure_micropython.py."""

from __future__ import annotations

import json
import random
from collections import deque
from pathlib import Path

import bme280
import pytest
from iggy_device import codec, commands, config
from iggy_device.backoff import Backoff
from iggy_device.ring import Ring
from iggy_device.seq import Sequence

pytestmark = pytest.mark.unit


def _rec_id(rec: tuple[str, memoryview] | None) -> int:
    assert rec is not None
    return int(json.loads(bytes(rec[1]))["i"])


def _disk_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.seg"))


# -- ring buffer ---------------------------------------------------------------
@pytest.mark.parametrize("seed", range(6))
def test_ring_against_a_list_model_with_crashes_and_reopens(tmp_path: Path, seed: int) -> None:
    rnd = random.Random(seed)
    d = tmp_path / "ring"
    max_bytes, seg, every = 1024, 256, 4
    ring = Ring(str(d), max_bytes=max_bytes, segment_bytes=seg, cursor_every=every)
    model: deque[int] = deque()  # what the ring must hold, oldest first
    delivered: list[int] = []
    dropped_ids: list[int] = []
    next_id = 0
    for _ in range(600):
        op = rnd.random()
        if op < 0.5:
            pad = "x" * rnd.randrange(0, 60)
            lost = ring.append("ch", json.dumps({"i": next_id, "p": pad}))
            for _ in range(lost):
                dropped_ids.append(model.popleft())  # the oldest go, never the newest
            model.append(next_id)
            next_id += 1
        elif op < 0.85:
            rec = ring.peek()
            if not model:
                assert rec is None
                continue
            assert _rec_id(rec) == model[0]
            ring.pop()
            delivered.append(model.popleft())
        elif op < 0.93:
            # power cut: no flush; the reopened ring may replay up to
            # cursor_every - 1 records that were already delivered
            ring._close_reader()  # the handle dies with the power; nothing is saved
            ring = Ring(str(d), max_bytes=max_bytes, segment_bytes=seg, cursor_every=every)
            extra = len(ring) - len(model)
            assert 0 <= extra < every
            if extra:
                model.extendleft(reversed(delivered[-extra:]))
        else:
            ring.flush()
            ring = Ring(str(d), max_bytes=max_bytes, segment_bytes=seg, cursor_every=every)
        assert len(ring) == len(model)
        assert ring.dropped == len(dropped_ids)
        assert _disk_bytes(d) <= max_bytes
        assert ring.bytes_used() == _disk_bytes(d)
    ring.flush()
    # every record is accounted for: delivered (at least once), held, or counted as dropped
    never_delivered = set(range(next_id)) - set(delivered)
    assert never_delivered <= set(model) | set(dropped_ids)


def test_ring_keeps_everything_while_it_has_room_oldest_first(tmp_path: Path) -> None:
    ring = Ring(str(tmp_path / "r"), max_bytes=4096, segment_bytes=512)
    for i in range(100):  # about 2.4 kB: fits
        ring.append("env", json.dumps({"i": i}))
    ring = Ring(str(tmp_path / "r"), max_bytes=4096, segment_bytes=512)  # reboot
    out = []
    while (rec := ring.peek()) is not None:
        out.append(_rec_id(rec))
        ring.pop()
    assert out == list(range(100))
    assert ring.dropped == 0
    assert not list((tmp_path / "r").glob("*.seg"))  # drained segments are deleted


def test_ring_overflow_drops_oldest_and_counts_exactly(tmp_path: Path) -> None:
    ring = Ring(str(tmp_path / "r"), max_bytes=1024, segment_bytes=256)
    n = 300
    for i in range(n):
        ring.append("env", json.dumps({"i": i}))
    out = []
    while (rec := ring.peek()) is not None:
        out.append(_rec_id(rec))
        ring.pop()
    assert out == list(range(n - len(out), n))  # a contiguous newest suffix
    assert ring.dropped == n - len(out) > 0
    # the count is persisted
    assert Ring(str(tmp_path / "r"), max_bytes=1024, segment_bytes=256).dropped == ring.dropped


def test_ring_skips_a_torn_last_line_and_never_appends_after_it(tmp_path: Path) -> None:
    d = tmp_path / "r"
    ring = Ring(str(d), max_bytes=1024, segment_bytes=256)
    ring.append("env", '{"i":0}')
    ring.append("env", '{"i":1}')
    (tail,) = d.glob("*.seg")
    with tail.open("ab") as f:
        f.write(b'env {"i":2')  # power cut in the middle of a write
    ring = Ring(str(d), max_bytes=1024, segment_bytes=256)
    assert len(ring) == 2
    ring.append("env", '{"i":3}')
    out = []
    while (rec := ring.peek()) is not None:
        out.append(_rec_id(rec))
        ring.pop()
    assert out == [0, 1, 3]


def test_ring_rejects_records_larger_than_a_segment_and_bad_bounds(tmp_path: Path) -> None:
    ring = Ring(str(tmp_path / "r"), max_bytes=1024, segment_bytes=256)
    with pytest.raises(ValueError, match="larger than a segment"):
        ring.append("env", "x" * 300)
    with pytest.raises(ValueError, match="two segments"):
        Ring(str(tmp_path / "q"), max_bytes=300, segment_bytes=256)
    with pytest.raises(ValueError, match="without peek"):
        ring.pop()


# -- sequence --------------------------------------------------------------------
def test_sequence_survives_reboots_with_one_write_per_block(tmp_path: Path) -> None:
    p = str(tmp_path / "seq")
    s = Sequence(p, block=10)
    assert [s.next() for _ in range(25)] == list(range(25))
    assert s.writes == 3  # 0, 10, 20: amortised
    s2 = Sequence(p, block=10)  # reboot: resume after the reserved block
    assert s2.next() == 30
    assert s2.next() > 24


def test_sequence_resume_from_rtc_memory_only_inside_the_reserved_block(tmp_path: Path) -> None:
    p = str(tmp_path / "seq")
    s = Sequence(p, block=10)
    for _ in range(4):
        s.next()
    after_sleep = Sequence(p, block=10)
    assert after_sleep.resume(4)
    assert after_sleep.next() == 4  # no gap across a deep sleep
    assert after_sleep.writes == 0
    stale = Sequence(p, block=10)
    assert not stale.resume(50)  # not from this reservation: ignore it
    assert stale.next() == 10


def test_sequence_file_corrupt_is_reported_not_silently_reset(tmp_path: Path) -> None:
    p = tmp_path / "seq"
    p.write_bytes(b"garbage")
    s = Sequence(str(p), block=5)
    assert s.recovered


# -- backoff ---------------------------------------------------------------------
def test_backoff_grows_to_the_cap_with_bounded_jitter() -> None:
    hi = Backoff(100, 1000, rand=lambda n: n)
    lo = Backoff(100, 1000, rand=lambda n: 0)
    highs = [hi.next_ms() for _ in range(8)]
    lows = [lo.next_ms() for _ in range(8)]
    assert highs == [100, 200, 400, 800, 1000, 1000, 1000, 1000]
    assert lows == [50, 100, 200, 400, 500, 500, 500, 500]
    hi.reset()
    assert hi.next_ms() == 100
    real = Backoff(100, 1000)
    for _ in range(50):
        assert 50 <= real.next_ms() <= 1000


# -- codec -------------------------------------------------------------------------
def test_reading_is_compact_json_with_seq_and_ts() -> None:
    out = codec.encode_reading(7, 1700000000, {"t": 21.5})
    assert " " not in out
    assert json.loads(out) == {"seq": 7, "ts": 1700000000, "t": 21.5}
    assert "ts" not in json.loads(codec.encode_reading(1, None, {}))
    with pytest.raises(ValueError, match="reserved"):
        codec.encode_reading(1, None, {"seq": 3})


@pytest.mark.parametrize(
    ("raw", "cid", "reason"),
    [
        (b"not json", None, "not JSON"),
        (b"[1]", None, "JSON object"),
        (b'{"name": "x"}', None, "command id"),
        (b'{"id": "c1"}', "c1", "name"),
        (b'{"id": "c1", "name": "x", "args": [1]}', "c1", "args"),
        (b'{"id": "c1", "name": "x", "expires_at": "soon"}', "c1", "expires_at"),
    ],
)
def test_malformed_commands_carry_the_id_when_known(raw: bytes, cid: str | None, reason: str) -> None:
    with pytest.raises(commands.CommandError, match=reason) as e:
        commands.parse_command(raw)
    assert e.value.cid == cid


def test_command_and_ack_formats() -> None:
    raw = b'{"id": "c1", "name": "set_relay", "args": {"on": true}, "expires_at": null}'
    assert commands.parse_command(raw) == ("c1", "set_relay", {"on": True}, None)
    assert commands.parse_command(b'{"id":"c2","name":"x"}')[2] == {}
    assert json.loads(commands.encode_ack("c1", "ok", result={"a": 1})) == {
        "id": "c1",
        "status": "ok",
        "result": {"a": 1},
    }
    assert json.loads(commands.encode_ack("c1", "unknown_command", error="zap")) == {
        "id": "c1",
        "status": "unknown_command",
        "error": "zap",
    }
    assert commands.is_expired(100, 101)
    assert not commands.is_expired(100, 100)
    assert not commands.is_expired(100, None)  # unknown clock: run it
    assert not commands.is_expired(None, 10**10)


def test_channel_names_cannot_break_the_topic_tree() -> None:
    for bad in ("", "a/b", "a+", "#", "a b", "x" * 33):
        with pytest.raises(ValueError, match="channel"):
            codec.check_channel(bad)
    assert codec.topic("edge", "d1", "up", "env") == "edge/d1/up/env"


# -- recent commands -----------------------------------------------------------------
def test_recent_commands_persist_and_stay_bounded(tmp_path: Path) -> None:
    p = str(tmp_path / "cmds")
    r = commands.RecentCommands(p, size=3)
    for i in range(5):
        r.put(f"c{i}", f'{{"id":"c{i}","status":"ok"}}')
    r2 = commands.RecentCommands(p, size=3)
    assert len(r2) == 3
    assert r2.get("c1") is None
    assert r2.get("c4") == '{"id":"c4","status":"ok"}'
    r2.put("big", "x" * 500, short_ack="short")
    assert commands.RecentCommands(p, size=3).get("big") == "short"


# -- config ----------------------------------------------------------------------------
def test_config_local_overlay_and_validation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("config.json").write_text(json.dumps({"device_id": "d1", "broker": "h", "wifi_password": None}))
    Path("config.local.json").write_text(json.dumps({"wifi_password": "s3cret"}))
    cfg = config.load()
    assert cfg.wifi_password == "s3cret"
    assert cfg.port == 1883
    with pytest.raises(config.ConfigError, match="unknown config key"):
        config.Config({"device_id": "d", "broker": "h", "prot": 1})
    with pytest.raises(config.ConfigError, match="device_id"):
        config.Config({"device_id": "a/b", "broker": "h"})
    with pytest.raises(config.ConfigError, match="period_ms"):
        config.Config({"device_id": "d", "broker": "h", "period_ms": -1})


# -- BME280 ---------------------------------------------------------------------------------
T_CAL = (27504, 26435, -1000)  # worked example in the Bosch BMP280 datasheet
P_CAL = (36477, -10685, 3024, 2855, 140, -7, 15500, -14600, 6000)


def _reference_double(adc_t: int, adc_p: int) -> tuple[float, float]:
    """The datasheet's floating-point formulas, as an independent check."""
    t1, t2, t3 = T_CAL
    p1, p2, p3, p4, p5, p6, p7, p8, p9 = P_CAL
    v1 = (adc_t / 16384.0 - t1 / 1024.0) * t2
    v2 = ((adc_t / 131072.0 - t1 / 8192.0) ** 2) * t3
    t_fine = v1 + v2
    v1 = t_fine / 2.0 - 64000.0
    v2 = v1 * v1 * p6 / 32768.0 + v1 * p5 * 2.0
    v2 = v2 / 4.0 + p4 * 65536.0
    v1 = (p3 * v1 * v1 / 524288.0 + p2 * v1) / 524288.0
    v1 = (1.0 + v1 / 32768.0) * p1
    p = 1048576.0 - adc_p
    p = (p - v2 / 4096.0) * 6250.0 / v1
    v1 = p9 * p * p / 2147483648.0
    v2 = p * p8 / 32768.0
    return t_fine / 5120.0, p + (v1 + v2 + p7) / 16.0


def test_bme280_compensation_matches_the_datasheet_example() -> None:
    cal = bme280.Calibration.from_values(T_CAL, P_CAL)
    t, p, h = bme280.compensate(cal, 519888, 415148)
    assert t == 2508  # 25.08 degC in the datasheet
    assert abs(p / 256 - 100653.27) < 0.05  # Pa in the datasheet
    ref_t, ref_p = _reference_double(519888, 415148)
    assert abs(t / 100 - ref_t) < 0.01
    assert abs(p / 256 - ref_p) < 0.05
    assert h is None


class _FakeBME280Bus:
    """A BME280's register file on an I2C bus (hardware stand-in)."""

    def __init__(self) -> None:
        regs = bytearray(256)
        regs[0xD0] = 0x60
        cal = bytearray()
        for v in (*T_CAL, *P_CAL):
            cal += (v & 0xFFFF).to_bytes(2, "little")
        cal += b"\x00"  # 0xA0
        cal += bytes([75])  # H1
        regs[0x88 : 0x88 + 26] = cal
        # H2=370, H3=0, H4=313, H5=50, H6=30 (typical part)
        h4, h5 = 313, 50
        regs[0xE1 : 0xE1 + 7] = bytes(
            [370 & 0xFF, 370 >> 8, 0, h4 >> 4, (h4 & 0xF) | ((h5 & 0xF) << 4), h5 >> 4, 30]
        )
        # raw sample: adc_P 415148, adc_T 519888, adc_H 30000
        for i, v in ((0xF7, 415148), (0xFA, 519888)):
            regs[i : i + 3] = bytes([v >> 12, (v >> 4) & 0xFF, (v & 0xF) << 4])
        regs[0xFD:0xFF] = (30000).to_bytes(2, "big")
        self.regs = regs
        self.writes: list[tuple[int, bytes]] = []

    def scan(self) -> list[int]:
        return [0x76]

    def readfrom_mem(self, addr: int, reg: int, n: int) -> bytes:
        assert addr == 0x76
        return bytes(self.regs[reg : reg + n])

    def writeto_mem(self, addr: int, reg: int, buf: bytes) -> None:
        self.writes.append((reg, bytes(buf)))


def test_bme280_driver_reads_calibration_and_a_forced_measurement() -> None:
    bus = _FakeBME280Bus()
    s = bme280.probe(bus)
    assert s is not None
    assert s.cal.H4 == 313
    assert s.cal.H5 == 50
    r = s.read()
    assert r["temp_c"] == 25.08
    assert abs(r["pressure_pa"] - 100653.27) < 0.05
    assert 0 <= r["humidity_pct"] <= 100
    assert (0xF2, b"\x01") in bus.writes  # humidity oversampling before ctrl_meas
    assert bus.writes[-1] == (0xF4, b"\x25")  # forced mode


def test_bme280_probe_returns_none_when_nothing_answers() -> None:
    class Empty:
        def scan(self) -> list[int]:
            return []

    assert bme280.probe(Empty()) is None
