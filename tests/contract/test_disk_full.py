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
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from spool import DiskFull, Spool, SpoolFailed
from spool.fs import FileSystem
from spool.options import SpoolOptions
from spool.testing import SmallDiskFS, deliver_all

MIB = 1024 * 1024
CAPACITY = 3 * MIB
DATA = b"Subject: burst\r\n\r\n" + b"z" * 20_000 + b"\r\n"
OPTIONS = {
    "min_free_bytes": MIB,
    "max_message_size": 256 * 1024,
    "segment_size": 256 * 1024,
    "checkpoint_interval": 10**6,
}


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
def test_a_burst_is_refused_before_the_disk_fills_and_deliveries_go_on(
    tmp_path: Path, kind: str
) -> None:
    with small_disk(tmp_path, kind) as (disk, fs):
        root = disk / "spool"
        sp = Spool.open(root, fs=fs, **OPTIONS)  # type: ignore[arg-type]
        accepted = []
        with pytest.raises(DiskFull, match="452"):
            for _ in range(CAPACITY // len(DATA) + 10):  # a tight loop: no time passes
                accepted.append(sp.accept("from@example.org", ["to@example.net"], DATA))
        assert len(accepted) >= (CAPACITY - 2 * MIB) // len(DATA) // 2  # not refused early
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
        sp = Spool.open(root, fs=fs, **OPTIONS)  # type: ignore[arg-type]
        ids = [sp.accept("from@example.org", ["to@example.net"], DATA) for _ in range(40)]
        # Another program takes every byte left, the reserve included.
        filler = disk / "filler"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while f.write(b"\0" * 65536):
                f.flush()
                if isinstance(fs, SmallDiskFS) and fs.free_bytes(str(disk)) < 65536:
                    break
        if isinstance(fs, SmallDiskFS):
            fs.capacity = fs.used()
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
