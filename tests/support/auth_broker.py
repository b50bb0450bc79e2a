"""A Mosquitto that refuses anonymous clients and checks a password file
(what packaging/mosquitto/iggy-edge.conf sets up on a gateway)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .broker import Broker, mosquitto_binary
from .ports import wait_port


@contextlib.contextmanager
def password_broker(workdir: Path, users: dict[str, str]) -> Iterator[Broker]:
    binary = mosquitto_binary()
    assert binary is not None, "mosquitto is not installed (run .ci/setup)"
    workdir.mkdir(parents=True, exist_ok=True)
    # Mosquitto started as root reads the password file *after* dropping to
    # the mosquitto user, and pytest's tmp_path is private (0700): keep the
    # file in a directory that user can reach.
    pwdir = Path(tempfile.mkdtemp(prefix="iggy-edge-mqtt-passwd-"))
    pwdir.chmod(0o755)
    pwfile = pwdir / "passwd"
    pwfile.touch()
    for user, password in users.items():
        subprocess.run(["mosquitto_passwd", "-b", str(pwfile), user, password], check=True)
    pwfile.chmod(0o644)
    broker = Broker(workdir)
    conf = broker.write_conf()
    # Broker's template allows anonymous clients; Mosquitto refuses a second
    # allow_anonymous line, so replace it.
    conf.write_text(
        conf.read_text().replace("allow_anonymous true", f"allow_anonymous false\npassword_file {pwfile}")
    )
    broker.proc = subprocess.Popen(
        [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    try:
        wait_port(broker.port)
        yield broker
    finally:
        broker.stop()
        shutil.rmtree(pwdir, ignore_errors=True)
