"""The docs say how to install what no package index has."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent


def test_no_doc_installs_iggy_edge_from_an_index() -> None:
    docs = [ROOT / "README.md", ROOT / "device" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    from_index = re.compile(r"pip install\s+['\"]?iggy-edge\b")
    found = [
        f"{d.relative_to(ROOT)}:{n}"
        for d in docs
        for n, line in enumerate(d.read_text().splitlines(), 1)
        if from_index.search(line)
    ]
    assert found == []
