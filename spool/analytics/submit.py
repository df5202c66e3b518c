"""The report as a ``spark-submit`` application, for a cluster:

    spark-submit --master spark://HOST:7077 --py-files spool.zip \\
        spool/analytics/submit.py SRC... --out DIR [--since T] [--until T] [--on-damage skip]

The session is the one ``spark-submit`` made (its master, its resources); the data source
is registered on it. Every executor must see the spool directories at the same paths
(shared storage) and import ``spool`` (``--py-files`` with a zip or wheel of the package,
or the package installed on every node); docs/analytics.md.
"""

from __future__ import annotations

import argparse
import json
import sys

from pyspark.sql import SparkSession

from spool.analytics.command import parse_time
from spool.analytics.pipeline import run_report
from spool.analytics.session import prepare


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spool-report-submit")
    parser.add_argument("sources", nargs="+")
    parser.add_argument("--out", required=True)
    parser.add_argument("--since")
    parser.add_argument("--until")
    parser.add_argument("--on-damage", choices=("error", "skip"), default="error")
    args = parser.parse_args(argv)
    spark = SparkSession.builder.appName("spool report").getOrCreate()
    prepare(spark)
    try:
        summary = run_report(
            spark,
            args.sources,
            args.out,
            since=parse_time(args.since, "since"),
            until=parse_time(args.until, "until"),
            on_damage=args.on_damage,
            progress=lambda line: print(f"report: {line}", file=sys.stderr, flush=True),
        )
    finally:
        spark.stop()
    print(json.dumps(summary, default=str, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
