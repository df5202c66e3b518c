"""One local Spark session for the analytics tests (starting one takes seconds), and a
simulated fleet with its truth, made once."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tools.fleet import simulate

try:
    import pyspark  # noqa: F401
except ImportError:
    if os.environ.get("CI"):  # `make test` installs the extra: in CI a skip would hide a gap
        raise
    # Without the extra (a bare `pip install -e .[dev]`), only the Spark-free tests run.
    collect_ignore = ["test_source.py", "test_reports.py", "test_report_command.py"]


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    from spool.analytics.session import spark_session

    session = spark_session("local[2]")
    session.conf.set("spark.sql.shuffle.partitions", "2")
    yield session
    session.stop()


@pytest.fixture(scope="session")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Two servers, a simulated day: every domain's behaviour, expiries included."""
    out = tmp_path_factory.mktemp("fleet")
    simulate(str(out), servers=2, hours=24, per_hour=20, seed=7)
    truth = json.loads((out / "truth.json").read_text())
    return out, truth
