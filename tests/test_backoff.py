"""The shared retry delay: capped, exponential, fully jittered."""

from __future__ import annotations

import random

import pytest
from iggy_edge.backoff import backoff_delay

pytestmark = pytest.mark.unit


def test_delay_stays_within_the_capped_exponential() -> None:
    random.seed(7)
    for attempt in range(40):
        ceiling = min(30.0, 0.5 * 2**attempt)
        draws = [backoff_delay(attempt, 0.5, 30.0) for _ in range(200)]
        assert all(0 <= d <= ceiling for d in draws)
        # full jitter: the draws spread over the whole range, not near the top
        assert min(draws) < ceiling * 0.1
        assert max(draws) > ceiling * 0.9


def test_huge_attempt_numbers_do_not_overflow() -> None:
    assert 0 <= backoff_delay(10**6, 1.0, 5.0) <= 5.0
