"""Recovery against real files and real processes: suffix-only scans, kill -9, disk space."""

from __future__ import annotations

import itertools
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.framing import Frame
from spool.fs import FileSystem
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.recovery import DECISIONS, Decision, decide
from spool.testing import deliver_all
from tests.integration.children import LOAD_OPTIONS

ROOT = Path(__file__).resolve().parents[2]


def run_child(*args: str, timeout: float = 120) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.integration.children", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_decision_table_has_exactly_one_row_for_every_combination_of_facts() -> None:
    for facts in itertools.product([False, True], repeat=4):
        assert decide(*facts) is not None  # decide asserts that exactly one row matches
    labels = {decide(*facts).label for facts in itertools.product([False, True], repeat=4)}
    assert labels == {c.label for c in DECISIONS}, "a row no combination reaches"
    assert all(c.decision is Decision.SETTLED for c in DECISIONS if c.settled)
    lost = [decide(False, True, *rest) for rest in itertools.product([False, True], repeat=2)]
    assert {c.decision for c in lost} == {Decision.FINISH_LOST}


def test_reopen_scans_only_the_working_suffix(spool_dir: str) -> None:
    run_child("fill", spool_dir, "3000", "5")
    with Spool.open(spool_dir) as sp:
        r = sp.recovery
        assert r.positions_used and r.working_found == 5 and r.replacements_written == 5
        # 3000 envelopes + 3000 bodies precede the 5 start records; none is rescanned.
        assert r.records_scanned <= 10, r
        assert len(list(sp.list())) == 3000
        handed_out = set()
        while (attempt := sp.claim()) is not None:
            handed_out.add(attempt.msg_id)
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
        assert len(handed_out) == 2995  # the 5 recovered ones were deferred to class 1


def test_lost_positions_mean_a_full_scan_with_the_same_result(spool_dir: str) -> None:
    run_child("fill", spool_dir, "300", "5")
    os.unlink(os.path.join(spool_dir, fmt.POSITIONS_NAME))
    with Spool.open(spool_dir) as sp:
        r = sp.recovery
        assert not r.positions_used and r.working_found == 5
        assert r.records_scanned > 600
        assert len(list(sp.list())) == 300
        assert sum(1 for _ in iter(sp.claim, None)) == 295


def test_damaged_positions_file_is_ignored_not_fatal(spool_dir: str) -> None:
    run_child("fill", spool_dir, "50", "2")
    path = Path(spool_dir, fmt.POSITIONS_NAME)
    path.write_bytes(path.read_bytes().replace(b"cursors", b"cursorz"))
    with Spool.open(spool_dir) as sp:
        assert not sp.recovery.positions_used and sp.recovery.working_found == 2


def test_a_message_that_crashes_the_process_k_times_is_held(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        poison = sp.accept("a@example.org", ["victim@example.net"], b"poison")
    for crash in range(1, 4):
        assert run_child("crash-on", spool_dir) == poison
        with Spool.open(spool_dir) as sp:
            assert sp.recovery.working_found == 1
            entry = next(iter(sp.list()))
            if crash < 3:
                assert entry.held is None
            else:
                assert sp.recovery.held_for_crash_loop == 1
                assert entry.held is not None and "crash loop" in entry.held
        time.sleep(0.01)
    with Spool.open(spool_dir, retry_intervals=[0.001]) as sp:
        time.sleep(0.01)
        assert sp.claim() is None  # held: not attempted again
        sp.release(poison)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == poison
        attempt.close()


def test_segments_are_deleted_as_messages_finish(spool_dir: str) -> None:
    with Spool.open(spool_dir, segment_size=32 * 1024) as sp:
        for i in range(2000):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 1000)
        log_dir = os.path.join(spool_dir, fmt.LOG_DIR)
        assert len(os.listdir(log_dir)) > 50
        deliver_all(sp)
        sp.checkpoint()
        sp.checkpoint()
        assert len(os.listdir(log_dir)) <= 2
        used = sum(f.stat().st_size for f in Path(spool_dir).rglob("*") if f.is_file())
        assert used < 64 * 1024, used


def test_an_open_that_writes_nothing_still_frees_the_segments_left_behind(
    spool_dir: str,
) -> None:
    # Before: a checkpoint in an open that had appended nothing was skipped ("the
    # positions on disk still describe the log"), although the runners and the outcome
    # reader had moved on: segments of finished mail written after the last positions'
    # front (here, outcome acknowledgements) stayed on disk for every later quiet open.
    log_dir = os.path.join(spool_dir, fmt.LOG_DIR)
    with Spool.open(spool_dir, segment_size=4 * 1024, outcomes=True) as sp:
        for i in range(200):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 100)
        deliver_all(sp)
        while (outcome := sp.next_outcome(timeout=0)) is not None:
            sp.ack_outcome(outcome.msg_id)  # a frame each, after the cursors
    left = len(os.listdir(log_dir))
    assert left > 10
    with Spool.open(spool_dir) as sp:
        assert sp.claim(timeout=0) is None  # the runners walk to the head
        assert sp.next_outcome(timeout=0) is None  # so does the outcome reader
        sp.checkpoint()
        assert len(os.listdir(log_dir)) <= 2, f"{left} segments before"
    with Spool.open(spool_dir):
        pass  # and a quiet open of a quiet spool writes nothing
    assert len(os.listdir(log_dir)) <= 2


def test_a_quiet_open_finishes_a_segment_deletion_a_crash_cut_short(spool_dir: str) -> None:
    # Before: the leftovers of an interrupted deletion were left to "the next checkpoint",
    # which an open that appended nothing skipped: they stayed for every quiet open.
    log_dir = Path(spool_dir, fmt.LOG_DIR)
    with Spool.open(spool_dir, segment_size=4 * 1024) as sp:
        for i in range(100):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 100)
        kept = {p.name: p.read_bytes() for p in log_dir.iterdir()}
        deliver_all(sp)
    retired = sorted(set(kept) - {p.name for p in log_dir.iterdir()})
    assert len(retired) > 5
    for name in retired[::2]:  # the crash kept every other unlink
        (log_dir / name).write_bytes(kept[name])
    with Spool.open(spool_dir):
        pass
    assert not set(retired) & {p.name for p in log_dir.iterdir()}


def test_body_files_are_removed_once_their_message_finishes(spool_dir: str) -> None:
    with Spool.open(spool_dir, inline_body_max=1000) as sp:
        msg_id = sp.accept("a@example.org", ["b@example.net"], b"y" * 5000)
        staged, body = (
            Path(spool_dir, fmt.INCOMING_DIR, msg_id),
            Path(spool_dir, fmt.BODY_DIR, msg_id),
        )
        assert staged.exists()
        sp.checkpoint()  # its envelope is durable: the file moves to bodies/
        assert body.exists() and not staged.exists()
        attempt = sp.claim()
        assert attempt is not None
        attempt.delivered(["b@example.net"], "250 ok")
        attempt.close()
        sp.checkpoint()
        assert not body.exists()


def test_a_body_file_that_finishes_before_a_checkpoint_never_moves(spool_dir: str) -> None:
    with Spool.open(spool_dir, inline_body_max=1000) as sp:
        sp.accept("a@example.org", ["b@example.net"], b"y" * 5000)
        attempt = sp.claim()
        assert attempt is not None
        attempt.delivered(["b@example.net"], "250 ok")
        attempt.close()
        sp.checkpoint()
    assert os.listdir(Path(spool_dir, fmt.INCOMING_DIR)) == []
    assert os.listdir(Path(spool_dir, fmt.BODY_DIR)) == []


def test_archive_dir_receives_retired_segments(tmp_path: Path) -> None:
    spool_dir, archive = str(tmp_path / "spool"), tmp_path / "archive"
    with Spool.open(spool_dir, segment_size=16 * 1024, archive_dir=archive) as sp:
        for i in range(300):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"z" * 500)
        deliver_all(sp)
        sp.checkpoint()
    archived = sorted(os.listdir(archive))
    assert len(archived) >= 5 and all(fmt.parse_segment_name(n) for n in archived)
    envelopes = sum(1 for _, r in all_records([str(archive)]) if isinstance(r, rec.Envelope))
    assert envelopes >= 100


def all_records(dirs: list[str]) -> list[tuple[Position, rec.Record]]:
    """Every record in the segment files of ``dirs`` (archive first, then the log)."""
    out = []
    fs = FileSystem()
    for d in dirs:
        if not os.path.isdir(d):
            continue
        for seg in list_segments(fs, d):
            cursor = LogCursor(fs, d, Position(seg, 0), newest_segment=seg, skip_bodies=True)
            for pos, frame in cursor:
                if isinstance(frame, Frame) and frame.type not in (fmt.T_BODY, fmt.T_PAD):
                    out.append((pos, rec.decode(frame.type, frame.payload)))
                if cursor.position.segment != seg:
                    break
            cursor.close()
    return out


def read_acks(path: Path) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    accepted: dict[str, set[str]] = {}
    settled: set[tuple[str, str]] = set()
    for line in path.read_text().splitlines():
        parts = line.split(" ")
        if len(parts) != 3:
            continue  # the kill cut this line short; its call had returned, so check less
        kind, msg_id, rest = parts
        if kind == "A":
            accepted[msg_id] = set(rest.split(","))
        else:
            settled.add((msg_id, rest))
    return accepted, settled


@pytest.mark.slow
def test_kill_minus_nine_under_load_loses_and_repeats_nothing(tmp_path: Path) -> None:
    """Goal: contract items 2 and 3 across SIGKILLs of a loaded owner process.

    Method: a child accepts and delivers flat out, logging each acknowledgement after the
    call returned; the parent kills it at random moments, reopens (recovery), and checks
    every acknowledgement against the log and the live queue. Finally it drains the queue
    and checks that no recipient acknowledged as delivered or failed is handed out.
    """
    spool_dir, archive, acks = tmp_path / "spool", tmp_path / "archive", tmp_path / "acks"
    rng = random.Random(7)
    kills = int(os.environ.get("SPOOL_KILLS", "12"))
    for _ in range(kills):
        child = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.integration.children",
                "load",
                str(spool_dir),
                str(acks),
                str(archive),
            ],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert child.stdout is not None and child.stdout.readline().strip() == "running"
        time.sleep(rng.uniform(0.05, 0.5))
        child.send_signal(signal.SIGKILL)
        child.wait()
        with Spool.open(spool_dir, archive_dir=archive, **LOAD_OPTIONS) as sp:
            assert sp.recovery.positions_used
            live = {e.msg_id: set(e.recipients) for e in sp.list()}
        check_against_acks(acks, [str(archive), str(spool_dir / fmt.LOG_DIR)], live)
    later = lambda: time.time() + 10_000  # noqa: E731 - every deferred recipient is due
    options = {**LOAD_OPTIONS, "max_lifetime": 1e9}
    with Spool.open(spool_dir, archive_dir=archive, clock=later, **options) as sp:
        handed: list[tuple[str, str]] = []
        while (attempt := sp.claim()) is not None:
            handed += [(attempt.msg_id, r) for r in attempt.envelope.recipients]
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
    accepted, settled = read_acks(acks)
    assert len(handed) == len(set(handed))
    assert not settled & set(handed), "an acknowledged delivery was attempted again"
    assert accepted, "the child acknowledged nothing"


def check_against_acks(acks: Path, dirs: list[str], live: dict[str, set[str]]) -> None:
    accepted, settled = read_acks(acks)
    logged: set[tuple[str, str]] = set()
    for _, record in all_records(dirs):
        if isinstance(record, rec.Delta) and record.status != rec.DEFERRED:
            logged.update((record.msg_id, r) for r in record.recipients)
    for msg_id, rcpts in accepted.items():
        for r in rcpts:
            places = ((msg_id, r) in logged) + (r in live.get(msg_id, set()))
            assert places == 1, f"{msg_id} {r}: in {places} places (lost or duplicated)"
    for msg_id, r in settled:
        assert (msg_id, r) in logged, f"acknowledged {msg_id} {r} is not in the log"
        assert r not in live.get(msg_id, set()), f"acknowledged {msg_id} {r} is queued again"
