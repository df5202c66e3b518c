"""A full disk refuses new mail in time, keeps deliveries going, and never wedges the spool.

Goal: on a 3 MiB file system with ``min_free_bytes`` at 1 MiB, a burst of 20 KB accepts is
refused with ``DiskFull`` before the threshold, whatever the rate (before, a free-space
look cached for a quarter second let the burst run into ENOSPC, the writer failed stop and
deliveries stopped); every accepted message is then delivered in the reserve; ``close``
releases the lock and the spool opens again in the same process. On a real tmpfs where
the test can mount one (as root), otherwise on ``SmallDiskFS`` (real files whose sizes
count against a capacity).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from spool import DiskFull, Spool, SpoolFailed
from spool.fs import FileSystem
from spool.options import SpoolOptions
from spool.testing import FakeClock, SmallDiskFS, deliver_all

MIB = 1024 * 1024
CAPACITY = 3 * MIB
DATA = b"Subject: burst\r\n\r\n" + b"z" * 20_000 + b"\r\n"
OPTIONS = {
    "min_free_bytes": MIB,
    "max_message_size": 256 * 1024,
    "segment_size": 256 * 1024,
    "checkpoint_interval": 10**6,
}


def fill(path: Path, fs: FileSystem) -> None:
    """Another program takes every byte left on the disk (the reserve included)."""
    if isinstance(fs, SmallDiskFS):
        path.write_bytes(b"\0" * 4096)
        fs.capacity = fs.used()
        return
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        with contextlib.suppress(OSError):
            while os.write(fd, b"\0" * 4096):
                pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def small_disk(base: Path, kind: str) -> Iterator[tuple[Path, FileSystem]]:
    """A 3 MiB file system: a real tmpfs (skipped where it cannot be mounted), or
    ``SmallDiskFS``."""
    mount = base / "disk"
    mount.mkdir()
    if kind == "model":
        yield mount, SmallDiskFS(str(mount), CAPACITY)
        return
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={CAPACITY}", "tmpfs", str(mount)],
        capture_output=True,
    )
    if made.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root); the model variant runs")
    try:
        yield mount, FileSystem()
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


@pytest.mark.parametrize("kind", ["tmpfs", "model"])
@pytest.mark.parametrize("size", [len(DATA), 1025])
def test_a_burst_is_refused_before_the_disk_fills_and_deliveries_go_on(
    tmp_path: Path, kind: str, size: int
) -> None:
    # 1025 bytes: one over inline_body_max, so each body is a file that takes whole
    # blocks on disk (before, only its bytes were counted and the burst reached ENOSPC).
    data = DATA[:size]
    with small_disk(tmp_path, kind) as (disk, fs):
        root = disk / "spool"
        sp = Spool.open(root, fs=fs, inline_body_max=1024, **OPTIONS)  # type: ignore[arg-type]
        accepted = []
        with pytest.raises(DiskFull, match="452"):
            for _ in range(CAPACITY // len(data) + 10):  # a tight loop: no time passes
                accepted.append(sp.accept("from@example.org", ["to@example.net"], data))
        assert len(accepted) >= (CAPACITY - 2 * MIB) // (len(data) + 4096) // 2
        assert fs.free_bytes(str(root)) >= MIB // 2  # the reserve is still there
        # Deliveries and their records go on in the reserve.
        assert sorted(deliver_all(sp)) == sorted(accepted)
        sp.close()  # never raises, always unlocks
        with Spool.open(root, fs=fs, **OPTIONS) as again:  # type: ignore[arg-type]
            again.checkpoint()  # the delivered mail's segments go
            again.accept("from@example.org", ["to@example.net"], DATA)
            assert again.statistics().accepted == 1


def test_the_default_reserve_leaves_room_for_one_more_message_of_the_largest_size() -> None:
    assert SpoolOptions().min_free_bytes == SpoolOptions().max_message_size * 3 // 2
    assert SpoolOptions(max_message_size=10 * MIB).min_free_bytes == 15 * MIB
    assert SpoolOptions(min_free_bytes=0).min_free_bytes == 0


@pytest.mark.parametrize("kind", ["tmpfs", "model"])
def test_after_a_write_failed_close_unlocks_and_the_spool_opens_again(
    tmp_path: Path, kind: str
) -> None:
    with small_disk(tmp_path, kind) as (disk, fs):
        root = disk / "spool"
        # No zeros written ahead (writer W6): the delivery records must take new blocks,
        # so the full disk fails them (with zeros ahead they land in blocks the segment
        # holds already, and go on: test_zeros_ahead.py).
        sp = Spool.open(root, fs=fs, write_ahead=0, **OPTIONS)  # type: ignore[arg-type]
        ids = [sp.accept("from@example.org", ["to@example.net"], DATA) for _ in range(40)]
        # Another program takes every byte left, the reserve included.
        filler = disk / "filler"
        fill(filler, fs)
        delivered = []
        with pytest.raises(SpoolFailed, match="No space left"):
            while (attempt := sp.claim(timeout=0)) is not None:
                attempt.delivered(["to@example.net"], "250 ok")
                delivered.append(attempt.msg_id)
        sp.close()  # does not raise, releases the lock
        filler.unlink()
        if isinstance(fs, SmallDiskFS):
            fs.capacity = CAPACITY
        with Spool.open(root, fs=fs, **OPTIONS) as again:  # type: ignore[arg-type]
            # Every message not reported durably delivered is delivered now; none is lost.
            assert sorted(delivered + deliver_all(again)) == sorted(ids)


@pytest.mark.parametrize("kind", ["tmpfs", "model"])
def test_a_reopen_with_no_room_to_recover_raises_disk_full(tmp_path: Path, kind: str) -> None:
    with small_disk(tmp_path, kind) as (disk, fs):
        root = disk / "spool"
        child = (
            "import os\nfrom spool import Spool\n"
            # No zeros written ahead (writer W6): recovery would free their space first.
            f"sp = Spool.open({str(root)!r}, min_free_bytes=0, write_ahead=0)\n"
            "sp.accept('a@example.org', ['b@example.net'], b'hello')\n"
            "attempt = sp.claim(timeout=0)\n"  # in flight: recovery must write for it
            "sp.sync()\nos._exit(0)\n"
        )
        subprocess.run([sys.executable, "-c", child], check=True)
        filler = disk / "filler"
        fill(filler, fs)
        # Before: SpoolFailed, "close and reopen the spool to recover".
        with pytest.raises(DiskFull, match="free some space"):
            Spool.open(root, fs=fs, min_free_bytes=0)
        filler.unlink()
        if isinstance(fs, SmallDiskFS):
            fs.capacity = CAPACITY
        with Spool.open(root, fs=fs, min_free_bytes=0) as sp:
            sp.retry_now()  # recovery deferred the attempt the crash interrupted
            assert len(deliver_all(sp)) == 1


@pytest.mark.parametrize("kind", ["tmpfs", "model"])
def test_deferrals_at_the_threshold_do_not_eat_the_reserve(tmp_path: Path, kind: str) -> None:
    # Before: a deferral whose next attempt came late copied its inline body to a file
    # (promotion) uncounted; at the threshold the copies took the reserve, deliveries
    # failed with ENOSPC and every reopen failed.
    big = b"Subject: big\r\n\r\n" + b"b" * 200_000 + b"\r\n"
    with small_disk(tmp_path, kind) as (disk, fs):
        root = disk / "spool"
        options = {**OPTIONS, "retry_intervals": (60.0, 3600.0), "inline_body_max": 256 * 1024}
        clock = FakeClock()
        sp = Spool.open(root, fs=fs, clock=clock, **options)  # type: ignore[arg-type]
        accepted = []
        with pytest.raises(DiskFull):
            while True:
                accepted.append(sp.accept("from@example.org", ["to@example.net"], big))
        for _ in range(2):  # the second deferral is due after the longest interval: promoted
            while (attempt := sp.claim(timeout=0)) is not None:
                with attempt:
                    attempt.deferred(attempt.envelope.recipients, "451 try later")
            clock.advance(61)
        assert fs.free_bytes(str(root)) >= MIB // 2  # the reserve is still there
        sp.retry_now()
        assert sorted(deliver_all(sp)) == sorted(accepted)
        sp.close()
        with Spool.open(root, fs=fs, clock=clock, **options):  # type: ignore[arg-type]
            pass
