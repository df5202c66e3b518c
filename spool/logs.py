"""Logging for the owner and its workers: standard error, one line per event.

The default is the conventional syslog-like line (``2026-11-25T06:40:00.123Z
spool[4711]: INFO message``, UTC); ``--log-format json`` writes one JSON object a line for
machines; ``--log-file PATH`` appends to a file instead. Workers inherit the owner's choices
through ``SPOOL_LOG_FORMAT`` and ``SPOOL_LOG_FILE``. The delivery log (``delivery_log.py``)
is part of it: one line per accepted message, recipient outcome and operator action.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import sys
import time

LOG_FORMATS = ("text", "json")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, pid, logger, message."""

    def format(self, record: logging.LogRecord) -> str:
        return json.dumps({
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "pid": record.process,
            "logger": record.name,
            "message": record.getMessage(),
        })  # fmt: skip


def setup_logging(log_format: str, program: str = "spool", log_file: str | None = None) -> None:
    """Log to standard error, or append to ``log_file``, one line per event (UTC times).

    A log file is reopened when it was moved or removed (``WatchedFileHandler``), so that
    logrotate's default ``create`` rotation works without a signal."""
    handler: logging.Handler
    if log_file:
        handler = logging.handlers.WatchedFileHandler(log_file, encoding="utf-8")
    else:
        handler = logging.StreamHandler(sys.stderr)
    if log_format == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter(
                f"%(asctime)s.%(msecs)03dZ {program}[%(process)d]: %(levelname)s %(message)s",
                "%Y-%m-%dT%H:%M:%S",
            )
        )
    logging.Formatter.converter = time.gmtime
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.INFO)
    os.environ["SPOOL_LOG_FORMAT"] = log_format  # the workers log as the owner does
    if log_file:
        os.environ["SPOOL_LOG_FILE"] = os.path.abspath(log_file)
