"""The devices' MQTT users in the gateway's Mosquitto password file
(`iggy-edge device credentials`, and `device provision` registering a board).

One user per device, the user name is the device id (the broker's ACL and
`use_username_as_clientid` key everything on it).  The file is changed only
through `mosquitto_passwd` (its hash format is Mosquitto's business), the
password is handed to it on stdin (never on a command line, where `ps` would
show it), and Mosquitto is told to reload so the change takes effect without
a restart: `systemctl reload mosquitto` when systemd runs it, else SIGHUP to
the pid from --broker-pid or the pid file.  A password is printed only when
it was generated here, once.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..device_ids import device_id_problem

DEVICES_PASSWD = Path("/etc/mosquitto/iggy-edge-devices.passwd")
MOSQUITTO_PID_FILE = Path("/run/mosquitto/mosquitto.pid")
GENERATED_BYTES = 18  # 24 characters of URL-safe base64


class CredentialsError(Exception):
    """A failure with a message meant for the person at the keyboard."""


def check_device_id(device_id: str) -> str:
    """`device_id`, or a CredentialsError saying why it cannot be an MQTT user (device_ids.py)."""
    problem = device_id_problem(device_id)
    if problem is not None:
        raise CredentialsError(problem)
    return device_id


def new_password() -> str:
    return secrets.token_urlsafe(GENERATED_BYTES)


def password_from_env(var: str) -> str:
    value = os.environ.get(var)
    if not value:
        raise CredentialsError(f"MQTT password missing: environment variable {var} is not set or empty")
    if len(value) < 12:
        raise CredentialsError(f"the MQTT password in {var} is too short: use at least 12 characters")
    return value


# -- the password file ------------------------------------------------------------
def _mosquitto_passwd() -> str:
    found = shutil.which("mosquitto_passwd") or (
        "/usr/bin/mosquitto_passwd" if Path("/usr/bin/mosquitto_passwd").exists() else None
    )
    if found is None:
        raise CredentialsError("mosquitto_passwd not found: install mosquitto (apt install mosquitto)")
    return found


def _existing(path: Path) -> Path:
    if not path.exists():
        raise CredentialsError(
            f"no Mosquitto password file at {path}: the iggy-edge package creates it (is it installed?); "
            "or pass --passwd-file to the file your Mosquitto's password_file names"
        )
    if not os.access(path, os.R_OK | os.W_OK):
        raise CredentialsError(f"cannot read and write {path}: run it with sudo")
    return path


def users(path: Path) -> list[str]:
    """The user names in a Mosquitto password file, in file order."""
    out = []
    for line in _existing(path).read_text().splitlines():
        name, sep, _ = line.partition(":")
        if sep and name.strip() and not name.startswith("#"):
            out.append(name)
    return out


def set_password(path: Path, user: str, password: str) -> None:
    """Add or replace ``user`` with mosquitto_passwd, the password on stdin."""
    _existing(path)
    mode = path.stat().st_mode & 0o777
    owner = path.stat()
    r = subprocess.run(
        [_mosquitto_passwd(), str(path), user],
        input=f"{password}\n{password}\n",
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    if r.returncode != 0:
        raise CredentialsError(f"mosquitto_passwd failed on {path}: {_tail(r.stderr or r.stdout)}")
    _keep_mode(path, mode, owner.st_uid, owner.st_gid)


def delete_user(path: Path, user: str) -> None:
    _existing(path)
    st = path.stat()
    r = subprocess.run(
        [_mosquitto_passwd(), "-D", str(path), user], capture_output=True, text=True, timeout=30, check=False
    )
    if r.returncode != 0:
        raise CredentialsError(f"mosquitto_passwd -D failed on {path}: {_tail(r.stderr or r.stdout)}")
    _keep_mode(path, st.st_mode & 0o777, st.st_uid, st.st_gid)


def _keep_mode(path: Path, mode: int, uid: int, gid: int) -> None:
    # mosquitto_passwd rewrites the file through a temp copy: keep the
    # owner and mode the package gave it (root:mosquitto 0640).
    if os.geteuid() == 0:
        os.chown(path, uid, gid)
    path.chmod(mode)


def _tail(text: str) -> str:
    lines = [x for x in text.strip().splitlines() if x.strip() and not x.startswith(("Password:", "Reenter"))]
    return lines[-1] if lines else "(no output)"


# -- telling Mosquitto ----------------------------------------------------------------
@dataclass(frozen=True)
class Reload:
    broker_pid: int | None = None
    pid_file: Path | None = None


def _systemd_runs_mosquitto() -> bool:
    if not Path("/run/systemd/system").is_dir() or shutil.which("systemctl") is None:
        return False
    r = subprocess.run(
        ["systemctl", "is-active", "--quiet", "mosquitto"], capture_output=True, timeout=10, check=False
    )
    return r.returncode == 0


def _sighup(pid: int, where: str) -> str:
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError:
        raise CredentialsError(f"no Mosquitto runs as pid {pid} ({where}): is the broker running?") from None
    except PermissionError:
        raise CredentialsError(f"not allowed to signal pid {pid} ({where}): run it with sudo") from None
    return f"sent SIGHUP to Mosquitto (pid {pid}, {where})"


def _pid_from(path: Path) -> int:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise CredentialsError(f"no pid file at {path}: is Mosquitto running?") from None
    except PermissionError:
        raise CredentialsError(f"cannot read {path}: run it with sudo") from None
    if not text.isdigit():
        raise CredentialsError(f"{path} does not hold a pid: {text[:40]!r}")
    return int(text)


def reload_broker(how: Reload) -> str:
    """Make Mosquitto re-read its password file and ACL; what was done."""
    if how.broker_pid is not None:
        return _sighup(how.broker_pid, "--broker-pid")
    if how.pid_file is not None:
        return _sighup(_pid_from(how.pid_file), str(how.pid_file))
    if _systemd_runs_mosquitto():
        r = subprocess.run(
            ["systemctl", "reload", "mosquitto"], capture_output=True, text=True, timeout=30, check=False
        )
        if r.returncode != 0:
            raise CredentialsError(f"systemctl reload mosquitto failed: {_tail(r.stderr)}")
        return "reloaded mosquitto (systemctl reload mosquitto)"
    if MOSQUITTO_PID_FILE.exists():
        return _sighup(_pid_from(MOSQUITTO_PID_FILE), str(MOSQUITTO_PID_FILE))
    raise CredentialsError(
        "no running Mosquitto found to reload (systemd does not run it and there is no "
        f"{MOSQUITTO_PID_FILE}): start it, or pass --broker-pid / --pid-file"
    )


# -- operations (`device credentials`; `device provision` registers a board) --------
def register(path: Path, device_id: str, password: str, how: Reload | None, *, replace: bool) -> str:
    """Add (or with ``replace`` add-or-rotate) a device user, then reload;
    returns what was done, without the password."""
    check_device_id(device_id)
    known = users(path)
    if device_id in known and not replace:
        raise CredentialsError(f"{device_id} already has credentials in {path}: use `rotate`")
    set_password(path, device_id, password)
    verb = "rotated" if device_id in known else "added"
    done = f"{verb} MQTT user {device_id} in {path}"
    if how is not None:
        done += "; " + reload_broker(how)
    return done


def change(
    path: Path, device_id: str, password_env: str | None, how: Reload | None, *, rotate: bool
) -> tuple[str, str]:
    """`add` (the user must be new) or `rotate` (it must exist): what was
    done, and the password."""
    check_device_id(device_id)
    known = users(path)
    if rotate and device_id not in known:
        raise CredentialsError(f"{device_id} has no credentials in {path}: use `add`")
    if not rotate and device_id in known:
        raise CredentialsError(f"{device_id} already has credentials in {path}: use `rotate`")
    password = password_from_env(password_env) if password_env else new_password()
    return register(path, device_id, password, how, replace=rotate), password


def revoke_user(path: Path, device_id: str, how: Reload | None) -> str:
    if device_id not in users(path):
        raise CredentialsError(f"{device_id} has no credentials in {path}")
    delete_user(path, device_id)
    done = f"revoked MQTT user {device_id} in {path}"
    if how is not None:
        done += "; " + reload_broker(how)
    return done
