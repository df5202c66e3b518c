"""Regression tests for bugs the contract tests found, one test per fix in ``spool/``.

Goal: keep each fixed bug fixed. Method: reproduce the exact interleaving that exposed it,
deterministically, through the file-system seam.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.errors import CorruptSpool
from spool.fs import FileSystem
from spool.options import DEFAULT_RETRY_INTERVALS
from spool.queue_view import history, live_messages
from spool.reader import list_segments
from spool.testing import deliver_all


class KeepSegments(FileSystem):
    """Never deletes segment files, so retired segments stay on disk for the walk."""

    def unlink(self, path: str) -> None:
        if not path.endswith(fmt.SEGMENT_SUFFIX):
            super().unlink(path)


class CollectDuringWalk(FileSystem):
    """Deletes every segment but the newest right after the walk opens the oldest one,
    as a running owner's checkpoint does when the garbage front passes them."""

    def __init__(self, log_dir: str) -> None:
        self.log_dir = log_dir
        self.collected = 0

    def open(self, path: str, flags: int, mode: int = 0o600) -> int:
        fd = super().open(path, flags, mode)
        segments = list_segments(self, self.log_dir)
        if path.endswith(fmt.SEGMENT_SUFFIX) and len(segments) > 1 and not self.collected:
            for seg in segments[:-1]:
                os.unlink(os.path.join(self.log_dir, fmt.segment_name(seg)))
                self.collected += 1
        return fd


def test_listing_overtaken_by_segment_deletion_shows_the_true_queue(tmp_path: Path) -> None:
    spool_dir = str(tmp_path / "spool")
    with Spool.open(spool_dir, segment_size=4096, fs=KeepSegments()) as sp:
        done = [sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 900) for i in range(12)]
        deliver_all(sp)
        sp.checkpoint()
        sp.checkpoint()
        alive = sp.accept("a@example.org", ["last@example.net"], b"y" * 100)
    log_dir = os.path.join(spool_dir, fmt.LOG_DIR)
    assert len(list_segments(FileSystem(), log_dir)) > 3
    racing = CollectDuringWalk(log_dir)
    live = live_messages(racing, spool_dir, (0.0, 300.0))
    assert racing.collected > 0
    assert set(live) == {alive}, f"finished messages listed: {set(live) & set(done)}"
    assert [type(r).__name__ for _, r in history(FileSystem(), spool_dir, alive)] == ["Envelope"]


# --- found by review of the idle-class skip and of recovery -------------------------------


def test_a_damaged_durable_frame_stops_a_runner_with_corruption_instead_of_a_skip(
    tmp_path: Path,
) -> None:
    # Before: a runner took a bad frame in the durable log for a torn tail, believed it
    # had reached the end, and then skipped its class to the head, past a live envelope.
    from spool.queue_view import walk
    from spool.records import Start
    from spool.testing import FakeClock

    clock = FakeClock()
    root = str(tmp_path / "spool")
    options = {"segment_size": 600, "retry_intervals": (60.0,), "clock": clock}
    with Spool.open(root, **options) as sp:  # type: ignore[arg-type]
        sp.accept("a@example.org", ["b@example.net"], b"x" * 40)
        attempt = sp.claim()
        assert attempt is not None
        attempt.deferred(["b@example.net"], "451 later")
        attempt.close()
    start = next(pos for pos, r, _ in walk(FileSystem(), root) if isinstance(r, Start))
    path = os.path.join(root, fmt.LOG_DIR, fmt.segment_name(start.segment))
    with open(path, "r+b") as f:
        f.seek(start.offset + 12)
        byte = f.read(1)
        f.seek(start.offset + 12)
        f.write(bytes([byte[0] ^ 0x40]))
    clock.advance(120)
    with Spool.open(root, **options) as sp:  # type: ignore[arg-type]
        with pytest.raises(CorruptSpool) as raised:  # not: the deferred message skipped
            for _ in range(3):
                sp.claim()
        assert raised.value.path == path


def test_a_full_scan_after_deletions_does_not_pin_segments_for_ever(tmp_path: Path) -> None:
    # Before: a scan without usable positions replayed finishes of bodies whose segments
    # were long deleted, left negative pins, and the garbage front never moved again.
    root = str(tmp_path / "spool")

    def traffic(sp: Spool) -> None:
        for i in range(8):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 3000)
        deliver_all(sp)
        sp.checkpoint()

    with Spool.open(root, segment_size=4096, retry_intervals=(60.0, 120.0)) as sp:
        traffic(sp)
    # Another number of retry classes makes the positions unusable: a full scan.
    with Spool.open(root, segment_size=4096, retry_intervals=(60.0, 120.0, 180.0)) as sp:
        assert not sp.recovery.positions_used
        traffic(sp)
        traffic(sp)
        assert sp.statistics().segments <= 2


def test_offline_listing_skips_the_leftovers_of_an_interrupted_deletion(tmp_path: Path) -> None:
    # Before: the walk started at a retired leftover and stopped at the gap after it, so
    # an operator listing a crashed spool saw an empty queue.
    root = str(tmp_path / "spool")
    log_dir = os.path.join(root, fmt.LOG_DIR)
    with Spool.open(root, segment_size=4096) as sp:
        for i in range(6):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 3000)
        sp.checkpoint()
        first = list_segments(FileSystem(), log_dir)[0]
        with open(os.path.join(log_dir, fmt.segment_name(first)), "rb") as f:
            leftover = f.read()
        while (attempt := sp.claim()) is not None:
            if attempt.envelope.recipients[0] < "r4":
                attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
        sp.checkpoint()
        live = {e.msg_id for e in sp.list()}
    segments = list_segments(FileSystem(), log_dir)
    assert segments[0] > first + 1, "the test needs a deletion that leaves a gap"
    with open(os.path.join(log_dir, fmt.segment_name(first)), "wb") as f:
        f.write(leftover)  # as if the crash kept this one unlink undone
    intervals = (0.0, *DEFAULT_RETRY_INTERVALS)
    assert set(live_messages(FileSystem(), root, intervals)) == live
