# Config validation and the defaults: boot-only code, run once by
# ``config.Config`` and then dropped from ``sys.modules`` again, so its ~55-
# entry table of defaults and its checks (about 3 kB of heap on a 32-bit
# port, loaded from .mpy) are not kept for the rest of the board's run.
# Pure: no imports beyond config's error.
from .config import ConfigError

DEFAULTS = {
    "device_id": None,
    "broker": None,
    "port": 1883,
    "user": None,  # MQTT user: the device id unless provisioning chose another
    "password": None,  # in config.local.json
    "tls": False,  # TLS to the broker, verified with ca_file
    "ca_file": None,  # the gateway CA certificate (DER), e.g. "ca.der"
    "tls_hostname": None,  # name checked against the broker's certificate (default: broker)
    "keepalive": 60,
    "clean_session": False,  # broker keeps commands queued while we sleep
    "wifi_ssid": None,
    "wifi_password": None,
    "wifi_timeout_ms": 15000,
    "ntp": True,
    "ntp_every_s": 3600,  # re-sync the clock this often (at a connect); RTC memory keeps the last time
    "ntp_host": None,  # NTP server; default: the broker (the gateway serves time on an isolated LAN)
    "topic_prefix": "edge",
    "data_dir": "data",
    # a day of env_sensor at 10 s (8,640 readings of ~100 bytes) fits in
    # 1 MiB; an ESP32 with 4 MB flash has about 2 MB of filesystem.  Device
    # shrinks it at boot when the flash has less room (logged).
    "ring_bytes": 1048576,
    "segment_bytes": 16384,
    "cursor_every": 8,
    "seq_block": 64,
    "backoff_base_ms": 1000,
    "backoff_max_ms": 60000,
    # after "not authorized" (CONNACK 4/5): retrying soon cannot help until
    # someone fixes the credentials, so wait longer (still capped)
    "auth_backoff_base_ms": 30000,
    "auth_backoff_max_ms": 900000,
    "socket_timeout_s": 10,  # each blocking network step (at most wdt_ms/3 with a watchdog)
    "msg_max_bytes": 4096,  # inbound payloads over this are read in chunks and thrown away
    "inbox_bytes": 8192,  # inbound messages held before handling; the rest waits at the broker
    "drain_per_poll": 32,
    # keep readings in flash until the gateway's receipt covers them (not
    # only until the broker's PUBACK); with none for receipt_timeout_ms
    # while readings wait, fall back to PUBACK until a receipt arrives
    "receipts": True,
    "receipt_timeout_ms": 15000,
    "wdt_ms": 0,  # 0 = no watchdog; ESP32 cannot stop a started WDT
    # > 0: a watchdog never fed, so the board resets after this long awake
    # whatever hangs (battery boards); replaces wdt_ms
    "awake_budget_ms": 0,
    "safe_pin": None,  # a pin held low at boot starts nothing (safe mode), e.g. 0 = BOOT
    "period_ms": 10000,
    "cycles": 0,  # 0 = run forever; tests and the bench set a count
    "deep_sleep": False,
    "awake_ms": 2000,  # deep-sleep mode: how long to listen for commands
    "upload_every": 1,  # deep-sleep mode: connect every n-th wake
    "log": 1,
}


def merged(values):
    """``values`` over the defaults, checked: a new dict, or ConfigError."""
    merged = dict(DEFAULTS)
    for k in values:
        if k not in DEFAULTS and k != "app":  # "app": the example's own settings
            raise ConfigError("unknown config key: " + k)
        merged[k] = values[k]
    for k in ("device_id", "broker", "topic_prefix"):
        v = merged[k]
        if not isinstance(v, str) or not v or "/" in v or "+" in v or "#" in v:
            raise ConfigError(k + " must be a non-empty string without / + #")
    # umqtt.simple writes a string's length in characters where MQTT
    # wants bytes: anything non-ASCII would make a malformed packet
    for k in ("device_id", "topic_prefix", "user", "password"):
        v = merged[k]
        if v is not None and (not isinstance(v, str) or len(v.encode()) != len(v)):
            raise ConfigError(k + " must be ASCII (umqtt.simple would send a malformed packet)")
    if merged["ntp_host"] is None:
        merged["ntp_host"] = merged["broker"]
    elif not isinstance(merged["ntp_host"], str) or not merged["ntp_host"]:
        raise ConfigError("ntp_host must be a host name or address")
    pin = merged["safe_pin"]
    if pin is not None and not (isinstance(pin, int) and pin >= 0):
        raise ConfigError("safe_pin must be a pin number or null")
    for k in (
        "port",
        "keepalive",
        "ring_bytes",
        "segment_bytes",
        "seq_block",
        "backoff_base_ms",
        "backoff_max_ms",
        "auth_backoff_base_ms",
        "auth_backoff_max_ms",
        "period_ms",
        "cycles",
        "wdt_ms",
        "awake_budget_ms",
        "wifi_timeout_ms",
        "drain_per_poll",
        "awake_ms",
        "upload_every",
        "cursor_every",
        "socket_timeout_s",
        "msg_max_bytes",
        "inbox_bytes",
        "receipt_timeout_ms",
        "ntp_every_s",
    ):
        if not isinstance(merged[k], int) or merged[k] < 0:
            raise ConfigError(k + " must be a non-negative integer")
    # 0 would turn off the broker's liveness check (and the last will);
    # MQTT carries it in 16 bits
    if not 1 <= merged["keepalive"] <= 65535:
        raise ConfigError("keepalive must be 1..65535 seconds")
    if merged["tls"] and not (isinstance(merged["ca_file"], str) and merged["ca_file"]):
        raise ConfigError("tls needs ca_file: the gateway CA certificate (iggy-edge device provision --tls)")
    if merged["user"] is not None and merged["password"] is None:
        raise ConfigError("user is set but password is not (config.local.json)")
    return merged
