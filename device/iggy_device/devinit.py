# Boot-only: the body of ``Device.__init__`` (node.py), loaded for the one
# Device a board makes and unloaded when it is made (heap: its code is
# garbage after boot, as configcheck's and datadir's are).
import json
import time
from micropython import const

from . import codec, fsutil, unload, wire
from .backoff import Backoff
from .ring import Ring
from .seq import Sequence

_RTC_MAGIC = const("ie1")


def init(dev, cfg, hw):
    dev.cfg = cfg
    dev._log_level = cfg.log
    log = dev.log
    if hw is None:
        from .hw import Hardware

        hw = Hardware.from_config(cfg, log)
    dev.hw = hw
    dev._client = None
    now = time.ticks_ms()
    dev._next_try = now
    dev._last_tx = now
    # every blocking network step gives up after this; with a watchdog a
    # step (one read plus one write) must end well before it bites
    t = cfg.socket_timeout_s * 1000
    if cfg.wdt_ms and t > cfg.wdt_ms // 3:
        t = cfg.wdt_ms // 3
    dev._t_ms = t
    wire.timeout_ms = t
    wire.max_payload = cfg.msg_max_bytes
    wire.feed = hw.feed
    wire.log = log
    dev._last_rx = now
    dev._frames = 0
    dev._ping_at = None
    dev._wifi_t0 = None
    dev._ntp_next = now
    dev._refill = False
    dev._inbox = []
    dev._inbox_bytes = 0
    dev._handlers = {}
    dev._config_cb = None
    dev._reported_dropped = -1
    p = dev._prefix = cfg.topic_prefix
    i = cfg.device_id
    dev._t_status = codec.topic(p, i, "status")
    dev._t_cmd = codec.topic(p, i, "down", "cmd")
    dev._t_config = codec.topic(p, i, "down", "config")
    dev._b_cmd = dev._t_cmd.encode()
    dev._b_config = dev._t_config.encode()
    dev._up = {}
    dev._in = None  # commands.py, loaded with the first command or config (heap)
    dev.stats = {
        "connects": 0,
        "conn_failures": 0,
        "auth_failures": 0,
        "sent": 0,
        "buffered": 0,
        "commands": 0,
        "duplicates": 0,
        "bad_messages": 0,
        "inbox_full": 0,
    }
    # the attributes above first, while the heap is still whole: the
    # instance's table reaches its final size before Ring and friends
    # take the holes a later rehash of it would need
    d = cfg.data_dir
    try:
        from . import datadir

        if datadir.claim(d, cfg.device_id, log):
            hw.rtc_save(b"")  # the old id's wake state (sequence, counters) too
        ring_bytes = datadir.fit(d + "/ring", cfg.ring_bytes, cfg.segment_bytes, log=log)
    finally:
        unload("datadir")  # boot-only (heap)
    dev.ring = Ring(d + "/ring", ring_bytes, cfg.segment_bytes, cfg.cursor_every)
    dev.seq = Sequence(d + "/seq", cfg.seq_block)
    dev.wake = _load_rtc(hw)  # state kept in RTC memory across deep sleep
    if hw.woke_from_deepsleep() and "seq" in dev.wake:
        dev.seq.resume(dev.wake["seq"])
    dev.reset_cause = hw.reset_cause()
    dev.backoff = Backoff(cfg.backoff_base_ms, cfg.backoff_max_ms)
    dev.auth_backoff = Backoff(cfg.auth_backoff_base_ms, cfg.auth_backoff_max_ms)
    dev._tls = _make_tls(cfg) if cfg.tls else None


def _load_rtc(hw):
    raw = hw.rtc_load()
    if raw:
        try:
            doc = json.loads(raw)
            if isinstance(doc, dict) and doc.get("m") == _RTC_MAGIC:
                return doc
        except ValueError:
            pass
    return {"m": _RTC_MAGIC}


def _make_tls(cfg):
    from . import tlsconn

    cadata = fsutil.read(cfg.ca_file)
    if not cadata:
        raise OSError("tls: cannot read the gateway CA certificate " + cfg.ca_file)
    return tlsconn.Tls(cadata, cfg.tls_hostname or cfg.broker, cfg.socket_timeout_s)
