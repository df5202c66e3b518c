"""``spool report``'s work, apart from the command line (``cli.py`` imports this only when
the command runs, so the CLI works without the analytics extra)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any

from spool.analytics.events import plan_segments
from spool.analytics.pipeline import run_report
from spool.analytics.session import spark_session


def parse_time(text: str | None, name: str) -> dt.datetime | None:
    """An ISO 8601 time (UTC unless it names a zone), or None."""
    if text is None:
        return None
    try:
        value = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(
            f"--{name} {text!r}: give a time as 2026-11-01 or 2026-11-01T12:00"
        ) from None
    return value if value.tzinfo else value.replace(tzinfo=dt.UTC)


def run_command(
    sources: list[str],
    out: str,
    *,
    since: str | None,
    until: str | None,
    master: str | None,
    on_damage: str,
    verbose: bool,
    progress: Callable[[str], None] | None,
) -> dict[str, Any]:
    """Check the arguments, start Spark, run the report; the summary."""
    start, end = parse_time(since, "since"), parse_time(until, "until")
    plan_segments(sources)  # a bad path fails before Spark starts
    say = progress or (lambda _: None)
    say(f"starting Spark ({master or 'local[*]'})")
    spark = spark_session(master, verbose=verbose)
    try:
        return run_report(
            spark, sources, out, since=start, until=end, on_damage=on_damage, progress=say
        )
    finally:
        spark.stop()
