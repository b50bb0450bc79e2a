"""Bad configuration gets a clear error, never a traceback (issue 8, item 8).

Thousands of mutated config files (byte flips, truncation, type swaps, deep
nesting, huge numbers, random keys, bad credentials files and environment
overrides, starting from the annotated example; see tests/support/config_fuzz.py)
go through the loader in-process: each must be refused with every problem
naming its key, or accepted *and* usable by the agent.  A sample goes through
the real `iggy-edge config check`, and the settings that used to pass the
check but break the running agent are refused by `iggy-edge run` up front.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from iggy_edge.cli.main import app
from typer.testing import CliRunner

from tests.support.config_fuzz import EXAMPLE, mutate, outcome

BINARY = Path(sys.executable).parent / "iggy-edge"
runner = CliRunner()


@settings(
    max_examples=2000,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.randoms(use_true_random=False))
def test_mutated_configs_are_refused_with_a_key_or_accepted(rng: random.Random) -> None:
    with tempfile.TemporaryDirectory() as d:
        case = mutate(rng, Path(d))
        result = outcome(case)
    assert result in ("ok", "refused"), f"{result} after {case.steps}"


# -- the cases the adversarial run found, one by one ---------------------------

MINIMAL = 'gateway_id = "gw-1"\n'


def _cases(tmp: Path) -> list[tuple[str, bytes, str]]:
    """(name, config bytes, key that must be named)."""
    (tmp / "a-dir").mkdir()
    (tmp / "creds-binary.toml").write_bytes(b'[mqtt]\npassword = "\xff\xfe"\n')
    state = f'state_dir = "{tmp / "state"}"\n'
    base = MINIMAL + state
    deep = "[" * 3000 + "]" * 3000
    return [
        ("non-UTF-8 config", base.encode() + b'[mqtt]\nhost = "h\xc3"\n', "config"),
        (
            "non-UTF-8 credentials",
            b'credentials_file = "creds-binary.toml"\n' + base.encode(),
            "credentials_file",
        ),
        (
            "credentials_file is a directory",
            b'credentials_file = "a-dir"\n' + base.encode(),
            "credentials_file",
        ),
        ("nesting 3000 deep", f"x = {deep}\n{base}".encode(), "config"),
        (
            "nesting 100 deep",
            f"{base}[mqtt]\nsubscriptions = {'[' * 100}{']' * 100}\n".encode(),
            "mqtt.subscriptions[0]",
        ),
        ("integer of 4301 digits", f"{base}[mqtt]\nport = {'9' * 4301}\n".encode(), "config"),
        ("metrics.listen nonsense", f'{base}[metrics]\nlisten = "nonsense"\n'.encode(), "metrics.listen"),
        ("metrics.listen port only", f'{base}[metrics]\nlisten = "9108"\n'.encode(), "metrics.listen"),
        ("metrics.listen port 0", f'{base}[metrics]\nlisten = "127.0.0.1:0"\n'.encode(), "metrics.listen"),
        (
            "session expiry 2**32",
            f"{base}[mqtt]\nsession_expiry_s = 4294967296\n".encode(),
            "mqtt.session_expiry_s",
        ),
        ("linger inf", f"{base}[forward]\nlinger_ms = inf\n".encode(), "forward.linger_ms"),
        ("timeout nan", f"{base}[iggy]\nrequest_timeout_s = nan\n".encode(), "iggy.request_timeout_s"),
        ("ttl beyond SQLite", f"{base}[buffer]\nttl_s = {2**70}\n".encode(), "buffer.ttl_s"),
        ("route filter empty", f'{base}[[routes]]\nfilter = ""\n'.encode(), "routes[0].filter"),
        ("route filter a+b", f'{base}[[routes]]\nfilter = "a+b/c"\n'.encode(), "routes[0].filter"),
        ("route filter #/x", f'{base}[[routes]]\nfilter = "#/x"\n'.encode(), "routes[0].filter"),
        ("route filter NUL", f'{base}[[routes]]\nfilter = "a\\u0000b"\n'.encode(), "routes[0].filter"),
        (
            "subscription empty",
            f'{base}[mqtt]\nsubscriptions = [{{filter = ""}}]\n'.encode(),
            "mqtt.subscriptions[0].filter",
        ),
        ("ack filter a#", f'{base}[downlink]\nack_filter = "a#"\n'.encode(), "downlink.ack_filter"),
        ("routes empty", f"{base}routes = []\n".encode(), "routes"),
        ("mqtt.host empty", f'{base}[mqtt]\nhost = ""\n'.encode(), "mqtt.host"),
        ("state_dir empty", (MINIMAL + 'state_dir = ""\n').encode(), "state_dir"),
        ("buffer.path /dev/null", f'{base}[buffer]\npath = "/dev/null"\n'.encode(), "buffer.path"),
        ("buffer.path a directory", f'{base}[buffer]\npath = "{tmp / "a-dir"}"\n'.encode(), "buffer.path"),
        (
            "mqtt tls_ca_file a directory",
            f'{base}[mqtt]\ntls_ca_file = "{tmp / "a-dir"}"\n'.encode(),
            "mqtt.tls_ca_file",
        ),
        (
            "iggy tls_ca_file not PEM",
            f'{base}[iggy]\ntls_ca_file = "{tmp / "creds-binary.toml"}"\n'.encode(),
            "iggy.tls_ca_file",
        ),
        ("iggy address port 0", f'{base}[iggy]\nkind = "iggy"\naddress = "h:0"\n'.encode(), "iggy"),
        (
            "same client ids",
            f'{base}[mqtt]\nclient_id = "x"\n[downlink]\nclient_id = "x"\n'.encode(),
            "downlink.client_id",
        ),
    ]


@pytest.mark.parametrize("index", range(28))
@pytest.mark.unit
def test_each_reported_case_is_refused_naming_its_key(tmp_path: Path, index: int) -> None:
    cases = _cases(tmp_path)
    assert len(cases) == 28
    name, text, key = cases[index]
    cfg = tmp_path / "cfg.toml"
    cfg.write_bytes(text)
    result = runner.invoke(app, ["config", "check", str(cfg)], env={})
    assert result.exit_code == 2, f"{name}: {result.output}"
    assert result.exception is None or isinstance(result.exception, SystemExit), name
    assert f"  {key}: " in result.stderr, f"{name}: {result.stderr}"


def _cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("IGGY_")}
    return subprocess.run(
        [str(BINARY), *args], capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def test_generated_configs_through_the_real_cli(tmp_path: Path) -> None:
    """A sample of the fuzz cases through the installed `iggy-edge config check`."""
    seen = set()
    for seed in range(16):
        d = tmp_path / str(seed)
        d.mkdir()
        case = mutate(random.Random(seed), d)
        if case.env:
            continue  # the subprocess gets the plain environment
        proc = _cli("config", "check", str(case.config))
        assert "Traceback" not in proc.stderr, (case.steps, proc.stderr)
        assert proc.returncode in (0, 2), (case.steps, proc.returncode, proc.stderr)
        if proc.returncode == 2:
            problems = [ln for ln in proc.stderr.splitlines() if ln.startswith("  ") and ": " in ln]
            assert problems, proc.stderr
        seen.add(proc.returncode)
    assert seen == {0, 2}, "the sample should hold both good and bad files"
    ok = tmp_path / "example.toml"
    ok.write_bytes(EXAMPLE.replace(b'"/var/lib/iggy-edge"', f'"{tmp_path / "state"}"'.encode()))
    assert _cli("config", "check", str(ok)).returncode == 0


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ('[metrics]\nlisten = "nonsense"\n', "metrics.listen"),
        ("[mqtt]\nsession_expiry_s = 4294967296\n", "mqtt.session_expiry_s"),
        ("[forward]\nlinger_ms = inf\n", "forward.linger_ms"),
        ('[[routes]]\nfilter = ""\n', "routes[0].filter"),
        ('[buffer]\npath = "/dev/null"\n', "buffer.path"),
        ('[mqtt]\nhost = ""\n', "mqtt.host"),
    ],
)
def test_run_refuses_what_used_to_break_the_agent(tmp_path: Path, extra: str, key: str) -> None:
    """`iggy-edge run` exits 2 at once, naming the key, instead of starting a
    stage that crash-loops or never connects (systemd does not restart on 2)."""
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'{MINIMAL}state_dir = "{tmp_path / "state"}"\n{extra}')
    proc = _cli("run", "-c", str(cfg), timeout=20)
    assert proc.returncode == 2, proc.stderr
    assert f"  {key}: " in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "state").exists(), "refused before anything was created"
