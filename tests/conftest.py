"""Shared fixtures and the Hypothesis profiles (``HYPOTHESIS_PROFILE=ci`` in CI)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from spool import Spool
from spool.testing import FakeClock

settings.register_profile("default", max_examples=100, deadline=None)
settings.register_profile(
    "ci", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("long", max_examples=2000, deadline=None)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def spool_dir(tmp_path: Path) -> str:
    return str(tmp_path / "spool")


@pytest.fixture
def sp(spool_dir: str, clock: FakeClock) -> Iterator[Spool]:
    s = Spool.open(spool_dir, clock=clock)
    yield s
    s.close()
