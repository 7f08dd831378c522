"""Fixtures shared by the front-end tests."""

import bik
import pytest
import torch


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches and bik's counters empty before, and no front end left on after."""
    torch._dynamo.reset()
    bik.reset_mode_stats()
    yield
    torch._dynamo.reset()
    assert not bik.is_enabled() and not bik.is_batch_invariant_mode_enabled()
