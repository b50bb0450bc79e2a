"""A real `iggy-server` on free loopback ports with a temporary data directory.

The server binary comes from PATH (build it from apache/iggy, tag
server-0.9.0-edge.5: ``cargo build --release -p server --bin iggy-server``;
it links against hwloc and udev, so install libhwloc-dev and libudev-dev first;
then copy target/release/iggy-server onto PATH).  When
it is missing, the `iggy_server` fixture skips the test with a reason.

Configuration is by environment (the server reads ``IGGY_`` variables over
its embedded config.toml, see core/configs/src/server_config/server.rs):

=====================================  =====================================
IGGY_TCP_ADDRESS                       127.0.0.1:<free port>
IGGY_HTTP_ENABLED / _QUIC_ / _WEBSOCKET_  false: only the TCP transport
IGGY_SYSTEM_PATH                       the test's temporary data directory
IGGY_ROOT_USERNAME / IGGY_ROOT_PASSWORD   root credentials on first start
IGGY_SYSTEM_SHARDING_CPU_ALLOCATION    1 shard (the default takes every core)
IGGY_SYSTEM_SHARDING_PIN_CORES         false
IGGY_SYSTEM_MEMORY_POOL_SIZE           512 MiB (the minimum)
=====================================  =====================================

`IggyServer.stop()` / `start()` keep the data directory, so a test can take
the server away and bring it back.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from apache_iggy import AutoLogin, IggyClient, TcpConfig, TcpReconnectionConfig

from .ports import free_port

SKIP_REASON = "iggy-server not on PATH (build it from apache/iggy; see tests/support/iggy_server.py)"
ROOT_USER = "iggy"
ROOT_PASSWORD = "iggy-edge-test-secret"


def iggy_server_binary() -> str | None:
    return shutil.which("iggy-server")


@dataclass
class IggyServer:
    workdir: Path
    port: int = field(default_factory=free_port)
    username: str = ROOT_USER
    password: str = ROOT_PASSWORD
    proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
        env.update(
            {
                "IGGY_TCP_ADDRESS": self.address,
                "IGGY_HTTP_ENABLED": "false",
                "IGGY_QUIC_ENABLED": "false",
                "IGGY_WEBSOCKET_ENABLED": "false",
                "IGGY_SYSTEM_PATH": str(self.workdir / "data"),
                "IGGY_ROOT_USERNAME": self.username,
                "IGGY_ROOT_PASSWORD": self.password,
                "IGGY_SYSTEM_SHARDING_CPU_ALLOCATION": "1",
                "IGGY_SYSTEM_SHARDING_PIN_CORES": "false",
                "IGGY_TELEMETRY_ENABLED": "false",
                "IGGY_SYSTEM_MEMORY_POOL_SIZE": "512 MiB",  # the minimum; default 4 GiB
            }
        )
        return env

    def start(self, timeout: float = 60.0) -> IggyServer:
        binary = iggy_server_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.workdir.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                [binary],
                cwd=self.workdir,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        try:
            self.wait_ready(timeout)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise
        return self

    def wait_ready(self, timeout: float) -> None:
        """Until a client can connect and log in (the TCP port opens before
        the server accepts logins)."""
        deadline = time.monotonic() + timeout
        last = "not started"
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(
                    f"iggy-server exited with {self.proc.returncode}; log tail:\n{self.log_tail()}"
                )
            # In a thread of its own: callers may be inside a running event loop.
            with ThreadPoolExecutor(1) as pool:
                try:
                    pool.submit(asyncio.run, self._try_login()).result()
                    return
                except (RuntimeError, OSError, TimeoutError) as e:
                    last = str(e)
            time.sleep(0.2)
        raise TimeoutError(f"iggy-server not ready after {timeout}s ({last}):\n{self.log_tail()}")

    async def _try_login(self) -> None:
        client = IggyClient(
            TcpConfig(
                server_address=self.address,
                auto_login=AutoLogin.disabled(),
                reconnection=TcpReconnectionConfig(enabled=True, max_retries=0),
            )
        )
        await asyncio.wait_for(client.connect(), 2)
        await asyncio.wait_for(client.login_user(self.username, self.password), 2)

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing connections cleanly."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture
def iggy_server(tmp_path: Path) -> Iterator[IggyServer]:
    """A fresh iggy-server for one test; skips when the binary is missing."""
    if iggy_server_binary() is None:
        pytest.skip(SKIP_REASON)
    server = IggyServer(tmp_path / "iggy").start()
    try:
        yield server
    finally:
        server.stop()
