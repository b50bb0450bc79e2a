"""Provisioning is a library (agent/iggy_edge/provision/) and the `device`
commands only parse and print (issue 22): the package imports no CLI
framework, and the modules stay small enough to change safely."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

AGENT = Path(__file__).resolve().parents[1] / "agent" / "iggy_edge"
PROVISION = AGENT / "provision"
DEVICE_CLI = sorted((AGENT / "cli").glob("device*.py"))


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_provision_package_holds_the_library_without_the_cli() -> None:
    modules = sorted(p.stem for p in PROVISION.glob("*.py") if p.stem != "__init__")
    assert {"board", "credentials", "flash", "plan", "ports", "sources", "staging"} <= set(modules)
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module('iggy_edge.provision.' + m)\n"
        "print(sorted(n for n in sys.modules if n.split('.')[0] in ('typer', 'click', 'rich')"
        " or n.startswith('iggy_edge.cli')))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert r.stdout.strip() == "[]"


def test_device_cli_modules_are_at_most_300_lines_and_provision_modules_450() -> None:
    assert DEVICE_CLI, "no cli/device*.py found"
    too_long = {p.name: n for p in DEVICE_CLI if (n := _lines(p)) > 300}
    too_long |= {f"provision/{p.name}": n for p in PROVISION.glob("*.py") if (n := _lines(p)) > 450}
    assert too_long == {}
