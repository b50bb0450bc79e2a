"""A real Mosquitto broker on a free loopback port, one per test (or module).

The config mirrors what packaging/ ships for the agent (persistence on, queue
limits raised for the agent's persistent session), so tests exercise the
broker the way a gateway runs it.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from .ports import free_port, wait_port


def mosquitto_binary() -> str | None:
    return shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )


@dataclass
class Broker:
    workdir: Path
    port: int = field(default_factory=free_port)
    extra_conf: str = ""
    # The benchmarks run the broker in memory: they measure the agent, not
    # Mosquitto's autosave.
    persistence: bool = True
    # bench/broker_crash_bench.py varies it; tests save every second
    autosave_interval: int = 1
    proc: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def log_path(self) -> Path:
        return self.workdir / "mosquitto.log"

    def write_conf(self) -> Path:
        self.workdir.mkdir(parents=True, exist_ok=True)
        conf = self.workdir / "mosquitto.conf"
        # As root, mosquitto drops to the `mosquitto` user, which cannot write
        # the test's private temp dir: no persistence, no log.  Stay root then.
        run_as = "user root\n" if os.geteuid() == 0 else ""
        conf.write_text(
            run_as
            + f"""\
listener {self.port} 127.0.0.1
allow_anonymous true
persistence {"true" if self.persistence else "false"}
persistence_location {self.workdir}/
autosave_interval {self.autosave_interval}
max_queued_messages 1000000
max_inflight_messages 0
log_dest file {self.log_path}
log_type error
log_type warning
log_type notice
{self.extra_conf}
"""
        )
        return conf

    def start(self) -> Broker:
        binary = mosquitto_binary()
        if binary is None:
            raise RuntimeError("mosquitto is not installed (run .ci/setup)")
        conf = self.write_conf()
        self.proc = subprocess.Popen(
            [binary, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            wait_port(self.port)
        except TimeoutError:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # SIGTERM makes mosquitto save persistence
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stderr is not None:
            self.proc.stderr.close()  # else an unclosed-file ResourceWarning fails the test
        self.proc = None

    def kill(self) -> None:
        """SIGKILL: a broker crash (nothing saved since the last autosave)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.stop()

    def __enter__(self) -> Broker:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def restart(self) -> None:
        self.stop()
        self.start()
