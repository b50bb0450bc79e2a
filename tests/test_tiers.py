"""The fast tier's promises: `pytest -m unit` starts no server, and running
the pure tests does not load the native Iggy SDK."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.tiers import SERVERS, program_of

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent

# A test module for an inner pytest run (pytester): the unit-marked tests start
# (or try to start) what the fast tier must not need; the last one, unmarked,
# may.  `mosquitto -h` prints its usage and exits: nothing is left running.
INNER = """
import asyncio
import subprocess
import sys

import pytest


@pytest.mark.unit
def test_starts_a_broker():
    subprocess.run(["/usr/sbin/mosquitto", "-h"], check=False)


@pytest.mark.unit
def test_swallows_the_failure():
    try:
        subprocess.Popen("mosquitto_sub -t x")
    except BaseException:
        pass


@pytest.mark.unit
def test_through_asyncio():
    async def go():
        await asyncio.create_subprocess_exec("micropython", "-c", "pass")

    asyncio.run(go())


@pytest.fixture
def server():
    subprocess.run(["iggy-server", "--version"], check=False)


@pytest.mark.unit
def test_through_a_fixture(server):
    pass


@pytest.mark.unit
def test_runs_a_program_that_needs_no_server():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


def test_unmarked_may_start_a_broker():
    subprocess.run(["mosquitto", "-h"], check=False, capture_output=True)
"""


def test_the_guard_fails_a_unit_test_that_starts_a_server(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_inner=INNER)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    result = pytester.runpytest_subprocess(
        "-p", "tests.support.tiers", "-p", "no:cacheprovider", "-p", "no:asyncio", "-rA"
    )
    # A failure swallowed by the test still fails it, in its teardown (an
    # error); a fixture's start fails its setup (an error too).
    result.stdout.fnmatch_lines_random(
        [
            "PASSED test_inner.py::test_runs_a_program_that_needs_no_server",
            "PASSED test_inner.py::test_unmarked_may_start_a_broker",
            "ERROR test_inner.py::test_swallows_the_failure - Failed: a test*",
            "ERROR test_inner.py::test_through_a_fixture - Failed: a test*",
            "FAILED test_inner.py::test_starts_a_broker - Failed: a test*",
            "FAILED test_inner.py::test_through_asyncio - Failed: a test*",
        ]
    )
    out = result.stdout.str()
    for program in ("mosquitto:", "mosquitto_sub", "micropython:", "iggy-server:"):
        assert f"Failed: a test marked unit started {program}" in out, program
    result.assert_outcomes(passed=3, failed=2, errors=2)
    assert "a test marked unit started mosquitto_sub (and swallowed the failure)" in out


@pytest.mark.parametrize(
    ("args", "executable", "program"),
    [
        (["/usr/sbin/mosquitto", "-c", "x.conf"], None, "mosquitto"),
        ("mosquitto_pub -t a -m b", None, "mosquitto_pub"),
        (b"iggy-server", None, "iggy-server"),
        (Path("/work/.venv32/bin/micropython"), None, "micropython"),
        (["sh", "-c", "true"], "/usr/bin/micropython", "micropython"),
        (["iggy-edge", "run"], None, "iggy-edge"),
    ],
)
def test_program_of_names_what_would_run(args: object, executable: object, program: str) -> None:
    assert program_of(args, executable) == program


def test_the_servers_are_the_ones_the_tier_leaves_out() -> None:
    assert {"mosquitto", "mosquitto_sub", "mosquitto_pub", "micropython", "iggy-server"} == SERVERS


def test_the_root_conftest_does_not_load_the_native_iggy_sdk() -> None:
    """The pure tests need no native library: the conftest (and the support
    modules it imports) leave apache_iggy unloaded until a test asks for an
    iggy-server."""
    code = (
        "import sys, tests.conftest; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'apache_iggy'); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
