"""Start a real ``spool serve`` owner for a test, and stop it (SIGTERM) afterwards."""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict[str, str]:
    """The environment of the owner and its workers: this checkout importable (for the
    ``python:`` agents the tests define)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return env


def sigint_as_default() -> None:
    """In a child, before it runs: SIGINT as a terminal's Ctrl-C finds it, even when the
    tests run where SIGINT is ignored (a shell's background job), which children inherit."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@contextlib.contextmanager
def owner(directory: str, *args: str, log: str | None = None) -> Iterator[subprocess.Popen[bytes]]:
    """A running owner of ``directory``; its log goes to ``log`` (default: next to the
    spool). On exit it gets SIGTERM and must stop cleanly (status 0) unless already dead."""
    log_path = log or directory.rstrip("/") + ".log"
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    with open(log_path, "ab") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spool.cli", "serve", directory, *args],
            stdout=subprocess.PIPE,
            stderr=err,
            env=child_env(),
            cwd=ROOT,
            preexec_fn=sigint_as_default,
        )
    try:
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline().decode() if ready else ""
        assert "ready" in line, f"no ready line: {line!r}; log: {read(log_path)[-2000:]}"
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                status = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGUSR1)  # every thread's stack, into the log
                time.sleep(1)
                proc.kill()
                proc.wait()
                raise AssertionError(f"owner did not stop on SIGTERM: {read(log_path)}") from None
            assert status == 0, f"owner exited {status}; log: {read(log_path)[-3000:]}"
        if proc.stdout is not None:
            proc.stdout.close()


def read(path: str) -> str:
    with open(path, errors="replace") as f:
        return f.read()
