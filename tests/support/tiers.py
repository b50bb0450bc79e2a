"""The fast tier (`pytest -m unit`) keeps its promise: a guard, loaded by the
root conftest as a plugin.

A test marked ``unit`` needs no broker, no MicroPython and no iggy-server.
While such a test runs (setup, call and teardown), starting one of those
programs -- through ``subprocess`` or asyncio's subprocess functions, which
both construct a ``subprocess.Popen`` -- fails the test, in the full run as
well as under ``-m unit``: a wrong mark shows in CI, not only on the laptop
that runs the fast tier.  The failure is raised at the call (``pytest.fail``,
which an ``except Exception`` cannot swallow) and again after the test, in
case a bare ``except`` swallowed it.

Other programs stay allowed in the fast tier (the CLI in a subprocess,
``openssl``, ``systemd-analyze``): they need nothing running.  Grandchildren
are not watched (a helper script that itself starts mosquitto is not seen).
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

# What the fast tier must not need (basenames: /usr/sbin/mosquitto, the
# .venv32 twin's bin/micropython, ...).
SERVERS = frozenset({"mosquitto", "mosquitto_sub", "mosquitto_pub", "micropython", "iggy-server"})


def program_of(args: object, executable: object = None) -> str:
    """The basename of the program a Popen(args, executable=...) would run."""
    first: Any = executable
    if first is None:
        if isinstance(args, str | bytes | os.PathLike):
            text = os.fsdecode(args)
            words = shlex.split(text) if text.strip() else [text]
            first = words[0] if words else text
        else:
            seq = list(args)  # type: ignore[call-overload]
            first = seq[0] if seq else ""
    return os.path.basename(os.fsdecode(first))


def pytest_configure(config: pytest.Config) -> None:
    # pyproject registers it too; here so the plugin stands alone (its own test)
    config.addinivalue_line("markers", "unit: needs no broker, no MicroPython and no iggy-server")


class _Guard:
    """What one unit test started, and whether the failure reached pytest."""

    def __init__(self) -> None:
        self.started: list[str] = []
        self.raised: list[BaseException] = []
        self.reported = False

    def check(self, args: object, executable: object) -> None:
        program = program_of(args, executable)
        if program in SERVERS:
            self.started.append(program)
            try:
                pytest.fail(
                    f"a test marked unit started {program}: the fast tier needs no broker, no MicroPython "
                    "and no iggy-server (drop the unit mark, or use a test double at a boundary we own)"
                )
            except pytest.fail.Exception as e:
                self.raised.append(e)
                raise


_GUARD = pytest.StashKey[_Guard]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    """Around the whole test, the fixtures of any scope that it sets up included."""
    if item.get_closest_marker("unit") is None:
        return (yield None)
    guard = item.stash[_GUARD] = _Guard()
    original = subprocess.Popen.__init__

    def guarded(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        guard.check(args, kwargs.get("executable"))
        original(self, args, *rest, **kwargs)

    mp = pytest.MonkeyPatch()
    mp.setattr(subprocess.Popen, "__init__", guarded)
    try:
        return (yield None)
    finally:
        mp.undo()


def _note_reported(item: pytest.Item, error: BaseException) -> None:
    guard = item.stash.get(_GUARD, None)
    if guard is not None and any(error is e for e in guard.raised):
        guard.reported = True


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except BaseException as e:
        _note_reported(item, e)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    try:
        return (yield)
    except BaseException as e:
        _note_reported(item, e)
        raise


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    yield
    guard = item.stash.get(_GUARD, None)
    if guard is not None and guard.started and not guard.reported:
        pytest.fail(f"a test marked unit started {', '.join(guard.started)} (and swallowed the failure)")
