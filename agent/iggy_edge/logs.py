"""Logging helpers: one event per line, and rate limiting for repeating events.

A failure that repeats (uplink down, buffer full) is logged at most once per
`interval` per key, with the number of suppressed repeats; rates belong in
metrics, not in logs.
"""

from __future__ import annotations

import datetime
import json
import logging
import time
from collections.abc import Iterable
from typing import Final

REDACTED: Final = "**********"


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, key: str, msg: str, *args: object) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._interval:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        self._last[key] = now
        if len(self._last) > 1024:  # bounded: keys are a small fixed set in practice
            self._last = {key: now}
        suppressed = self._suppressed.pop(key, 0)
        if suppressed:
            self._logger.log(level, msg + " (%d similar suppressed)", *args, suppressed)
        else:
            self._logger.log(level, msg, *args)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args)


class Redactor(logging.Filter):
    """Replaces known secret values in a record's rendered message.

    The first line of defence is that secrets are `SecretStr` everywhere (they
    print as ``**********``); this filter is the second, for a secret that
    reaches a message some other way (an exception text quoting a URL, a
    library that echoes credentials).  It renders the message once, replaces
    every registered value, and freezes the result into the record.
    """

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        # Short values would redact ordinary words; a 1-3 character password is
        # its own problem (doctor warns about it).
        self._secrets = sorted({s for s in secrets if len(s) >= 4}, key=len, reverse=True)

    def filter(self, record: logging.LogRecord) -> bool:
        if not self._secrets:
            return True
        msg = record.getMessage()
        text = record.exc_text or ""
        if record.exc_info and not text:
            text = logging.Formatter().formatException(record.exc_info)
        hit = False
        for secret in self._secrets:
            if secret in msg or secret in text:
                hit = True
                msg = msg.replace(secret, REDACTED)
                text = text.replace(secret, REDACTED)
        if hit:
            record.msg, record.args = msg, None
            if text:
                record.exc_text, record.exc_info = text, None
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts``, ``level``, ``logger``, ``msg`` and, for
    failures, ``exc`` (the traceback as one string, so it stays one line).

    journald keeps a line as one entry and adds its own timestamp and unit;
    ``ts`` is still there for log shippers reading the journal export.
    """

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            doc["exc"] = record.exc_text
        if record.stack_info:
            doc["stack"] = self.formatStack(record.stack_info)
        return json.dumps(doc, ensure_ascii=False, default=str)


class _OneLineFormatter(logging.Formatter):
    """Text format; a traceback's lines are joined with " | " so one event stays
    one line (journald would otherwise split it into unrelated entries)."""

    def format(self, record: logging.LogRecord) -> str:
        return super().format(record).replace("\n", " | ")


def setup_logging(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> None:
    """One event per line on stderr (journald adds its own timestamps).

    `fmt` is "text" or "json"; `secrets` are values that must never appear
    in a log line (see `Redactor`).
    """
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    elif fmt == "text":
        handler.setFormatter(_OneLineFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    else:
        raise ValueError(f"unknown log format {fmt!r} (text or json)")
    handler.addFilter(Redactor(secrets))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # gmqtt logs every (re)connection attempt at INFO/WARNING; ours say it once.
    logging.getLogger("gmqtt").setLevel(logging.ERROR)
