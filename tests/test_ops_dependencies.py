"""Dependencies you can reproduce (issue 13, point 7): exact pins where the
code depends on a library's internals, one constraints file that CI and the
.deb build both use, and this venv built from it."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

REPO = Path(__file__).parent.parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())


def _constraints() -> dict[str, str]:
    pins = {}
    for raw in (REPO / "constraints.txt").read_text().splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not an exact pin"
            pins[str(canonicalize_name(name))] = version
    return pins


def _requirements(group: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, group)}


def test_internals_and_style_gates_are_pinned_exactly() -> None:
    deps = _requirements(PYPROJECT["project"]["dependencies"])
    for name in ("gmqtt", "apache-iggy"):
        assert re.fullmatch(r"==\d+(\.\d+)+", str(deps[name].specifier)), deps[name]
    test = _requirements(PYPROJECT["project"]["optional-dependencies"]["test"])
    for name in ("ruff", "mypy"):
        assert re.fullmatch(r"==\d+(\.\d+)+", str(test[name].specifier)), test[name]
    assert "hypothesis" in test
    assert "rich" in deps, "imported directly by the CLI"


def test_spdx_license_and_a_setuptools_that_reads_it() -> None:
    assert PYPROJECT["project"]["license"] == "Apache-2.0"
    (req,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert req.specifier.contains("77")
    assert not req.specifier.contains("76.9")


def _closure(name: str, seen: set[str]) -> None:
    """`name` and everything it needs (in this environment)."""
    key = canonicalize_name(name)
    if key in seen:
        return
    seen.add(key)
    for spec in metadata.requires(name) or []:
        req = Requirement(spec)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            _closure(req.name, seen)


def test_constraints_pin_everything_the_agent_runs_and_this_venv_matches() -> None:
    pins = _constraints()
    needed: set[str] = set()
    _closure("iggy-edge", needed)
    needed.discard("iggy-edge")
    assert needed - pins.keys() == set(), "run .ci/lock: runtime dependencies without a pin"
    for extra in ("test", "device"):
        for name in _requirements(PYPROJECT["project"]["optional-dependencies"][extra]):
            assert name in pins, f"{extra} extra {name} is not in constraints.txt"
    # .ci/setup installed this venv with the constraints: every pin holds here
    wrong = {
        name: (version, metadata.version(name))
        for name, version in pins.items()
        if metadata.version(name) != version
    }
    assert not wrong, f"venv differs from constraints.txt (re-run .ci/setup): {wrong}"
    # and the pyproject pins agree with the lock
    deps = _requirements(PYPROJECT["project"]["dependencies"])
    for name in ("gmqtt", "apache-iggy"):
        assert deps[name].specifier.contains(pins[name])


def test_ci_and_the_deb_build_use_the_constraints() -> None:
    setup = (REPO / ".ci" / "setup").read_text()
    build = (REPO / "packaging" / "deb" / "build.sh").read_text()
    assert re.search(r"pip install .*-c constraints\.txt", setup)
    assert re.search(r"pip download .*\n?.*-c \"\$repo/constraints\.txt\"", build)
