"""``python -m tools.bench.analytics``: the delivery analytics, measured (the results:
docs/performance.md; the pipeline: docs/analytics.md).

1. a simulated fleet of about ``--records`` log records (``tools.fleet``; kept in
   ``var/bench-fleet`` between runs, made again when asked for more);
2. in rounds, alternating: a plain single-process Python pass over every segment (decode
   and count rows by kind: what the data source's decoding costs), and Spark on
   ``local[2]`` doing the same through the data source; then the whole ``spool report``
   pipeline (tables, every report, plots, page) on the same session.

Prints the rates, the ratio Spark / plain, and the verdicts of the targets: decoding at
least 200,000 records a second per core; Spark ahead of the plain pass end to end; the
whole pipeline on a million records in under 60 s once the session is up. Timing is
measured here, never asserted in tests.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

from spool.analytics.events import plan_segments, segment_rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FLEET = os.path.join(ROOT, "var", "bench-fleet")
DECODE_PER_CORE = 200_000
PIPELINE_SECONDS = 60.0


def fleet(records: int) -> tuple[list[str], int]:
    """The sources of a simulated fleet with at least ``records`` records, and its count."""
    from tools.fleet import simulate

    stamp = os.path.join(FLEET, "records.json")
    if os.path.exists(stamp):
        with open(stamp) as f:
            made = json.load(f)
        if made["records"] >= records:
            return made["sources"], made["records"]
    shutil.rmtree(FLEET, ignore_errors=True)
    # About 7 records a message (accept, start, deltas, replacements, finish); three servers.
    per_hour = max(20, records // (7 * 3 * 48))
    print(f"bench: simulating a fleet (3 servers, 48 h, {per_hour}/h)...", file=sys.stderr)
    simulate(FLEET, servers=3, hours=48, per_hour=per_hour, seed=11, progress=False)
    sources = [os.path.join(FLEET, f"mx{i}") for i in (1, 2, 3)]
    count = sum(1 for _ in _records(sources))
    with open(stamp, "w") as f:
        json.dump({"records": count, "sources": sources}, f)
    return sources, count


def _records(sources: list[str]) -> Any:
    """One item per record (a row per record, not per recipient)."""
    for source in plan_segments(sources):
        last = None
        for row in segment_rows(source):
            key = (row[1], row[2])
            if key != last:
                last = key
                yield row


def plain_pass(sources: list[str]) -> tuple[float, int, dict[str, int]]:
    started = time.perf_counter()
    kinds: collections.Counter[str] = collections.Counter()
    rows = 0
    for source in plan_segments(sources):
        for row in segment_rows(source):
            kinds[row[6]] += 1
            rows += 1
    return time.perf_counter() - started, rows, dict(kinds)


def spark_pass(spark: Any, sources: list[str]) -> tuple[float, int, dict[str, int]]:
    started = time.perf_counter()
    counted = spark.read.format("spool").load(",".join(sources)).groupBy("kind").count().collect()
    kinds = {r["kind"]: r["count"] for r in counted}
    return time.perf_counter() - started, sum(kinds.values()), kinds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    sources, records = fleet(args.records)
    print(f"bench: {records:,} records in {len(plan_segments(sources))} segments", file=sys.stderr)

    from spool.analytics.pipeline import run_report
    from spool.analytics.session import spark_session

    up = time.perf_counter()
    spark = spark_session("local[2]")
    spark.conf.set("spark.sql.shuffle.partitions", "4")
    session_seconds = time.perf_counter() - up
    plain: list[float] = []
    sparked: list[float] = []
    rows = 0
    for n in range(args.rounds):
        for use_spark in (False, True) if n % 2 == 0 else (True, False):
            if use_spark:
                seconds, rows_seen, _ = spark_pass(spark, sources)
                sparked.append(seconds)
            else:
                seconds, rows_seen, _ = plain_pass(sources)
                plain.append(seconds)
            if rows and rows_seen != rows:
                raise SystemExit(f"bench: the passes disagree: {rows_seen} rows, then {rows}")
            rows = rows_seen
    out = tempfile.mkdtemp(prefix="spool-bench-report-")
    try:
        started = time.perf_counter()
        run_report(spark, sources, os.path.join(out, "r"))
        pipeline = time.perf_counter() - started
    finally:
        shutil.rmtree(out, ignore_errors=True)
        spark.stop()
    p, s = statistics.median(plain), statistics.median(sparked)
    per_core = records / p
    scaled = pipeline * 1_000_000 / records
    lines = [
        f"fleet: {records:,} records ({rows:,} rows) of 3 servers; Spark session up in "
        f"{session_seconds:.1f} s",
        f"plain Python pass (1 process): median {p:.2f} s, {per_core:,.0f} records/s",
        f"Spark local[2] through the data source: median {s:.2f} s, {records / s:,.0f} "
        f"records/s; Spark / plain {p / s:.2f}x",
        f"whole pipeline (tables, reports, plots, page): {pipeline:.1f} s "
        f"({scaled:.1f} s per million records)",
        "",
        "| target | needed | measured | verdict |",
        "|---|---|---:|---|",
        _target(
            "decoding per core",
            f">= {DECODE_PER_CORE:,} records/s",
            per_core,
            per_core >= DECODE_PER_CORE,
        ),
        _target("Spark vs plain pass", "> 1.0x", p / s, p / s > 1.0),
        _target(
            "pipeline per million records",
            f"< {PIPELINE_SECONDS:.0f} s",
            scaled,
            scaled < PIPELINE_SECONDS,
        ),
    ]
    print("\n".join(lines))
    return 0


def _target(name: str, needed: str, value: float, met: bool) -> str:
    shown = f"{value:,.0f}" if value >= 100 else f"{value:.2f}"
    return f"| {name} | {needed} | {shown} | {'met' if met else '**missed**'} |"


if __name__ == "__main__":
    raise SystemExit(main())
