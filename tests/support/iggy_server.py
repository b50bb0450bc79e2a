"""A real `iggy-server` on free loopback ports with a temporary data directory.

The server binary comes from PATH (build it from apache/iggy, tag
server-0.9.0-edge.5: ``cargo build --release -p server --bin iggy-server``;
it links against hwloc and udev, so install libhwloc-dev and libudev-dev first;
then copy target/release/iggy-server onto PATH).  When
it is missing, the `iggy_server` fixture skips the test with a reason.
This module loads the native Iggy SDK: tests/conftest.py imports it only
when a test asks for a server, so the fast tier (`pytest -m unit`) never does.

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
the server away and bring it back; `kill()` takes it away without a clean
shutdown and `pause()` / `resume()` freeze it (SIGSTOP/SIGCONT: connections
stay open, nothing answers).

With `tls` set (see `make_tls_files`, which needs the ``openssl`` command) the
TCP listener speaks TLS only (IGGY_TCP_TLS_ENABLED, _SELF_SIGNED=false,
_CERT_FILE, _KEY_FILE).

No node outlives its process.  A node runs in a session of its own (a
Ctrl-C in the terminal reaches the test or bench, not the servers), so every
exit path stops it explicitly:

* the normal one and exceptions, KeyboardInterrupt (SIGINT) included:
  ``stop()`` in the callers' ``finally``;
* interpreter exit without those (an uncaught SystemExit in a thread, a
  forgotten ``stop``): an ``atexit`` hook stops every node still running;
* SIGTERM (``timeout``, a CI runner, ``kill``): `stop_on_signals()` turns it
  into SystemExit so the two above run; the bench calls it;
* SIGKILL of the process, or a crash: the kernel sends the node SIGKILL
  (``prctl(PR_SET_PDEATHSIG)`` set in the child before exec, as the demo's
  private server does).  SIGKILL rather than SIGTERM because a node may be
  paused (SIGSTOP, `pause()`): a stopped process keeps a SIGTERM pending
  for ever.  The death signal fires when the *thread* that started the node
  ends, so nodes are started from the main thread; from another thread
  `launch` leaves it unset and the atexit hook is what remains.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from apache_iggy import AutoLogin, IggyClient, TcpConfig, TcpReconnectionConfig
from iggy_edge.config import IggySettings
from iggy_edge.records import OutboundRecord
from iggy_edge.uplink.iggy import IggyProbe, IggyUplink
from iggy_edge.uplink.protocol import UplinkError
from pydantic import SecretStr

from .ports import free_port
from .wait import wait_until

# Where IggyCluster.start checks that the cluster takes writes (never the
# agent's stream).
READY_STREAM = "cluster-ready"
READY_TOPIC = "probe"


@dataclass(frozen=True)
class TlsFiles:
    ca_file: Path
    cert_file: Path
    key_file: Path


def make_tls_files(directory: Path) -> TlsFiles:
    """A throwaway CA and a server certificate for localhost / 127.0.0.1."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (
        directory / n for n in ("ca.key", "ca.pem", "key.pem", "server.csr", "cert.pem")
    )
    ext = directory / "ext.cnf"
    ext.write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature\nextendedKeyUsage=serverAuth\n"
    )
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    for cmd in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=iggy-edge test CA"],
        ["req", *ec, "-keyout", key, "-out", csr, "-subj", "/CN=localhost"],
        [
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            cert,
            "-days",
            "2",
            "-extfile",
            ext,
        ],
    ):
        subprocess.run(["openssl", *map(str, cmd)], check=True, capture_output=True)
    return TlsFiles(ca_file=ca, cert_file=cert, key_file=key)


SKIP_REASON = "iggy-server not on PATH (build it from apache/iggy; see tests/support/iggy_server.py)"
ROOT_USER = "iggy"
ROOT_PASSWORD = "iggy-edge-test-secret"


def iggy_server_binary() -> str | None:
    return shutil.which("iggy-server")


PR_SET_PDEATHSIG = 1
# Every node started by this process and not stopped yet (`_stop_all` at exit).
_RUNNING: dict[int, IggyServer] = {}  # by id(): a dataclass with eq is unhashable


def _die_with(parent: int) -> Callable[[], None]:
    """preexec_fn: SIGKILL this child when the thread that forks it ends
    (module docstring); if `parent` is already gone, now."""

    def preexec() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != parent:  # the parent died before the prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)

    return preexec


def _stop_all() -> None:
    for server in list(_RUNNING.values()):
        server.stop()


atexit.register(_stop_all)


def stop_on_signals(*signals: signal.Signals) -> None:
    """Make SIGTERM (and `signals`) raise SystemExit in the main thread, so
    ``finally`` blocks and the atexit hook stop the nodes (for scripts: the
    bench; pytest handles its own signals)."""

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, *signals):
        signal.signal(sig, handler)


@dataclass
class IggyServer:
    workdir: Path
    port: int = field(default_factory=free_port)
    username: str = ROOT_USER
    password: str = ROOT_PASSWORD
    tls: TlsFiles | None = None
    proc: subprocess.Popen[bytes] | None = None
    # A cluster node (see IggyCluster): its roster file and replica id.
    config_path: Path | None = None
    replica_id: int | None = None

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
        if self.config_path is not None:
            env["IGGY_CONFIG_PATH"] = str(self.config_path)
        if self.tls is not None:
            env.update(
                {
                    "IGGY_TCP_TLS_ENABLED": "true",
                    "IGGY_TCP_TLS_SELF_SIGNED": "false",
                    "IGGY_TCP_TLS_CERT_FILE": str(self.tls.cert_file),
                    "IGGY_TCP_TLS_KEY_FILE": str(self.tls.key_file),
                }
            )
        return env

    def start(self, timeout: float = 60.0) -> IggyServer:
        binary = iggy_server_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.launch(binary)
        try:
            self.wait_ready(timeout)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise
        return self

    def launch(self, binary: str) -> None:
        """Start the process without waiting for it (a cluster starts all
        its nodes first: a node may wait for its peers)."""
        main = threading.current_thread() is threading.main_thread()
        with self.log_path.open("ab") as log:
            args = [binary] if self.replica_id is None else [binary, "--replica-id", str(self.replica_id)]
            self.proc = subprocess.Popen(
                args,
                cwd=self.workdir,
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # one prctl; see the module docstring for the thread caveat
                preexec_fn=_die_with(os.getpid()) if main else None,  # noqa: PLW1509
            )
        _RUNNING[id(self)] = self

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
                reconnection=TcpReconnectionConfig(enabled=False),
                tls_enabled=self.tls is not None,
                tls_ca_file=str(self.tls.ca_file) if self.tls is not None else None,
            )
        )
        try:
            await asyncio.wait_for(client.connect(), 2)
            await asyncio.wait_for(client.login_user(self.username, self.password), 2)
        finally:
            # Free the client inside the loop: a connected client still alive
            # at interpreter exit can abort the process (SDK 0.9.0).
            del client

    async def leader(self) -> str | None:
        """The leader's address as this node tells it (None when it does
        not answer or names none)."""
        settings = IggySettings(
            kind="iggy", address=self.address, username=self.username, password=SecretStr(self.password)
        )
        try:
            async with IggyProbe(settings, timeout_s=2.0) as probe:
                leader = (await probe.cluster()).leader
        except UplinkError:
            return None
        return None if leader is None else leader.address

    def log_tail(self, n: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except FileNotFoundError:
            return "(no log)"

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        _RUNNING.pop(id(self), None)
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGCONT)  # in case it was paused
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers.

        Returns once every thread of the server is stopped: the signal is
        only queued when kill(2) returns, and a thread running on the other
        core can still answer a request sent at once (CI saw a send succeed
        right after the signal)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP)
            wait_stopped(self.proc.pid)

    def resume(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL: the server vanishes without closing connections cleanly."""
        proc, self.proc = self.proc, None
        _RUNNING.pop(id(self), None)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()


CLUSTER_NAME = "iggy-edge-test"


def cluster_roster(nodes: list[IggyServer], replica_ports: list[int]) -> str:
    """The minimal cluster config every node reads (byte-identical): cluster
    mode on and the roster.  In cluster mode the roster is the only source of
    listener ports; HTTP, QUIC and WebSocket are off (by environment), so only
    `tcp` and `tcp_replica` are needed."""
    lines = ["[cluster]", "enabled = true", f'name = "{CLUSTER_NAME}"', ""]
    for i, (node, replica_port) in enumerate(zip(nodes, replica_ports, strict=True)):
        lines += [
            "[[cluster.nodes]]",
            f'name = "node-{i}"',
            'ip = "127.0.0.1"',
            f"replica_id = {i}",
            f"ports = {{ tcp = {node.port}, tcp_replica = {replica_port} }}",
            "",
        ]
    return "\n".join(lines)


@dataclass
class IggyCluster:
    """Three `iggy-server --replica-id N` on 127.0.0.1 (VSR), each with its own
    data directory and ports, all reading one roster file (IGGY_CONFIG_PATH).

    The server's defaults (core/server/config.toml) also open HTTP (3000),
    QUIC (8080) and WebSocket (8092): they are disabled by environment, as
    for the single server, so nodes never clash on a port."""

    workdir: Path
    size: int = 3
    nodes: list[IggyServer] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.workdir / "cluster.toml"
        self.nodes = [
            IggyServer(self.workdir / f"node-{i}", config_path=config, replica_id=i) for i in range(self.size)
        ]
        config.write_text(cluster_roster(self.nodes, [free_port() for _ in self.nodes]))

    @property
    def addresses(self) -> list[str]:
        return [n.address for n in self.nodes]

    def start(self, timeout: float = 90.0, attempts: int = 4) -> IggyCluster:
        """Start the nodes; ready once they agree on a leader and the cluster
        takes a write on every partition of a probe topic.

        The write check is there because of a server fault seen with
        0.9.0-edge.5 (once in some 20 cluster starts here): a view change of
        the metadata plane right after start moved its primary to another
        node while the partition plane kept the old one, and every send the
        SDK routed to the metadata primary was dropped without an answer
        ("rejecting client request on non-primary partition replica" in the
        server log) for as long as that lasted.  The same view change also
        leaves topics made later with their primary elsewhere, so a start
        whose leader is not replica 0 counts too (`_moved_problem`).  A
        cluster in that state is started again from empty data directories,
        up to `attempts` times."""
        binary = iggy_server_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        problem = ""
        for attempt in range(attempts):
            for node in self.nodes:
                shutil.rmtree(node.workdir / "data", ignore_errors=True)
                node.workdir.mkdir(parents=True, exist_ok=True)
                node.launch(binary)
            try:
                for node in self.nodes:
                    node.wait_ready(timeout)
                leader = self.wait_leader(timeout)
                # A moved primary is retried while starts are left; the last
                # start is taken if it takes writes (new topics' first writes
                # may then wait, as before this check).
                moved = self._moved_problem(leader) if attempt < attempts - 1 else ""
                problem = moved or self._write_problem()
            except (TimeoutError, RuntimeError):
                self.stop()
                raise
            if not problem:
                return self
            self.stop()
        raise TimeoutError(f"the cluster took no write after {attempts} starts: {problem}")

    def _moved_problem(self, leader: str) -> str:
        """'' when the metadata primary is still replica 0's, where a fresh
        cluster starts (view 0).  Otherwise a view change ran during the
        start, and partition groups made afterwards keep a primary the SDK
        does not talk to: a new topic's writes are refused ("non-primary
        partition replica") for seconds (4 s in 2 of 6 starts here) or, under
        load, for minutes (docs/scaling.md, run E)."""
        if leader == self.nodes[0].address:
            return ""
        return f"the metadata primary moved during the start (now {leader})"

    def _write_problem(self, timeout: float = 30.0) -> str:
        """'' once a write to each partition of the probe topic is
        acknowledged (through the agent's own uplink, as the agent sends);
        else why not, after `timeout`."""

        async def probe() -> str:
            first = self.nodes[0]
            settings = IggySettings(
                kind="iggy",
                addresses=tuple(self.addresses),
                username=first.username,
                password=SecretStr(first.password),
            )
            keys = [f"k{i}" for i in range(32)]  # enough keys to reach every partition
            batch = [
                OutboundRecord(i + 1, i + 1, READY_STREAM, READY_TOPIC, key, b"ready", {})
                for i, key in enumerate(keys)
            ]
            uplink = IggyUplink(settings, "cluster-ready", topics=[(READY_STREAM, READY_TOPIC)])
            deadline = time.monotonic() + timeout
            last = "no attempt"
            try:
                while time.monotonic() < deadline:
                    try:
                        await uplink.start()
                        await uplink.send(batch)
                        return ""
                    except UplinkError as e:
                        last = str(e)
                    await asyncio.sleep(0.5)
            finally:
                await uplink.close()
            return last

        with ThreadPoolExecutor(1) as pool:
            return pool.submit(asyncio.run, probe()).result()

    def wait_leader(self, timeout: float, among: list[IggyServer] | None = None) -> str:
        """Until every running node (of `among`) names the same leader in its
        cluster metadata; returns the leader's address."""
        nodes = [n for n in (among or self.nodes) if n.proc is not None]
        deadline = time.monotonic() + timeout
        seen: list[str | None] = []
        while time.monotonic() < deadline:
            with ThreadPoolExecutor(1) as pool:
                seen = [pool.submit(asyncio.run, n.leader()).result() for n in nodes]
            if seen and seen[0] is not None and all(x == seen[0] for x in seen):
                return seen[0]
            time.sleep(0.2)
        raise TimeoutError(f"no agreed cluster leader after {timeout}s (nodes say {seen})")

    def restart(self, timeout: float = 120.0) -> str:
        """Stop every node (SIGTERM, a clean shutdown) and start them again
        on their data (a cluster restart, an upgrade); the new leader."""
        binary = iggy_server_binary()
        if binary is None:
            raise RuntimeError(SKIP_REASON)
        self.stop()
        for node in self.nodes:
            node.launch(binary)
        try:
            for node in self.nodes:
                node.wait_ready(timeout)
            return self.wait_leader(timeout)
        except (TimeoutError, RuntimeError):
            self.stop()
            raise

    def node_at(self, address: str) -> IggyServer:
        return next(n for n in self.nodes if n.address == address)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()


def running_cluster(tmp_path: Path) -> Iterator[IggyCluster]:
    """A fresh 3-node iggy-server cluster for one test; skips when the binary
    is missing (the `iggy_cluster` fixture of tests/conftest.py)."""
    if iggy_server_binary() is None:
        pytest.skip(SKIP_REASON)
    cluster = IggyCluster(tmp_path / "cluster").start()
    try:
        yield cluster
    finally:
        cluster.stop()


def running_server(tmp_path: Path) -> Iterator[IggyServer]:
    """A fresh iggy-server for one test; skips when the binary is missing
    (the `iggy_server` fixture of tests/conftest.py)."""
    if iggy_server_binary() is None:
        pytest.skip(SKIP_REASON)
    server = IggyServer(tmp_path / "iggy").start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def iggy_tls_server(tmp_path: Path) -> Iterator[IggyServer]:
    """Like `iggy_server`, TLS only, with a CA of its own (`server.tls.ca_file`)."""
    if iggy_server_binary() is None:
        pytest.skip(SKIP_REASON)
    if shutil.which("openssl") is None:
        pytest.skip("openssl not on PATH (needed to make test certificates)")
    server = IggyServer(tmp_path / "iggy", tls=make_tls_files(tmp_path / "tls")).start()
    try:
        yield server
    finally:
        server.stop()


def _bytes_sent_by_peer(peers: set[str]) -> dict[tuple[str, str], int]:
    """bytes_sent of this process's TCP connections to `peers`, by (local, peer)."""
    out = subprocess.run(["ss", "-tinpH", "state", "established"], capture_output=True, text=True, check=True)
    lines = out.stdout.splitlines()
    mine = f"pid={os.getpid()},"
    sent: dict[tuple[str, str], int] = {}
    for head, info in itertools.pairwise(lines):
        fields = head.split()
        if mine not in head or len(fields) < 4 or fields[3] not in peers:
            continue
        for part in info.split():
            if part.startswith("bytes_sent:"):
                sent[(fields[2], fields[3])] = int(part.split(":", 1)[1])
    return sent


async def busiest_peer(peers: list[str], window: float = 1.0) -> str:
    """The one of `peers` this process sends the most bytes to over `window`
    seconds (by the kernel's per-socket counters, `ss -ti`): under load, the
    node the uplink uses, whichever node it dialed -- the SDK may have moved
    the session to the leader after login."""
    wanted = set(peers)
    first = _bytes_sent_by_peer(wanted)
    await asyncio.sleep(window)
    second = _bytes_sent_by_peer(wanted)
    deltas = {conn: n - first.get(conn, 0) for conn, n in second.items()}
    if not deltas:
        raise RuntimeError(f"no connection to any of {peers}")
    (_local, peer), _ = max(deltas.items(), key=lambda kv: kv[1])
    return peer


def _thread_states(pid: int) -> list[str]:
    """Each thread's state letter (/proc/PID/task/TID/stat, after the
    command name's closing paren); a thread that ended meanwhile is left out."""
    states = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            stat = (task / "stat").read_text()
            states.append(stat[stat.rindex(")") + 2])
    return states


def wait_stopped(pid: int, timeout: float = 5.0) -> None:
    """Wait until every thread of `pid` is stopped (state T)."""
    wait_until(
        lambda: all(s in "Tt" for s in _thread_states(pid)),
        timeout,
        interval=0.005,
        what=f"iggy-server {pid} stopped by SIGSTOP",
    )
