"""The packaged devices' ACL is a static conffile, but its pattern lines
have one home: topics.TopicLayout.acl_patterns() (issue 22)."""

from __future__ import annotations

from pathlib import Path

import pytest
from iggy_edge import topics

pytestmark = pytest.mark.unit

ACL = Path(__file__).resolve().parents[1] / "packaging" / "mosquitto" / "iggy-edge.acl"


def test_the_packaged_device_acl_is_exactly_the_default_layouts_patterns() -> None:
    lines = [line.strip() for line in ACL.read_text().splitlines()]
    rules = [line for line in lines if line and not line.startswith("#")]
    assert tuple(rules) == topics.DEFAULT.acl_patterns()
