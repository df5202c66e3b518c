"""A Spark session for the analytics: local by default, any master when asked.

Binds to loopback for a local master, runs the Python workers on this interpreter, turns
the web UI and the console progress bar off, and keeps Spark's own logging to errors
unless ``verbose`` (``log4j2.properties`` beside this module; the JVM's start-up notices go
to ``JVM_LOG``). Registers the data source ``spool``.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from importlib import resources

from pyspark.sql import SparkSession

from spool.analytics.source import SpoolDataSource
from spool.errors import JavaMissing

DEFAULT_MASTER = "local[*]"


JVM_LOG = os.path.join(tempfile.gettempdir(), f"spool-report-spark-{os.getuid()}.log")


def _quietly(start: Callable[[], SparkSession]) -> SparkSession:
    """Start the JVM with its standard error going to ``JVM_LOG`` (its start-up notices,
    which no log4j setting reaches); errors in jobs still come back as exceptions."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(JVM_LOG, "ab") as log:
            os.dup2(log.fileno(), 2)
            return start()
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def spark_session(master: str | None = None, *, verbose: bool = False) -> SparkSession:
    """The session (``getOrCreate``: one per process), with the data source registered."""
    if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
        raise JavaMissing(
            "Spark needs Java 17 or later: install it (Debian: apt-get install "
            "openjdk-17-jre-headless) or set JAVA_HOME"
        )
    master = master or DEFAULT_MASTER
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = (
        SparkSession.builder.appName("spool report")
        .master(master)
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.session.timeZone", "UTC")
    )
    if master.startswith("local"):
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
        builder = builder.config("spark.driver.host", "127.0.0.1")
    if not verbose:
        config = resources.files("spool.analytics").joinpath("log4j2.properties")
        builder = builder.config(
            "spark.driver.extraJavaOptions", f"-Dlog4j.configurationFile=file:{config}"
        )
    spark = _quietly(builder.getOrCreate) if not verbose else builder.getOrCreate()
    if not verbose:
        spark.sparkContext.setLogLevel("ERROR")
    prepare(spark)
    return spark


def prepare(spark: SparkSession) -> None:
    """What a report needs of a session it did not build (``spark-submit``'s): the data
    source registered, and a shuffle partition a core unless the operator chose a number
    (spark-defaults.conf, ``--conf``). A report's shuffles carry a few columns a row;
    Spark's default of 200 partitions made a run on a small cluster twice as long."""
    if not spark.sparkContext.getConf().contains("spark.sql.shuffle.partitions"):
        cores = spark.sparkContext.defaultParallelism
        spark.conf.set("spark.sql.shuffle.partitions", str(max(2, cores)))
    spark.dataSource.register(SpoolDataSource)
