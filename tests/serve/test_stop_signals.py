"""A stop signal that lands while the main thread holds a lock stops the process all the
same (``spool/stop_signals.py``). Before: the owner's and the worker's handlers called
``Event.set()``; one that ran inside that event's own wait or set hung the process for
good (seen as an owner that ignored SIGTERM right after SIGCONT)."""

from __future__ import annotations

import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from spool import Spool
from spool.stop_signals import StopSignals
from tests.serve.running import ROOT, child_env, owner, read


def run_at_worst(*args: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "tests.serve.signal_at_worst", *args],
            stdout=subprocess.PIPE, stderr=err, env=child_env(), cwd=ROOT,
        )  # fmt: skip


def first_line(proc: subprocess.Popen[bytes], log: Path) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    line = proc.stdout.readline().decode() if ready else ""
    assert line, f"no first line; log: {read(str(log))[-2000:]}"
    return line


def ended(proc: subprocess.Popen[bytes], log: Path, what: str) -> int:
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the owner writes every thread's stack
        time.sleep(0.5)
        proc.kill()
        proc.wait()
        raise AssertionError(f"{what} hung on SIGTERM: {read(str(log))[-4000:]}") from None


def test_the_owner_stops_on_sigterm_handled_inside_its_wait(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    Spool.open(d).close()
    log = tmp_path / "owner.log"
    proc = run_at_worst("serve", d, log=log)
    assert "ready" in first_line(proc, log)
    assert ended(proc, log, "the owner") == 0
    assert first_line(proc, log).strip() == "stopped by SIGTERM"


def test_a_worker_stops_on_sigterm_handled_while_it_sets_its_stop(tmp_path: Path) -> None:
    """The worker's main thread sets its stop event when its owner goes; a SIGTERM (the
    supervisor's, at the owner's stop) handled right there hung the worker."""
    d = str(tmp_path / "spool")
    Spool.open(d).close()
    log = tmp_path / "worker.log"
    with owner(d) as owner_proc:
        worker = run_at_worst("worker", d, "--agent", "demo", log=log)
        try:
            assert first_line(worker, log).strip() == "armed"
        finally:
            owner_proc.send_signal(signal.SIGKILL)  # the owner goes: the worker's stop
            owner_proc.wait()
        assert ended(worker, log, "the worker") == 0


def test_stop_signals_records_waits_ignores_and_restores() -> None:
    before = signal.getsignal(signal.SIGUSR2)
    stop = StopSignals()
    stop.install([signal.SIGUSR2])
    try:
        assert not stop.wait(0.01)
        signal.raise_signal(signal.SIGUSR2)
        assert stop.stopped and stop.received == [signal.SIGUSR2]
        started = time.monotonic()
        assert stop.wait(30)  # does not sleep once stopped
        assert time.monotonic() - started < 5
        stop.ignore()
        signal.raise_signal(signal.SIGUSR2)  # ignored: not recorded, not fatal
        assert stop.received == [signal.SIGUSR2]
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR2) == before
