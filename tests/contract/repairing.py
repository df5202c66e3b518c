"""What the tests of the adversarial reviews of ``check --repair`` share: the options,
the log's records, flipped bits, what a claim hands out a day later, a crashing child."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

from spool import Spool
from spool import format as fmt
from spool.fs import FileSystem
from spool.queue_view import walk
from spool.testing import FakeClock

ROOT = Path(__file__).resolve().parents[2]
T0 = 1_800_000_000.0
OPTS: dict[str, Any] = {
    "inline_body_max": 100,
    "retry_intervals": (60.0, 600.0),
    "max_lifetime": 10**7,
}


def records(root: Path) -> list[Any]:
    """(position, record, frame) of every frame of the log, bodies included."""
    return list(walk(FileSystem(), str(root), skip_bodies=False))


def kind(record: Any) -> str:
    return type(record).__name__


def flip(root: Path, *bits: tuple[int, int], segment: int = 1) -> None:
    """XOR each (offset, mask) into segment ``segment``."""
    seg = root / fmt.LOG_DIR / fmt.segment_name(segment)
    data = bytearray(seg.read_bytes())
    for offset, mask in bits:
        data[offset] ^= mask
    seg.write_bytes(bytes(data))


def padding_alone_segment(root: Path, messages: int = 2) -> tuple[Path, list[str]]:
    """A spool of ``messages`` accepted messages in segment 1, then segment 2 as an open's
    checkpoint leaves it when nothing was appended yet: its header and one PAD frame to
    the sector's end, synced. Returns segment 2's path and the message ids."""
    with Spool.open(root) as sp:
        msgs = [
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 100) for i in range(messages)
        ]
    with Spool.open(root) as sp:
        sp._state.writer.create_segment()
        sp.checkpoint()
    seg = root / fmt.LOG_DIR / fmt.segment_name(2)
    assert seg.stat().st_size == fmt.SECTOR  # its header and a PAD frame, nothing else
    return seg, msgs


def claimed_later(root: Path) -> list[str]:
    """Every message a claim hands out a day later (each closed again)."""
    handed = []
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        while (attempt := sp.claim()) is not None:
            handed.append(attempt.msg_id)
            attempt.close()
    return handed


def delivered_contents(root: Path, **options: Any) -> dict[str, bytes]:
    """Claim and deliver everything due a day later: each message's data."""
    contents: dict[str, bytes] = {}
    with Spool.open(root, clock=FakeClock(T0 + 86400), **{**OPTS, **options}) as sp:
        while (attempt := sp.claim()) is not None:
            contents[attempt.msg_id] = attempt.read_data()
            attempt.delivered(list(attempt.envelope.recipients), "250 ok")
            attempt.close()
    return contents


def run_child(script: str, timeout: float | None = None) -> str:
    """``script`` (dedented) in a child interpreter, which usually ends with ``os._exit``
    (a crash); its standard output. Fails the test if the child does."""
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True, text=True, cwd=ROOT, check=False, timeout=timeout,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc.stdout
