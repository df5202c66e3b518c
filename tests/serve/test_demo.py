"""``make run`` (``python -m tools.demo DIR``) as a newcomer runs it: the owner, two
workers, generated mail, progress and a summary; Ctrl-C stops it early, cleanly."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

from spool import Spool
from tests.serve.running import ROOT, child_env, sigint_as_default


def _demo(directory: Path, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tools.demo", str(directory), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=child_env(),
        preexec_fn=sigint_as_default,
    )


def test_the_demo_accepts_delivers_drains_and_sums_up(tmp_path: Path) -> None:
    demo = _demo(tmp_path / "spool", "--seconds", "1", "--producers", "2")
    out, err = demo.communicate(timeout=120)
    assert demo.returncode == 0, err
    lines = out.splitlines()
    assert "ready" in lines[0]
    assert any(re.match(r"\s*\d+\.\ds accepted +\d+ +delivered", line) for line in lines)
    summary = re.fullmatch(
        r"summary: accepted (\d+), delivered (\d+), deferred (\d+), failed (\d+) "
        r"\(recipients\); \d+ fsyncs = [0-9.]+ per message, [0-9.]+ records per fsync; "
        r"owner stopped \(status 0\)",
        lines[-1],
    )
    assert summary, lines[-1]
    accepted, delivered, _deferred, failed = map(int, summary.groups())
    assert accepted > 0 and delivered + failed >= accepted  # each message 1 to 3 recipients
    with Spool.open(tmp_path / "spool") as sp:
        assert list(sp.list()) == []  # drained before the summary


def test_ctrl_c_stops_the_demo_early_with_its_summary(tmp_path: Path) -> None:
    demo = _demo(tmp_path / "spool", "--seconds", "60")
    assert demo.stdout is not None
    assert "ready" in demo.stdout.readline()
    assert "accepted" in demo.stdout.readline()  # the first progress line
    demo.send_signal(signal.SIGINT)
    rest, err = demo.communicate(timeout=60)
    assert demo.returncode == 130, err
    assert rest.splitlines()[-1].startswith("summary: accepted ")
    assert rest.splitlines()[-1].endswith("owner stopped (status 0)")
    assert "Traceback" not in err
    with Spool.open(tmp_path / "spool") as sp:  # the owner let go of it: it opens
        sp.list()
