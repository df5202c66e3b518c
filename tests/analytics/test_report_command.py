"""``spool report`` as a user runs it: a subprocess, its output, its errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any


def _spool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spool.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_report_json_gives_the_headline_and_progress(
    fleet: tuple[Path, Any], tmp_path: Path
) -> None:
    out, truth = fleet
    proc = _spool("report", f"edge={out / 'mx1'}", "--out", str(tmp_path / "r"), "--json")
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    mine = [t for t in truth if t["server"] == "mx1"]
    assert summary["recipients"] == len(mine)
    assert summary["delivered"] == sum(t["status"] == "delivered" for t in mine)
    assert summary["servers"] == 1 and summary["accountability_violations"] == []
    assert (tmp_path / "r" / "tables" / "events" / "server=edge").is_dir()
    assert (tmp_path / "r" / "index.html").is_file()
    # Progress on standard error, and nothing of Spark's own.
    assert "report: computing per domain" in proc.stderr
    for noise in ("Traceback", "WARN", "log4j", "setLogLevel"):
        assert noise not in proc.stderr, proc.stderr


def test_bad_input_is_one_line_and_changes_nothing(tmp_path: Path) -> None:
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "keep").write_text("mine")
    proc = _spool("report", str(tmp_path / "nothing"), "--out", str(tmp_path / "r"))
    assert proc.returncode == 1
    assert proc.stderr.strip().count("\n") == 0 and "no such directory" in proc.stderr
    proc = _spool("report", str(tmp_path), "--out", str(tmp_path / "r"), "--since", "yesterday")
    assert proc.returncode == 1 and "--since 'yesterday'" in proc.stderr
    assert (tmp_path / "r" / "keep").read_text() == "mine"


def test_ctrl_c_stops_the_report_in_one_line_and_keeps_the_previous_one(
    fleet: tuple[Path, Any], tmp_path: Path
) -> None:
    import signal

    out, _ = fleet
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "index.html").write_text("the previous report")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "spool.cli",
            "report",
            str(out / "mx1"),
            "--out",
            str(tmp_path / "r"),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # Spark is up and reading: interrupt it there
        if line.startswith("report: reading"):
            break
    proc.send_signal(signal.SIGINT)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130
    assert rest.strip() == f"spool: interrupted; {tmp_path / 'r'} is as it was", rest
    assert (tmp_path / "r" / "index.html").read_text() == "the previous report"
    assert not (tmp_path / "r.partial").exists()
