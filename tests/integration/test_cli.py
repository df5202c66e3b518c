"""The operator CLI: every command through click's runner, and the real installed command
on a spool with traffic, one killed mid-write, one with a flipped byte, and a locked one."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from spool import CorruptSpool, Spool
from spool import format as fmt
from spool.check import check_spool, only_certain
from spool.cli import disk_use, main
from spool.fs import FileSystem
from spool.testing import tree_snapshot
from tests.integration.children import LOAD_OPTIONS

ROOT = Path(__file__).resolve().parents[2]
SPOOL_CMD = shutil.which("spool", path=os.path.dirname(sys.executable)) or "spool"


def run(*args: str, input: bytes | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(main, list(args), input=input)
    return result.exit_code, result.output


def run_bytes(*args: str) -> tuple[int, bytes]:
    result = CliRunner().invoke(main, list(args))
    return result.exit_code, result.stdout_bytes


@pytest.fixture
def traffic(spool_dir: str) -> dict[str, str]:
    """A spool with a delivered, a deferred, a held and a fresh message."""
    with Spool.open(spool_dir, retry_intervals=[600]) as sp:
        ids = {
            name: sp.accept(
                "alice@example.org",
                [f"{name}@example.net", "x@other.example"],
                f"Subject: {name}\r\n\r\nbody of {name}\r\n".encode(),
            )
            for name in ("done", "later", "held", "fresh")
        }
        for _ in range(3):
            attempt = sp.claim()
            assert attempt is not None
            with attempt:
                if attempt.msg_id == ids["done"]:
                    attempt.delivered(attempt.envelope.recipients, "250 ok")
                else:
                    attempt.deferred(attempt.envelope.recipients, "451 4.7.1 try later")
        sp.hold(ids["held"])
    return ids


def test_every_command_has_help_with_an_example() -> None:
    for cmd in main.commands:
        code, out = run(cmd, "--help")
        assert code == 0 and "Example" in out, cmd


def test_list_shows_the_queue_with_filters_and_a_summary(
    spool_dir: str, traffic: dict[str, str]
) -> None:
    code, out = run("list", spool_dir)
    assert code == 0
    for name in ("later", "held", "fresh"):
        assert traffic[name] in out
    assert traffic["done"] not in out
    assert "-- 3 messages, 6 recipients" in out
    code, out = run("list", spool_dir, "--held")
    assert traffic["held"] in out and traffic["later"] not in out
    code, out = run("list", spool_dir, "--recipient", "fresh@")
    assert "-- 1 message," in out and traffic["fresh"] in out
    assert run("list", spool_dir, "--older-than", "1h")[1].startswith("-- 0 messages")
    code, out = run("list", spool_dir, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert {r["queue_id"] for r in rows} == {traffic[n] for n in ("later", "held", "fresh")}
    assert run("list", spool_dir, "--older-than", "soon")[0] == 2


def test_show_prints_history_and_data(spool_dir: str, traffic: dict[str, str]) -> None:
    code, out = run("show", spool_dir, traffic["later"])
    assert code == 0 and "start" in out and "deferred" in out and "replacement" in out
    code, data = run_bytes("show", spool_dir, traffic["later"], "--data")
    assert code == 0 and data == b"Subject: later\r\n\r\nbody of later\r\n"
    code, out = run("show", spool_dir, traffic["done"], "--json")
    types = [r["type"] for r in json.loads(out)["records"]]
    assert types == ["envelope", "start", "delta", "finish"]
    code, out = run("show", spool_dir, "FFFFFFFFFFFFFFFF")
    assert code == 1 and "no message" in out


def test_stats_counts_states_domains_and_disk(spool_dir: str, traffic: dict[str, str]) -> None:
    code, out = run("stats", spool_dir)
    assert code == 0 and "qshape" in out and "other.example" in out
    code, out = run("stats", spool_dir, "--json")
    data = json.loads(out)
    assert data["messages"] == 3 and data["by_state"]["held"] == 1
    # Held mail is counted apart from the age table (it waits for the operator).
    assert data["qshape"]["domains"]["other.example"][0] == 2
    assert data["held"] == {"messages": 1, "recipients": 2}
    assert data["disk_bytes"]["log"] > 0 and data["positions"]["garbage_front"]


def test_dump_prints_records_from_a_position(spool_dir: str, traffic: dict[str, str]) -> None:
    code, out = run("dump", spool_dir, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert code == 0 and {r["type"] for r in rows} >= {"envelope", "body", "start", "delta"}
    code, out = run("dump", spool_dir, "--from", rows[3]["at"], "--limit", "2", "--json")
    assert [json.loads(line)["at"] for line in out.splitlines()] == [r["at"] for r in rows[3:5]]
    assert run("dump", spool_dir, "--segment", "1")[0] == 0


def test_operator_commands_change_the_queue(spool_dir: str, traffic: dict[str, str]) -> None:
    assert run("release", spool_dir, traffic["held"])[0] == 0
    code, out = run("release", spool_dir, traffic["held"])
    assert code == 0 and f"{traffic['held']}: unchanged, not held" in out
    assert run("hold", spool_dir, traffic["fresh"])[0] == 0
    code, out = run("retry", spool_dir, "--all")
    assert code == 0 and "1 message due now" in out
    assert run("delete", spool_dir, traffic["later"])[0] == 0
    code, out = run("delete", spool_dir, "FFFFFFFFFFFFFFFF")
    assert code == 1 and "no message FFFFFFFFFFFFFFFF in the spool" in out
    assert run("retry", spool_dir)[0] == 2
    rows = [json.loads(line) for line in run("list", spool_dir, "--json")[1].splitlines()]
    # held was released (due now, one attempt behind it), fresh is held now.
    assert {r["queue_id"]: r["queue_name"] for r in rows} == {
        traffic["held"]: "deferred",
        traffic["fresh"]: "held",
    }


def test_accept_and_checkpoint(spool_dir: str) -> None:
    code, out = run(
        "accept",
        spool_dir,
        "-f",
        "a@example.org",
        "b@example.net",
        input=b"Subject: x\r\n\r\nhi\r\n",
    )
    assert code == 0 and len(out.strip()) == fmt.MSG_ID_LENGTH
    code, out = run("accept", spool_dir, "-f", "a@example.org", "not an address", input=b"x")
    assert code == 1 and "invalid address" in out
    code, out = run("checkpoint", spool_dir)
    # The accept's close wrote them; nothing happened since.
    assert code == 0 and "positions current" in out
    code, out = run("list", spool_dir, "--json")
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["recipients"] for r in rows] == [[{"address": "b@example.net", "delay_reason": None}]]


def test_check_is_clean_on_a_healthy_spool_and_recover_reports(
    spool_dir: str, traffic: dict[str, str]
) -> None:
    code, out = run("check", spool_dir)
    assert code == 0 and out.startswith("clean")
    before = tree_snapshot(spool_dir)
    code, out = run("recover", spool_dir, "--dry-run", "--json")
    assert code == 0 and json.loads(out)["dry_run"] is True
    assert tree_snapshot(spool_dir) == before
    code, out = run("recover", spool_dir)
    assert code == 0 and "restart positions: used" in out


def test_not_a_spool_is_one_line_and_exit_1(tmp_path: Path) -> None:
    code, out = run("list", str(tmp_path))
    assert code == 1 and out.count("\n") == 1 and "not a spool" in out


# --- the real command, in real processes --------------------------------------------


def spool_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([SPOOL_CMD, *args], capture_output=True, text=True, timeout=timeout)


def test_installed_command_on_a_spool_with_real_traffic(
    spool_dir: str, traffic: dict[str, str]
) -> None:
    proc = spool_cmd("list", spool_dir)
    assert proc.returncode == 0 and "-- 3 messages" in proc.stdout
    assert spool_cmd("check", spool_dir).returncode == 0


def test_installed_command_on_a_spool_killed_mid_write(tmp_path: Path) -> None:
    spool_dir, archive = tmp_path / "spool", tmp_path / "archive"
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.children",
            "load",
            str(spool_dir),
            str(tmp_path / "acks"),
            str(archive),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout is not None and child.stdout.readline().strip() == "running"
    time.sleep(0.4)
    child.send_signal(signal.SIGKILL)
    child.wait()
    assert spool_cmd("check", str(spool_dir)).returncode == 0
    proc = spool_cmd("recover", str(spool_dir), "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["positions_used"] is True
    proc = spool_cmd("list", str(spool_dir), "--json")
    assert proc.returncode == 0
    with Spool.open(spool_dir, archive_dir=archive, **LOAD_OPTIONS) as sp:
        assert len(list(sp.list())) == len(proc.stdout.splitlines())


def test_installed_command_on_a_spool_with_a_flipped_byte(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        ids = [sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 300) for i in range(20)]
    records = [json.loads(line) for line in run("dump", spool_dir, "--json")[1].splitlines()]
    envelopes = [r for r in records if r["type"] == "envelope"]
    middle = envelopes[len(envelopes) // 2]  # flip a bit inside an envelope's payload
    seg = Path(spool_dir, fmt.LOG_DIR, fmt.segment_name(1))
    data = bytearray(seg.read_bytes())
    data[int(middle["at"].split(":")[1]) + 20] ^= 0x10
    seg.write_bytes(bytes(data))
    proc = spool_cmd("check", spool_dir)
    assert proc.returncode == 1 and fmt.segment_name(1) in proc.stdout
    assert "offset" in proc.stdout
    # Opening reads only the working suffix; the runner that reaches the damage reports it.
    claimer = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from spool import Spool\nwith Spool.open({spool_dir!r}) as sp:\n"
            "    while (a := sp.claim()) is not None: a.close()",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "CorruptSpool" in claimer.stderr and fmt.segment_name(1) in claimer.stderr
    proc = spool_cmd("list", spool_dir)
    assert proc.returncode == 1 and "corrupt spool file" in proc.stderr
    assert proc.stderr.count("\n") == 1  # one line, no traceback
    proc = spool_cmd("check", "--repair", spool_dir)
    # One flipped bit explains the damage: the record is set right in place (a copy of the
    # segment as it was stays in corrupt/); no mail was affected, so the status is 0.
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "one flipped bit in the envelope record" in proc.stdout
    assert "repaired: copied" in proc.stdout and "after repair: clean" in proc.stdout
    quarantined = os.listdir(Path(spool_dir, fmt.CORRUPT_DIR))
    assert any(name.startswith(fmt.segment_name(1)) for name in quarantined)
    assert spool_cmd("check", spool_dir).returncode == 0
    with Spool.open(spool_dir) as sp:
        entries = list(sp.list())
    assert {e.msg_id for e in entries} == set(ids) and not any(e.held for e in entries)


def test_installed_command_on_a_locked_spool(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        sp.accept("a@example.org", ["b@example.net"], b"x")
        sp.sync()
        proc = spool_cmd("hold", spool_dir, "0000000000000000")
        assert proc.returncode == 1 and f"process {os.getpid()}" in proc.stderr
        assert "Traceback" not in proc.stderr
        assert spool_cmd("recover", "--dry-run", spool_dir).returncode == 1
        proc = spool_cmd("list", spool_dir)  # read-only: works beside the owner
        assert proc.returncode == 0 and "-- 1 message," in proc.stdout
        assert spool_cmd("check", spool_dir).returncode == 0


def test_check_beside_a_busy_owner_reports_no_false_errors(tmp_path: Path) -> None:
    # Before: it read the positions and bodies/ after walking the log, and reported
    # "restart positions point past the end of the log", "body file of a live message is
    # missing" and false orphans, exiting 1, while nothing was wrong.
    root = tmp_path / "spool"
    owner = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tests.integration.children",
            "load",
            str(root),
            str(tmp_path / "acks"),
            str(tmp_path / "archive"),
            "1000",
        ],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "running"
        time.sleep(0.5)
        for _ in range(5):
            out = spool_cmd("check", str(root))
            assert out.returncode == 0, out.stdout + out.stderr
            assert "error:" not in out.stdout
    finally:
        owner.kill()
        owner.wait()
    # Stopped, the same spool checks with certainty: no uncertain findings left.
    out = spool_cmd("check", str(root))
    assert "uncertain" not in out.stdout and "changed under" not in out.stdout


def test_damage_in_the_durable_log_stays_certain_beside_a_running_owner(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        for i in range(20):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 300)
    records = [json.loads(line) for line in run("dump", spool_dir, "--json")[1].splitlines()]
    middle = [r for r in records if r["type"] == "envelope"][10]
    seg = Path(spool_dir, fmt.LOG_DIR, fmt.segment_name(1))
    data = bytearray(seg.read_bytes())
    data[int(middle["at"].split(":")[1]) + 20] ^= 0xFF  # eight bits: no correction
    seg.write_bytes(bytes(data))
    Path(spool_dir, "bodies", "6B00000000000000").write_bytes(b"orphan")
    # As a check that never saw the spool stand still would classify its findings.
    report = only_certain(check_spool(spool_dir), spool_dir)
    assert report.changing and not report.clean
    assert {Path(p.path).name for p in report.problems} == {fmt.segment_name(1)}
    assert report.orphan_bodies == ()


class PreemptedFS(FileSystem):
    """Delays that model thread preemption at the worst moments: the writer between
    creating a segment and writing its header, a reader right after reading it empty."""

    def pwrite(self, fd: int, data: bytes, offset: int) -> None:
        if offset == 0:
            time.sleep(0.005)
        super().pwrite(fd, data, offset)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = super().pread(fd, size, offset)
        if offset == 0 and size == fmt.SEGMENT_HEADER_SIZE and len(data) < size:
            time.sleep(0.02)
        return data


def test_a_list_racing_the_creation_of_a_segment_is_not_corruption(tmp_path: Path) -> None:
    # Before: the header of a segment created a moment before read empty, the file had grown
    # by the time its size was asked, and list() raised CorruptSpool on a healthy spool.
    sp = Spool.open(tmp_path / "spool", segment_size=512, fs=PreemptedFS())
    stop = time.monotonic() + 3
    errors: list[Exception] = []

    def accept() -> None:
        while time.monotonic() < stop and not errors:
            sp.accept("a@example.org", ["b@example.net"], b"x" * 100)

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        while time.monotonic() < stop and not errors:
            try:
                list(sp.list())
            except CorruptSpool as exc:
                errors.append(exc)
    finally:
        thread.join()
        sp.close()
    assert errors == []


def test_a_segment_missing_from_the_middle_is_certain_beside_a_running_owner(
    spool_dir: str,
) -> None:
    with Spool.open(spool_dir, segment_size=512) as sp:
        for i in range(40):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 100)
    segments = sorted(os.listdir(Path(spool_dir, fmt.LOG_DIR)))
    assert len(segments) > 4
    Path(spool_dir, fmt.LOG_DIR, segments[2]).unlink()  # a gap, not the front
    report = only_certain(check_spool(spool_dir), spool_dir)
    assert any(p.what == "segment missing" for p in report.problems)
    Path(spool_dir, fmt.LOG_DIR, segments[0]).unlink()  # the front: collected by the owner
    report = only_certain(check_spool(spool_dir), spool_dir)
    assert {Path(p.path).name for p in report.problems if p.what == "segment missing"} == {
        segments[2]
    }


def test_disk_use_counts_body_files_not_yet_moved_out_of_incoming(spool_dir: str) -> None:
    # A body file stays in incoming/ until a checkpoint covers its envelope: it is a body
    # file all the same, and `stats` must count it.
    with Spool.open(spool_dir, inline_body_max=100, checkpoint_interval=1e9) as sp:
        sp.accept("a@example.org", ["b@example.net"], b"x" * 5000)
        assert os.listdir(os.path.join(spool_dir, "incoming"))
        assert disk_use(spool_dir)["bodies"] >= 5000


@pytest.mark.parametrize("command", ["dump", "list"])
def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path: Path, command: str) -> None:
    # `spool dump DIR | head`: before, "spool: [Errno 32] Broken pipe" and exit 1.
    root = tmp_path / "spool"
    with Spool.open(root) as sp:
        for n in range(1500):
            sp.accept("alice@example.org", [f"r{n}@example.net"], b"hello %d" % n)
    proc = subprocess.Popen(
        [sys.executable, "-m", "spool.cli", command, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.readline()
    proc.stdout.close()  # as `head -1` does
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 141 and err == b""
