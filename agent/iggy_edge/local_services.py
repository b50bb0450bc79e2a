"""Private services for the demo: a Mosquitto and an iggy-server on free
loopback ports, each in a session of its own (so Ctrl-C reaches only the
demo, which stops them) and told to end when the demo dies, even by SIGKILL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Final

from pydantic import SecretStr

from .config import IggySettings
from .uplink.iggy import IggyCommandSource, IggyProbe
from .uplink.protocol import UplinkError


class ServiceError(Exception):
    """A private service could not be started; the text says why and what to do."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_mosquitto(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("mosquitto") or (
        "/usr/sbin/mosquitto" if Path("/usr/sbin/mosquitto").exists() else None
    )
    if binary is None:
        raise ServiceError(
            "no MQTT broker configured and mosquitto is not installed "
            "(sudo apt-get install mosquitto, or set IGGY_EDGE_MQTT_HOST)"
        )
    port = free_port()
    conf = workdir / "mosquitto.conf"
    # As root, mosquitto would drop to its own user, which cannot write our temp dir.
    run_as = "user root\n" if os.geteuid() == 0 else ""
    conf.write_text(
        f"{run_as}listener {port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
        f"persistence_location {workdir}/\nmax_queued_messages 1000000\nmax_inflight_messages 0\n"
        f"log_dest file {workdir}/mosquitto.log\n"
    )
    # Its own session: Ctrl-C's SIGINT goes to the terminal's foreground
    # process group, and a broker that died with it made the agent's clients
    # print tracebacks while the demo was stopping.  The demo stops it.
    proc = subprocess.Popen(
        [binary, "-c", str(conf)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads yet, and it is one prctl
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return proc, port
        time.sleep(0.05)
    proc.kill()
    raise ServiceError(f"mosquitto did not start (see {workdir}/mosquitto.log)")


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the demo dies, even by SIGKILL
    (Linux prctl PR_SET_PDEATHSIG), so no server outlives it."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGTERM)


class PrivateIggy:
    """An `iggy-server` for the demo alone: a temporary data directory, a free
    loopback port, TCP only, one shard, the smallest memory pool, and root
    credentials made up for this run.  It runs in a session of its own, so a
    Ctrl-C reaches the demo, which stops it (`stop`) and removes its data."""

    USERNAME = "iggy"

    def __init__(self, binary: str) -> None:
        self.binary = binary
        self.datadir = Path(tempfile.mkdtemp(prefix="iggy-edge-demo-iggy-"))
        self.address = f"127.0.0.1:{free_port()}"
        self.password = secrets.token_urlsafe(18)
        self.proc: subprocess.Popen[bytes] | None = None

    def settings(self) -> IggySettings:
        return IggySettings(
            kind="iggy", address=self.address, username=self.USERNAME, password=SecretStr(self.password)
        )

    def start(self, timeout: float = 60.0) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
        env.update(
            {
                "IGGY_TCP_ADDRESS": self.address,
                "IGGY_HTTP_ENABLED": "false",
                "IGGY_QUIC_ENABLED": "false",
                "IGGY_WEBSOCKET_ENABLED": "false",
                "IGGY_SYSTEM_PATH": str(self.datadir / "data"),
                "IGGY_ROOT_USERNAME": self.USERNAME,
                "IGGY_ROOT_PASSWORD": self.password,
                "IGGY_SYSTEM_SHARDING_CPU_ALLOCATION": "1",
                "IGGY_SYSTEM_SHARDING_PIN_CORES": "false",
                "IGGY_TELEMETRY_ENABLED": "false",
                "IGGY_SYSTEM_MEMORY_POOL_SIZE": "512 MiB",  # the minimum; the default is 4 GiB
            }
        )
        with (self.datadir / "server.log").open("ab") as log:
            self.proc = subprocess.Popen(
                [self.binary],
                cwd=self.datadir,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=_die_with_parent,  # noqa: PLW1509 - no threads yet, and it is one prctl
            )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServiceError(
                    f"iggy-server exited with {self.proc.returncode} (see {self.datadir}/server.log)"
                )
            if asyncio.run(self._logs_in()):
                return
            if time.monotonic() > deadline:
                raise ServiceError(f"iggy-server does not accept a login after {timeout:.0f} s")
            time.sleep(0.2)

    async def _logs_in(self) -> bool:
        try:
            async with IggyProbe(self.settings(), timeout_s=2.0):
                return True
        except UplinkError:
            return False

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        shutil.rmtree(self.datadir, ignore_errors=True)


class IggyView:
    """What the private server holds in one topic, read back from it: every
    partition polled from where the last look ended (its own consumer name,
    nothing stored on the server).  `run` looks once a second in the
    background, so a stalled server never holds up the live table."""

    STALE_S: Final = 3.0

    def __init__(self, settings: IggySettings, stream: str, topic: str) -> None:
        self._source = IggyCommandSource(settings, "demo", "iggy-edge-demo-view")
        self._stream, self._topic = stream, topic
        self._next = [0] * settings.partitions
        self.held = 0
        self._looked = time.monotonic()

    def shown(self) -> str:
        """The count, or ``?`` when the last look is older than STALE_S."""
        return "?" if time.monotonic() - self._looked > self.STALE_S else str(self.held)

    async def run(self) -> None:
        while True:
            with contextlib.suppress(UplinkError):
                for p, start in enumerate(self._next):
                    got = await self._source.poll(self._stream, self._topic, p, start, 10_000)
                    if got:
                        self._next[p] = got[-1].offset + 1
                        self.held += len(got)
                self._looked = time.monotonic()
            await asyncio.sleep(1.0)

    async def close(self) -> None:
        await self._source.close()
