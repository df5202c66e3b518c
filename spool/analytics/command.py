"""``spool report``'s work, apart from the command line (``cli.py`` imports this only when
the command runs, so the CLI works without the analytics extra)."""

from __future__ import annotations

import datetime as dt
import logging
import os
import re
import shutil
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from spool.analytics.events import parse_source, plan_segments
from spool.analytics.pipeline import check_output, run_report
from spool.analytics.session import spark_session
from spool.errors import ReportFailed


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
    if start is not None and end is not None and start >= end:
        raise ValueError(f"--since {since} is not before --until {until}: an empty window")
    plan = plan_segments(sources)  # a bad path fails before Spark starts
    check_output(out, [s.log_dir for s in plan] + [parse_source(t)[1] for t in sources])
    say = progress or (lambda _: None)
    say(f"starting Spark ({master or 'local[*]'})")
    if not verbose:
        # py4j logs the tracebacks of an interrupted call on the root logger.
        logging.getLogger().setLevel(logging.CRITICAL)
    try:
        spark = spark_session(master, verbose=verbose)
        # PySpark's own SIGINT handler cancels jobs through the gateway from inside a call
        # on it (reentrant: a page of tracebacks); Ctrl-C just interrupts here instead.
        signal.signal(signal.SIGINT, signal.default_int_handler)
        summary = run_report(
            spark, sources, out, since=start, until=end, on_damage=on_damage, progress=say
        )
    except KeyboardInterrupt:
        interrupted(out)
    except Exception as exc:
        raised = spool_error_in(exc)
        if raised is None:
            raise
        spark.stop()
        raise ReportFailed(raised) from None
    spark.stop()
    return summary


# What a Spark task's traceback says of the spool error it raised (its last line).
_SPOOL_ERROR = re.compile(r"^spool\.errors\.\w+: (.+)$", re.MULTILINE)


def spool_error_in(exc: Exception) -> str | None:
    """The message of the spool error behind a failed Spark job (a worker's exception
    reaches the driver as text in a PythonException), or None if it was something else."""
    found = _SPOOL_ERROR.findall(str(exc))
    return found[-1] if found else None


def interrupted(out: str) -> NoReturn:
    """Ctrl-C: leave the previous report as it was, say so in one line, and exit at once
    (130). The JVM ends by itself when its parent's end closes its standard input; a
    normal exit would first try to stop it through the interrupted gateway."""
    shutil.rmtree(out.rstrip(os.sep) + ".partial", ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.write(f"spool: interrupted; {out} is as it was\n")
    sys.stderr.flush()
    os._exit(130)
