"""Logging helpers: one event per line, and rate limiting for repeating events.

A failure that repeats (uplink down, buffer full) is logged at most once per
`interval` per key, with the number of suppressed repeats; rates belong in
metrics, not in logs.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable
from typing import Any, Final

REDACTED: Final = "**********"


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval: float = 30.0) -> None:
        self._logger = logger
        self._interval = interval
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(
        self, level: int, key: str, msg: str, *args: object, exc_info: BaseException | None = None
    ) -> None:
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
            self._logger.log(level, msg + " (%d similar suppressed)", *args, suppressed, exc_info=exc_info)
        else:
            self._logger.log(level, msg, *args, exc_info=exc_info)

    def warning(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.WARNING, key, msg, *args)

    def error(self, key: str, msg: str, *args: object) -> None:
        self.log(logging.ERROR, key, msg, *args)


# Where a secret stands in text, whatever its value: the password of a URL's
# userinfo (scheme://user:PASSWORD@host), and the value after a secret-named
# key (password=..., "token": "...", api_key: ...).
_URL_PASSWORD = re.compile(r"(?P<pre>\b[A-Za-z][A-Za-z0-9+.-]*://[^/\s:@]*:)(?P<secret>[^@\s/]+)(?=@)")
# Names of keys whose value is a secret (not secrets themselves).
_SECRET_KEY_NAMES = "|".join(
    [
        *("password", "passwd", "passphrase", "pwd", "secret", "token"),
        *(r"api[_-]?key", r"access[_-]?key", r"private[_-]?key", r"auth[_-]?token"),
    ]
)
_KEY_VALUE = re.compile(
    rf"""(?P<pre>(?P<q>["']?)\b(?:[A-Za-z0-9_-]*[_-])?(?:{_SECRET_KEY_NAMES})(?P=q)\s*[=:]\s*)"""
    r"""(?P<secret>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|[^\s,;&}\])]+)""",
    re.IGNORECASE,
)
# A known secret value is also replaced wherever it appears, but only when it
# is long enough not to be an ordinary word and shares nothing with a public
# value (a user name, the gateway id): a password equal to the user name must
# not blank every mention of the user.
MIN_FREE_SECRET: Final = 8


def _keep_quotes(secret: str) -> str:
    if len(secret) >= 2 and secret[0] == secret[-1] and secret[0] in "\"'":
        return secret[0] + REDACTED + secret[0]
    return REDACTED


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """`text` with secrets replaced where secrets stand (see `Redactor`)."""
    if "://" in text:
        text = _URL_PASSWORD.sub(lambda m: m["pre"] + REDACTED, text)
    text = _KEY_VALUE.sub(
        lambda m: m["pre"] + (m["secret"] if REDACTED in m["secret"] else _keep_quotes(m["secret"])), text
    )
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def install_loop_exception_handler(loop: asyncio.AbstractEventLoop, interval: float = 30.0) -> None:
    """Route asyncio's own error reports (an accept() that ran out of file
    descriptors, a callback that raised) through a `RateLimitedLog`: each kind
    (message and exception type) at most once per `interval`, with its
    traceback and the number suppressed.  asyncio's default handler logs every
    one with a traceback: a descriptor flood wrote thousands of lines."""
    limited = RateLimitedLog(logging.getLogger("asyncio"), interval)

    def handler(_loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        exc = context.get("exception")
        message = str(context.get("message") or "unhandled error in the event loop")
        key = f"{message}|{type(exc).__name__ if exc else ''}"
        limited.log(
            logging.ERROR, key, "%s", message, exc_info=exc if isinstance(exc, BaseException) else None
        )

    loop.set_exception_handler(handler)


class Redactor(logging.Filter):
    """Replaces secrets in a record's rendered message and traceback.

    The first line of defence is that secrets are `SecretStr` everywhere (they
    print as ``**********``); this filter is the second, for a secret that
    reaches a message some other way (an exception text quoting a URL, a
    library that echoes credentials).  It redacts where secrets stand -- a
    URL's userinfo password, the value of a secret-named key (``password=``,
    ``"token": ``) -- and the registered secret values themselves when they
    are at least MIN_FREE_SECRET characters and overlap no `public` value
    (user names, gateway id).  It renders the message once and freezes the
    result into the record.
    """

    def __init__(self, secrets: Iterable[str] = (), public: Iterable[str | None] = ()) -> None:
        super().__init__()
        shown = [p for p in public if p]
        self._secrets = sorted(
            {s for s in secrets if len(s) >= MIN_FREE_SECRET and not any(s in p or p in s for p in shown)},
            key=len,
            reverse=True,
        )

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        text = record.exc_text or ""
        if record.exc_info and not text:
            text = logging.Formatter().formatException(record.exc_info)
        new_msg = redact(msg, self._secrets)
        new_text = redact(text, self._secrets) if text else text
        if new_msg != msg:
            record.msg, record.args = new_msg, None
        if new_text != text:
            record.exc_text, record.exc_info = new_text, None
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


# syslog priorities (sd-daemon(3)): what journald takes from a "<N>" prefix
_PRIORITY: Final = {
    logging.CRITICAL: 2,
    logging.ERROR: 3,
    logging.WARNING: 4,
    logging.INFO: 6,
    logging.DEBUG: 7,
}


def priority(levelno: int) -> int:
    """The syslog priority of a logging level (levels between take the next more severe)."""
    for level in sorted(_PRIORITY):
        if levelno <= level:
            return _PRIORITY[level]
    return _PRIORITY[logging.CRITICAL]


class _JournalPrefix(logging.Formatter):
    """Prefixes each line with ``<N>``, its syslog priority: journald strips
    it and stores the entry at that priority, so ``journalctl -p warning``
    shows warnings and worse.  Wraps the text or JSON formatter."""

    def __init__(self, inner: logging.Formatter) -> None:
        super().__init__()
        self._inner = inner

    def format(self, record: logging.LogRecord) -> str:
        return f"<{priority(record.levelno)}>{self._inner.format(record)}"


def stderr_is_journal() -> bool:
    """True when stderr is connected to journald: systemd sets
    ``JOURNAL_STREAM=<device>:<inode>`` of the stream it gave the service,
    and a child whose stderr was redirected elsewhere must not match."""
    dev, _, ino = os.environ.get("JOURNAL_STREAM", "").partition(":")
    if not (dev.isdigit() and ino.isdigit()):
        return False
    try:
        st = os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # no stderr, or not a real file
        return False
    return (st.st_dev, st.st_ino) == (int(dev), int(ino))


def setup_logging(
    level: str = "INFO",
    fmt: str = "text",
    secrets: Iterable[str] = (),
    public: Iterable[str | None] = (),
    *,
    journal: bool | None = None,
) -> None:
    """One event per line on stderr.

    `fmt` is "text" or "json"; `secrets` are values that must never appear
    in a log line, `public` values that may (user names; see `Redactor`).
    Under journald (`journal`, by default `stderr_is_journal()`) each line
    starts with its ``<N>`` priority and text lines carry no timestamp of
    their own (the journal stamps every entry).
    """
    handler = logging.StreamHandler()
    journal = stderr_is_journal() if journal is None else journal
    formatter: logging.Formatter
    if fmt == "json":
        formatter = JsonFormatter()
    elif fmt == "text":
        stamp = "" if journal else "%(asctime)s "
        formatter = _OneLineFormatter(stamp + "%(levelname)s %(name)s: %(message)s")
    else:
        raise ValueError(f"unknown log format {fmt!r} (text or json)")
    handler.setFormatter(_JournalPrefix(formatter) if journal else formatter)
    handler.addFilter(Redactor(secrets, public))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # gmqtt logs every (re)connection attempt at INFO/WARNING; ours say it once.
    logging.getLogger("gmqtt").setLevel(logging.ERROR)
    # aiosqlite logs every statement at DEBUG: our DEBUG is about the agent
    logging.getLogger("aiosqlite").setLevel(logging.INFO)
