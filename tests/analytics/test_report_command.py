"""``spool report`` as a user runs it: a subprocess, its output, its errors."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from tests.serve.running import sigint_as_default


def _spool(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "spool.cli", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )


def _damaged_copy(source: Path, into: Path) -> Path:
    """A copy of the spool ``source`` with two bits flipped (no single one explains them)
    in the first record frame past the middle of its first segment (not a body, which the
    report steps over unread, nor padding); the segment's path."""
    from spool import format as fmt
    from spool.fs import FileSystem
    from spool.queue_view import walk

    shutil.copytree(source, into)
    segment = sorted((into / "log").iterdir())[0]
    data = bytearray(segment.read_bytes())
    number = fmt.parse_segment_name(segment.name)
    at = next(
        pos.offset + frame.size // 2
        for pos, _record, frame in walk(FileSystem(), str(into), skip_bodies=False)
        if frame is not None
        and pos.segment == number
        and pos.offset >= len(data) // 2
        and frame.type not in (fmt.T_BODY, fmt.T_PAD)
    )
    data[at] ^= 0x41
    data[at + 5] ^= 0x08
    segment.write_bytes(bytes(data))
    return segment


def test_report_json_gives_the_headline_progress_and_what_it_skipped(
    fleet: tuple[Path, Any], tmp_path: Path
) -> None:
    # One Spark run (each takes most of a minute) for two things a user sees: the headline
    # of a named source, and a damaged source skipped when asked (status 1, the report
    # written without the damaged segment's rest).
    out, truth = fleet
    segment = _damaged_copy(out / "mx2", tmp_path / "mx2")
    proc = _spool(
        "report", f"edge={out / 'mx1'}", str(tmp_path / "mx2"),
        "--out", str(tmp_path / "r"), "--json", "--on-damage", "skip",
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr
    summary = json.loads(proc.stdout)
    mine = [t for t in truth if t["server"] == "mx1"]
    [edge] = [
        row
        for row in pq.read_table(tmp_path / "r" / "reports" / "per_server.parquet").to_pylist()
        if row["server"] == "edge"
    ]
    assert edge["recipients"] == len(mine)
    assert edge["delivered"] == sum(t["status"] == "delivered" for t in mine)
    assert summary["servers"] == 2 and summary["accountability_violations"] == []
    assert len(mine) < summary["recipients"] < len(truth)  # mx2 without its damaged rest
    assert (tmp_path / "r" / "tables" / "events" / "server=edge").is_dir()
    assert (tmp_path / "r" / "index.html").is_file()
    assert f"spool: damaged, skipped: mx2: {segment}" in proc.stderr
    # Progress on standard error, and nothing of Spark's own.
    assert "report: computing per domain" in proc.stderr
    for noise in ("Traceback", "WARN", "log4j", "setLogLevel"):
        assert noise not in proc.stderr, proc.stderr


def test_bad_input_is_one_line_and_changes_nothing(fleet: tuple[Path, Any], tmp_path: Path) -> None:
    out, _ = fleet
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "keep").write_text("mine")
    new = str(tmp_path / "new")
    window = ["--since", "2026-11-02", "--until", "2026-11-01"]
    refused = [
        ([str(tmp_path / "nothing"), "--out", str(tmp_path / "new")], "no such directory"),
        ([str(out / "mx1"), "--out", str(tmp_path / "r")], "not a report's"),
        ([str(out / "mx1"), "--out", str(out / "mx1" / "report")], "lies inside the source"),
        ([str(out / "mx1"), str(out / "mx1-archive"), "--out", str(tmp_path / "new")], "once"),
        ([f"a={out / 'mx1'}", f"a={out / 'mx2'}", "--out", str(tmp_path / "new")], "apart"),
        ([str(out / "mx1"), "--out", str(tmp_path / "new"), "--since", "yesterday"], "--since"),
        ([str(out / "mx1"), "--out", new, *window], "empty window"),
    ]
    for args, words in refused:
        proc = _spool("report", *args)
        assert proc.returncode == 1, args
        assert proc.stderr.count("\n") == 1 and words in proc.stderr, (args, proc.stderr)
    assert (tmp_path / "r" / "keep").read_text() == "mine"
    assert not (tmp_path / "new").exists()


def test_damage_is_one_line_with_status_1(fleet: tuple[Path, Any], tmp_path: Path) -> None:
    out, _ = fleet
    segment = _damaged_copy(out / "mx2", tmp_path / "mx2")
    proc = _spool("report", str(tmp_path / "mx2"), "--out", str(tmp_path / "r"))
    assert proc.returncode == 1
    [last] = proc.stderr.strip().splitlines()[-1:]
    assert last.startswith("spool: corrupt spool file") and str(segment) in last
    assert "Traceback" not in proc.stderr and not (tmp_path / "r.partial").exists()
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("stage", ["report: reading", "report: computing per server"])
def test_ctrl_c_stops_the_report_in_one_line_and_keeps_the_previous_one(
    fleet: tuple[Path, Any], tmp_path: Path, stage: str
) -> None:
    """Ctrl-C to the command's process group (as a terminal sends it) while the tables
    are made, or while the reports are. (By hand, a Ctrl-C that cut off the gateway's
    answer to a report's collect made the release of the cache fail, and a page of
    tracebacks stood in for the one line; that window is too narrow to hit here.)"""
    import signal

    out, _ = fleet
    (tmp_path / "r").mkdir()  # an earlier report
    (tmp_path / "r" / "index.html").write_text("the previous report")
    (tmp_path / "r" / "summary.json").write_text("{}")
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
        preexec_fn=sigint_as_default,
        process_group=0,  # its own, as a terminal's foreground job has
    )
    assert proc.stderr is not None
    for line in proc.stderr:  # Spark is up and at that stage: interrupt it there
        if line.startswith(stage):
            break
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the command, its JVM and Spark's workers
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 130
    assert rest.strip() == f"spool: interrupted; {tmp_path / 'r'} is as it was", rest
    assert (tmp_path / "r" / "index.html").read_text() == "the previous report"
    assert not (tmp_path / "r.partial").exists()


WRITER = """
import os, sys, time
from spool import Spool
root, stop = sys.argv[1], sys.argv[2]
with Spool.open(root, segment_size=65536) as sp:
    for n in range(200):
        sp.accept("a@example.org", ["b@example.net"], b"first %d" % n)
    print("ready", flush=True)
    n = 0
    while not os.path.exists(stop):
        sp.accept("a@example.org", ["c@example.net"], b"x" * 2000 + b"%d" % n)
        n += 1
        time.sleep(0.005)
print(n, flush=True)
"""


def test_a_spool_being_written_is_read_up_to_its_end_beside_its_owner(tmp_path: Path) -> None:
    # An owner accepts all through the report (segments rolling over, the newest growing
    # as it is read); files in its log directory that are not segments are not read.
    root, stop = tmp_path / "mx", tmp_path / "stop"
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(root), str(stop)], stdout=subprocess.PIPE, text=True
    )
    assert writer.stdout is not None
    try:
        assert writer.stdout.readline() == "ready\n"
        (root / "log" / "README").write_text("the operator's notes")
        proc = _spool("report", str(root), "--out", str(tmp_path / "r"), "--json")
    finally:
        stop.touch()
        later = int(writer.stdout.read())
        assert writer.wait(timeout=60) == 0
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert 200 <= summary["received"] <= 200 + later
    assert summary["queued"] == summary["recipients"] == summary["received"]
    assert summary["accountability_violations"] == [] and summary["damaged_segments"] == []
    assert "Traceback" not in proc.stderr


def test_without_java_the_report_is_one_line_before_anything_is_read(tmp_path: Path) -> None:
    from spool import Spool

    Spool.open(tmp_path / "mx").close()
    env = {k: v for k, v in os.environ.items() if k != "JAVA_HOME"}
    env["PATH"] = os.path.dirname(sys.executable)  # the interpreter's, with no java in it
    proc = subprocess.run(
        [sys.executable, "-m", "spool.cli", "report", str(tmp_path / "mx"), "--out",
         str(tmp_path / "r")],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.splitlines()[-1] == (
        "spool: Spark needs Java 17 or later: install it (Debian: apt-get install "
        "openjdk-17-jre-headless) or set JAVA_HOME"
    )
    assert "Traceback" not in proc.stderr and not (tmp_path / "r").exists()
