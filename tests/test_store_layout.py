"""The shape of the store (issue 22): one recovery package, and schema.py
keeps the tables and the opening of a file, not what to do when it fails."""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import iggy_edge.store
import pytest
from iggy_edge.store import schema

pytestmark = pytest.mark.unit

STORE = Path(iggy_edge.store.__file__).parent
MAX_LINES = 450


def _lines(path: Path) -> int:
    return len(path.read_text(encoding="utf-8").splitlines())


def test_recovery_is_one_package_of_small_modules() -> None:
    recovery = importlib.import_module("iggy_edge.store.recovery")
    assert recovery.__file__ is not None
    assert Path(recovery.__file__).name == "__init__.py"
    names = {m.name for m in pkgutil.iter_modules(recovery.__path__)}
    assert {"errors", "wal", "salvage", "events", "opening"} <= names
    for name in names:
        path = STORE / "recovery" / f"{name}.py"
        assert _lines(path) <= MAX_LINES, path


def test_schema_holds_no_recovery() -> None:
    """Deciding between a full disk and a damaged file is recovery's job."""
    for name in ("recover", "reopen", "open_database", "record_events"):
        assert not hasattr(schema, name), name
    source = (STORE / "schema.py").read_text(encoding="utf-8")
    assert "from .recovery" not in source


def test_every_store_module_is_small() -> None:
    for path in STORE.rglob("*.py"):
        assert _lines(path) <= MAX_LINES, path


def test_the_inbox_cli_half_lives_beside_buffer_admin() -> None:
    """The blocking tools the CLI calls on the inbox are in inbox_admin.py,
    next to buffer_admin.py; downlink/ holds the agent's side only."""
    admin = importlib.import_module("iggy_edge.inbox_admin")
    inbox = importlib.import_module("iggy_edge.downlink.inbox")

    for name in ("read_commands", "read_configs", "read_offsets", "request_republish"):
        assert callable(getattr(admin, name)), name
    assert importlib.util.find_spec("iggy_edge.downlink.views") is None
    assert inbox.__file__ is not None
    assert _lines(Path(inbox.__file__)) <= MAX_LINES
    assert admin.__file__ is not None
    assert Path(admin.__file__).parent == STORE.parent


def test_no_dead_outbox_api() -> None:
    """`fail` (and the `_failure` it set, checked on every submit), and the
    `connection` / `database` properties had no caller."""
    from iggy_edge.store import Outbox  # noqa: PLC0415 - beside what it checks

    for name in ("fail", "connection", "database"):
        assert not hasattr(Outbox, name), name
    assert "self._failure" not in "".join(p.read_text(encoding="utf-8") for p in STORE.rglob("*.py"))


def test_no_reference_to_the_removed_store_module() -> None:
    """store.py became the store/ package long ago; comments say so."""
    root = STORE.parent
    mine = [*STORE.rglob("*.py"), *(root / "downlink").glob("inbox*.py"), root / "buffer_admin.py"]
    mine.append(root / "inbox_admin.py")
    for path in mine:
        text = path.read_text(encoding="utf-8")
        assert re.search(r"\bstore\.py\b", text) is None, path


def test_get_or_create_a_route_or_source_id_is_written_once() -> None:
    """The commit, the salvage and the CLI's replay take their ids from
    sources.Catalog; only the migration (bulk) and the salvage (routes
    copied with their ids) write those tables otherwise."""
    agent = STORE.parent
    writers: dict[str, set[str]] = {"INTO sources": set(), "INTO routes": set(), "SOURCE_ID_SQL": set()}
    for path in agent.rglob("*.py"):
        text = path.read_text(encoding="utf-8")
        for needle, found in writers.items():
            if needle in text:
                found.add(path.relative_to(agent).as_posix())
    assert writers["SOURCE_ID_SQL"] == {"store/sources.py"}
    assert writers["INTO sources"] <= {"store/sources.py", "store/schema.py"}
    assert writers["INTO routes"] <= {"store/sources.py", "store/recovery/salvage.py"}


def test_the_outbox_is_composed_of_parts_that_own_their_state() -> None:
    """No mixins: each part is its own object, holding references to the
    parts it needs (store/base.py has the table)."""
    from iggy_edge.store import Outbox  # noqa: PLC0415 - beside what it checks
    from iggy_edge.store.base import Part  # noqa: PLC0415

    assert Outbox.__mro__ == (Outbox, object)
    parts = importlib.import_module("iggy_edge.store.outbox")
    for name in ("Bounds", "DeadLetters", "Devices", "GroupCommit", "Reader"):
        cls = getattr(parts, name)
        assert cls.__mro__ == (cls, Part, object), name


async def test_each_part_holds_its_own_state(tmp_path: Path) -> None:
    from iggy_edge.config import BufferSettings  # noqa: PLC0415
    from iggy_edge.metrics import Metrics  # noqa: PLC0415
    from iggy_edge.store import Outbox  # noqa: PLC0415

    box = await Outbox.open(tmp_path / "b.db", BufferSettings(), "gw", Metrics())
    try:
        owners = {
            "by_key": box.devices,
            "groups": box.dead,
            "_recent": box.commit,
            "_pending": box.commit,
            "source_names": box.catalog,
            "epoch": box.reader,
        }
        every = (box.devices, box.bounds, box.dead, box.commit, box.reader, box.catalog)
        for attr, owner in owners.items():
            assert [p for p in every if attr in vars(p)] == [owner], attr
        assert box.commit._handover is box.dead._handover  # noqa: SLF001 - the one channel to the committer
    finally:
        await box.close()
