"""CPython stand-in for MicroPython's built-in ``micropython`` module, for the
device library's pure modules under CPython (test_pure_logic.py): ``const()``
(on a board: a compile-time constant, no name and no qstr) is the value."""

from __future__ import annotations

from typing import TypeVar

T = TypeVar("T")


def const(value: T) -> T:
    return value
