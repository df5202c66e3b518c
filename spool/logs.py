"""Logging for the owner and its workers: standard error, one line per event.

The default is the conventional syslog-like line (``2026-11-25T06:40:00.123Z
spool[4711]: INFO message``, UTC); ``--log-format json`` writes one JSON object a line for
machines. Workers inherit the owner's choice through ``SPOOL_LOG_FORMAT``.
"""

from __future__ import annotations

import json
import logging
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


def setup_logging(log_format: str, program: str = "spool") -> None:
    """Log to standard error, one line per event (UTC times)."""
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
