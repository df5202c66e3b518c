"""Regression tests for bugs the contract tests found, one test per fix in ``spool/``.

Goal: keep each fixed bug fixed. Method: reproduce the exact interleaving that exposed it,
deterministically, through the file-system seam.
"""

from __future__ import annotations

import os
from pathlib import Path

from spool import Spool
from spool import format as fmt
from spool.fs import FileSystem
from spool.queue_view import history, live_messages
from spool.reader import list_segments


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
        while (attempt := sp.claim()) is not None:
            with attempt:
                attempt.delivered(attempt.envelope.recipients, "250 ok")
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
