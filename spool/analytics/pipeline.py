"""``spool report``: spools in, Parquet tables, reports, plots and one HTML page out.

    OUT/tables/events/server=.../day=.../*.parquet      (Spark, partitioned)
    OUT/tables/recipients/server=.../day=.../*.parquet
    OUT/reports/NAME.parquet                             (one small table per report)
    OUT/plots/NAME.png
    OUT/index.html                                       (ties them together)
    OUT/summary.json                                     (the headline figures)

Runs on whatever master the session has (``local[*]`` by default): the tables are written
by the executors, the reports are small and collected to the driver, which writes them,
the plots and the page. ``OUT`` is replaced as a whole: a report never mixes two runs.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
from collections.abc import Callable
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from spool.analytics.events import parse_source, plan_segments
from spool.analytics.page import write_page
from spool.analytics.plots import write_plots
from spool.analytics.reports import REPORTS
from spool.analytics.tables import events_table, recipients_table
from spool.errors import ReportRefused

Progress = Callable[[str], None]


def _quiet(_: str) -> None:
    pass


def run_report(
    spark: SparkSession,
    sources: list[str],
    out: str,
    *,
    since: dt.datetime | None = None,
    until: dt.datetime | None = None,
    on_damage: str = "error",
    progress: Progress = _quiet,
) -> dict[str, Any]:
    """Read ``sources``, write everything under ``out``; return the headline figures."""
    plan = plan_segments(sources)  # NotASpool here, before Spark starts any work
    check_output(out, [s.log_dir for s in plan] + [parse_source(t)[1] for t in sources])
    servers = sorted({s.server for s in plan})
    progress(f"reading {len(plan)} segment(s) of {len(servers)} server(s): {', '.join(servers)}")
    raw = spark.read.format("spool").option("on_damage", on_damage).load(",".join(sources))
    if on_damage == "skip":
        # The damaged rows are looked for after the tables are written: from the cache,
        # not by decoding every segment a second time.
        raw = raw.cache()
    events = events_table(raw)
    if since is not None:
        events = events.where(F.col("time") >= F.lit(since))
    if until is not None:
        events = events.where(F.col("time") < F.lit(until))
    events = events.cache()
    recipients = recipients_table(events).withColumn("day", F.to_date("accepted_at")).cache()
    staging = out.rstrip(os.sep) + ".partial"
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(os.path.join(staging, "reports"))
    try:
        window = (since.isoformat() if since else None, until.isoformat() if until else None)
        summary = _write_all(
            events, recipients, raw if on_damage == "skip" else None, staging, progress,
            sources, window,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)  # a failed run leaves the previous report
        raise
    finally:
        _release(events, recipients, raw)
    # The previous report steps aside before the new one takes its name and is removed
    # after: a crash in between leaves one of them whole at OUT or beside it, never neither
    # (and OUT.partial, a run cut short, is removed by the next run).
    previous = out.rstrip(os.sep) + ".replaced-by-spool-report"
    shutil.rmtree(previous, ignore_errors=True)
    if os.path.exists(out):
        os.replace(out, previous)
    os.replace(staging, out)
    shutil.rmtree(previous, ignore_errors=True)
    return summary


def _write_all(
    events: DataFrame,
    recipients: DataFrame,
    raw: DataFrame | None,
    staging: str,
    progress: Progress,
    sources: list[str],
    window: tuple[str | None, str | None],
) -> dict[str, Any]:
    progress("writing the events table")
    _write_table(events, os.path.join(staging, "tables", "events"))
    progress("writing the recipients table")
    _write_table(recipients, os.path.join(staging, "tables", "recipients"))
    results: dict[str, list[dict[str, Any]]] = {}
    for name, report in REPORTS.items():
        progress(f"computing {name.replace('_', ' ')}")
        rows = [r.asDict(recursive=True) for r in report(events, recipients).collect()]
        results[name] = rows
        _write_small(rows, os.path.join(staging, "reports", f"{name}.parquet"))
    # With on_damage="error" damage fails the run, so there is no damaged row to look for.
    damaged = [] if raw is None else raw.where(F.col("kind") == "damaged").collect()
    summary = _summary(results, [f"{r['server']}: {r['reply']}" for r in damaged])
    summary["sources"] = sources
    summary["window"] = [window[0], window[1]]
    summary["generated_at"] = dt.datetime.now(dt.UTC).isoformat(timespec="seconds")
    progress("plots and the page")
    plots = write_plots(results, os.path.join(staging, "plots"))
    write_page(results, summary, plots, os.path.join(staging, "index.html"))
    with open(os.path.join(staging, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=str)
    return summary


def _release(*cached: DataFrame) -> None:
    """Drop the cached tables. After Ctrl-C the gateway may no longer answer (the call it
    was in was cut off): that error must not stand in for the interrupt, and the cache
    goes with the session anyway."""
    for df in cached:
        with contextlib.suppress(Exception):
            df.unpersist()


REPORT_ENTRIES = frozenset({"index.html", "summary.json", "plots", "reports", "tables"})


def check_output(out: str, sources: list[str]) -> None:
    """Refuse an output directory a report must not replace: the current directory or one
    above it, one holding or inside a source, or one with anything but an earlier report.
    (The report replaces its output directory whole.)"""
    target = os.path.realpath(out)
    here = os.path.realpath(os.getcwd())
    if here == target or here.startswith(target + os.sep):
        raise ReportRefused(f"--out {out} is the current directory or above it: name a new one")
    for source in sources:
        src = os.path.realpath(source)
        if src == target or src.startswith(target + os.sep) or target.startswith(src + os.sep):
            raise ReportRefused(f"--out {out} holds or lies inside the source {source}")
    if os.path.isdir(target):
        entries = set(os.listdir(target))
        if entries and not ({"index.html", "summary.json"} <= entries <= REPORT_ENTRIES):
            raise ReportRefused(
                f"--out {out} holds files that are not a report's ({', '.join(sorted(entries)[:3])}"
                f"{', ...' if len(entries) > 3 else ''}): a report replaces its directory "
                "whole, so name a new one or an earlier report's"
            )


def _write_table(df: DataFrame, path: str) -> None:
    df.write.mode("overwrite").partitionBy("server", "day").parquet(path)


def _write_small(rows: list[dict[str, Any]], path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def _summary(results: dict[str, list[dict[str, Any]]], damaged: list[str]) -> dict[str, Any]:
    [totals] = results["totals"] or [{}]
    return {
        **totals,
        "accountability_violations": [
            f"{r['server']} {r['msg_id']} {r['recipient']}: {r['problem']}"
            for r in results["accountability"]
        ],
        "damaged_segments": damaged,
    }
