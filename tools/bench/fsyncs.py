"""Counting sync calls from outside: a trial run under ``strace -c``.

SQLite and persist-queue sync inside C code, where no Python seam can count them, so
every system's trial is run once under ``strace -f -c -e trace=fsync,fdatasync`` (all
threads, only those two system calls stopped) and the calls are divided by the messages
the trial completed. The count covers the whole process, opening and closing included.
"""

from __future__ import annotations

import os
import shutil
import tempfile

from tools.bench.spawn import run_json

TRACED = ("fsync", "fdatasync")


def strace_available() -> bool:
    """Whether strace is installed (and so whether outside counts can be taken)."""
    return shutil.which("strace") is not None


def parse_strace_summary(text: str) -> dict[str, int]:
    """Calls per system call from ``strace -c`` output (the table's ``calls`` column)."""
    counts: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[-1] in TRACED and len(fields) >= 5:
            # % time, seconds, usecs/call, calls, [errors], syscall
            counts[fields[-1]] = int(fields[3])
    return counts


def counted_trial(args: list[str], scratch: str) -> tuple[dict[str, object], dict[str, int]]:
    """Run a ``child trial`` under strace; return its JSON result and the sync calls."""
    fd, out = tempfile.mkstemp(prefix="strace-", suffix=".txt", dir=scratch)
    os.close(fd)
    try:
        prefix = [
            "strace",
            "-f",
            "--seccomp-bpf",
            "-c",
            "-e",
            f"trace={','.join(TRACED)}",
            "-o",
            out,
        ]
        result = run_json(args, prefix=prefix)
        with open(out) as f:
            return result, parse_strace_summary(f.read())
    finally:
        os.unlink(out)
