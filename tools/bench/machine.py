"""A description of the machine a run happened on: what the numbers depend on.

Cores, memory, kernel, the file system type under the benchmark directory, the CPU
model, and the versions of Python, SQLite and persist-queue. No host names, no paths.
"""

from __future__ import annotations

import os
import platform
import sqlite3
import subprocess
from importlib import metadata


def _meminfo_gib() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1024 * 1024)
    return 0.0


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def fs_type(path: str) -> str:
    """The file system type holding ``path`` (as ``df`` names it, e.g. ext4)."""
    try:
        out = subprocess.run(
            ["df", "--output=fstype", path], capture_output=True, text=True, check=True
        ).stdout.split()
        return out[-1]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "unknown"


def describe(bench_dir: str) -> dict[str, str]:
    """Facts about this machine, for the results file and docs/performance.md."""
    try:
        pq = metadata.version("persist-queue")
    except metadata.PackageNotFoundError:
        pq = "not installed"
    return {
        "cpus": str(len(os.sched_getaffinity(0))),
        "cpu": _cpu_model(),
        "memory": f"{_meminfo_gib():.0f} GiB",
        "kernel": platform.release(),
        "file system": fs_type(bench_dir),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "persist-queue": pq,
    }


def markdown(facts: dict[str, str]) -> list[str]:
    """The facts as a markdown list."""
    return [f"- {k}: {v}" for k, v in facts.items()]
