"""The structure issue 22 set, held by the suite: module sizes, one home for
the device topic layout, and no stage reaching up into the `Agent`."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "agent" / "iggy_edge"
MAX_MODULE_LINES = 450
MAX_CLI_LINES = 300
# What `runtime` is for: putting the agent together.  Only the CLI, the demo
# (which runs one) and runtime itself may import it; a stage that did would be
# reaching up into the hub (httpd, systemd and receipts get narrow views in
# stages.py instead).
MAY_IMPORT_RUNTIME = {"runtime.py", "demo.py"}
# A device topic spelled as a string literal ("edge/...", ".../down/receipt";
# messages with an example in them have spaces and are left alone);
# topics.py is the one home of the layout.
SPELLED_TOPIC = re.compile(r"^edge/|/(down/(cmd|config|receipt|ota)|up/(ack|ota))$")


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_size(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    limit = MAX_CLI_LINES if path.parent.name == "cli" else MAX_MODULE_LINES
    assert lines <= limit, f"{path.relative_to(PACKAGE)}: {lines} lines, at most {limit}: split it"


def _imports_runtime(tree: ast.Module) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (
            node.module is not None
            and (node.module.split(".")[-1] == "runtime" or any(a.name == "runtime" for a in node.names))
        ):
            return True
        if isinstance(node, ast.Import) and any(a.name.endswith(".runtime") for a in node.names):
            return True
    return False


def test_only_the_cli_and_the_demo_import_the_agent_hub() -> None:
    reaching = [
        str(p.relative_to(PACKAGE))
        for p in _modules()
        if p.parent.name != "cli"
        and p.name not in MAY_IMPORT_RUNTIME
        and _imports_runtime(ast.parse(p.read_text()))
    ]
    assert reaching == []


def test_device_topics_are_spelled_only_in_topics_py() -> None:
    spelled = []
    for path in _modules():
        if path.name == "topics.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Constant) or not isinstance(node.value, str):
                continue
            if " " not in node.value and SPELLED_TOPIC.search(node.value):
                spelled.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {node.value!r}")
    assert spelled == []
