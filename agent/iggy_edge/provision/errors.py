"""Provisioning's errors: each carries a message for the person at the keyboard."""

from __future__ import annotations


class ProvisionError(Exception):
    """A failure with a message meant for the person at the keyboard."""


class NoBoardError(ProvisionError):
    pass


class PortBusyError(ProvisionError):
    pass


class NotMicroPythonError(ProvisionError):
    pass


def busy(port: str) -> PortBusyError:
    return PortBusyError(
        f"{port} is busy: another program holds it (a serial monitor, mpremote, an IDE); close it, retry"
    )
