"""`iggy-edge run` imports what the agent uses and nothing else (issue 14).

The agent is the long-lived process on a small gateway; every module it
imports stays resident for its whole life.  The CLI's other commands (rich
tables, the X.509 library, doctor's probes, device provisioning) and the
uplink kinds the config does not choose must stay out of it.  Checked on the
real command in its own process: it runs against a real Mosquitto until
/health says ingest is up, then dumps `sys.modules` on SIGUSR1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.support.broker import Broker
from tests.support.ports import free_port
from tests.support.wait import wait_until

# What the console script does (`from iggy_edge.cli.main import app; app()`),
# plus a SIGUSR1 handler that writes the loaded module names to $DUMP.
WRAPPER = """
import os, signal, sys
def dump(*_):
    with open(os.environ["DUMP"] + ".tmp", "w") as f:
        f.write("\\n".join(sorted(sys.modules)))
    os.replace(os.environ["DUMP"] + ".tmp", os.environ["DUMP"])
signal.signal(signal.SIGUSR1, dump)
from iggy_edge.cli.main import app
sys.argv = ["iggy-edge", *sys.argv[1:]]
app()
"""

CLI_ONLY = [
    "rich",
    "cryptography",
    "iggy_edge.buffer_admin",
    "iggy_edge.gateway_ca",
    "iggy_edge.provision",
    "iggy_edge.simulate",
    # what the CLI's commands call (doctor's checks, status, demo, service)
    "iggy_edge.checks",
    "iggy_edge.config_check",
    "iggy_edge.clock_check",
    "iggy_edge.httpd_check",
    "iggy_edge.broker_checks",
    "iggy_edge.broker_listener",
    "iggy_edge.store.check",
    "iggy_edge.uplink.iggy.check",
    "iggy_edge.scrape",
    "iggy_edge.demo",
    "iggy_edge.service_unit",
    *(
        f"iggy_edge.cli.{m}"
        for m in (
            "buffer",
            "dead_letters",
            "progress",
            "command",
            "config_cmd",
            "demo",
            "device",
            "device_credentials",
            "doctor",
            "service",
            "status",
        )
    ),
]


def _ingest_up(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
            return bool(json.loads(resp.read())["ingest"] == "up")
    except urllib.error.HTTPError as e:  # 503 while not healthy yet; the body says why
        return bool(json.loads(e.read()).get("ingest") == "up")
    except OSError:
        return False


def _modules_of_run(tmp_path: Path, broker: Broker, iggy: str) -> set[str]:
    http_port = free_port()
    conf = tmp_path / "config.toml"
    conf.write_text(
        f'gateway_id = "lean"\nstate_dir = "{tmp_path / "state"}"\n'
        f'[mqtt]\nport = {broker.port}\nclient_id = "iggy-edge-lean"\n'
        f"[iggy]\n{iggy}\n"
        f'[metrics]\nlisten = "127.0.0.1:{http_port}"\n'
    )
    dump = tmp_path / "modules.txt"
    env = {**os.environ, "DUMP": str(dump)}
    log = (tmp_path / "agent.log").open("wb")
    agent = subprocess.Popen(
        [sys.executable, "-c", WRAPPER, "run", "--config", str(conf)], env=env, stdout=log, stderr=log
    )
    try:
        wait_until(lambda: _ingest_up(http_port) or agent.poll() is not None, 60, what="agent ingest up")
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
        agent.send_signal(signal.SIGUSR1)
        wait_until(dump.exists, 10, what="module dump")
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()
        log.close()
    assert agent.returncode == 0, (tmp_path / "agent.log").read_text()
    return set(dump.read_text().split())


@pytest.mark.parametrize(
    ("iggy", "chosen", "not_chosen"),
    [
        # no command source either: the return path's modules stay out too
        (
            'kind = "none"',
            [],
            ["apache_iggy", "iggy_edge.uplink.iggy", "iggy_edge.uplink.memory", "iggy_edge.downlink"],
        ),
        # nobody listens there: the forwarder retries, the agent runs
        (
            f'kind = "iggy"\naddress = "127.0.0.1:{free_port()}"\nusername = "u"\npassword = "p"',
            ["apache_iggy", "iggy_edge.uplink.iggy"],
            ["iggy_edge.uplink.memory", "iggy_edge.uplink.file"],
        ),
    ],
    ids=["uplink-none", "uplink-iggy"],
)
def test_run_imports_no_cli_only_module(
    tmp_path: Path, broker: Broker, iggy: str, chosen: list[str], not_chosen: list[str]
) -> None:
    modules = _modules_of_run(tmp_path, broker, iggy)
    # the dump is of the running agent: its own modules are there
    for used in ("iggy_edge.runtime", "iggy_edge.ingest", "iggy_edge.cli.run", "gmqtt", *chosen):
        assert used in modules
    loaded = sorted(m for m in modules if any(m == x or m.startswith(x + ".") for x in CLI_ONLY + not_chosen))
    assert loaded == []
