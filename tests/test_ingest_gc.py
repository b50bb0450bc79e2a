"""Ingest spares the process most full collections of the cyclic garbage
collector (heap.spare_full_collections, issue 22): a full collection
walks every object of the agent, and the groups in flight drive the young
collections that lead to one."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
from iggy_edge.heap import FULL_COLLECTION_AFTER, spare_full_collections
from iggy_edge.ingest import Ingest
from iggy_edge.metrics import Metrics
from iggy_edge.routing import Router

from tests.support.agent import make_settings

pytestmark = pytest.mark.unit


@pytest.fixture
def thresholds() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_ingest_waits_longer_for_full_collections(tmp_path: Path, thresholds: None) -> None:
    gc.set_threshold(700, 10, 10)  # Python's default
    settings = make_settings(tmp_path)
    Ingest(settings, cast(Any, None), Router(settings.routes, 1024), Metrics())
    assert gc.get_threshold() == (700, 10, FULL_COLLECTION_AFTER)


def test_a_collector_set_otherwise_is_left_alone(thresholds: None) -> None:
    gc.set_threshold(0, 10, 10)  # off
    spare_full_collections()
    assert gc.get_threshold() == (0, 10, 10)
    gc.set_threshold(700, 10, 1000)  # already waits longer
    spare_full_collections()
    assert gc.get_threshold() == (700, 10, 1000)
