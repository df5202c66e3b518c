"""Running the benchmark's children: ``python -m tools.bench.child ...`` from the repo root.

Children print one JSON object on their last line of output; ``run_json`` returns it.
``hold_then_kill`` starts a child that says ``ready`` once it holds work in flight, and
kills it with SIGKILL at that moment: a crash, not a shutdown.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHILD = [sys.executable, "-m", "tools.bench.child"]


def run_json(args: list[str], *, prefix: list[str] | None = None, timeout: float = 600) -> Any:
    """Run a child command (optionally under ``prefix``, e.g. strace) and parse its JSON."""
    proc = subprocess.run(
        [*(prefix or []), *CHILD, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"child {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
        )
    lines = proc.stdout.strip().splitlines()
    if not lines:
        raise RuntimeError(f"child {' '.join(args)} printed nothing:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1])


def hold_then_kill(args: list[str], timeout: float = 600) -> None:
    """Start a child, wait for its ``ready`` line, then SIGKILL it and reap it."""
    proc = subprocess.Popen(
        [*CHILD, *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if line.strip() != "ready":
            proc.wait(timeout=timeout)
            err = proc.stderr.read() if proc.stderr else ""
            raise RuntimeError(f"child {' '.join(args)} did not get ready:\n{err[-4000:]}")
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
