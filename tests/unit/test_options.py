"""Options: checked before anything is touched, recorded in the spool, inherited by openers.

Goal: no option can hang a thread or fail an assertion later, every opener (the CLI, a
plain ``Spool.open(path)``) behaves as the owner does, and the recipient limit really keeps
every record inside one frame.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import cbor2
import pytest

from spool import Spool
from spool import format as fmt
from spool import records as rec
from spool.check import check_spool, repair_spool
from spool.errors import CorruptSpool, SpoolMisuse
from spool.fs import FileSystem
from spool.options import (
    ADDRESS_MAX,
    RECIPIENTS_LIMIT,
    TEXT_MAX,
    SpoolOptions,
    load_settings,
)
from spool.records import Position

ROOT = Path(__file__).resolve().parents[2]

BAD_OPTIONS: list[dict[str, Any]] = [
    {"sync_every": 0},
    {"sync_every": -1},
    {"sync_interval": 0},
    {"sync_interval": float("nan")},
    {"checkpoint_interval": -5},
    {"checkpoint_every": 0},
    {"segment_size": 10},
    {"segment_size": 2.5},
    {"inline_body_max": -1},
    {"inline_body_max": fmt.FRAME_PAYLOAD_MAX},
    {"max_message_size": 0},
    {"max_recipients": 0},
    {"max_recipients": RECIPIENTS_LIMIT + 1},
    {"max_recipients": True},
    {"max_in_flight": 0},
    {"min_free_bytes": -1},
    {"crash_limit": 0},
    {"max_lifetime": 0},
    {"retry_intervals": []},
    {"retry_intervals": [60, -1]},
    {"retry_intervals": "60"},
    {"retry_intervals": [float("inf")]},
    {"outcomes": 1},
    {"archive_dir": ""},
    {"archive_dir": 7},
    {"clock": 12.0},
]


@pytest.mark.parametrize(
    "bad", BAD_OPTIONS, ids=lambda d: ",".join(f"{k}={v!r}" for k, v in d.items())
)
def test_an_invalid_option_is_refused_before_the_directory_is_touched(
    tmp_path: Path, bad: dict[str, Any]
) -> None:
    root = tmp_path / "spool"
    with pytest.raises(SpoolMisuse) as raised:
        Spool.open(root, **bad)
    assert next(iter(bad)) in str(raised.value)
    assert not root.exists()


def test_settings_are_recorded_and_inherited_by_every_opener(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, retry_intervals=[60, 600], outcomes=True, max_recipients=5) as sp:
        assert sp.options.retry_intervals == (60.0, 600.0)
    with Spool.open(root) as sp:  # names nothing: the owner's settings
        assert sp.options.retry_intervals == (60.0, 600.0)
        assert sp.options.outcomes and sp.options.max_recipients == 5
    with Spool.open(root, max_recipients=7):  # naming one changes it for good
        pass
    recorded = load_settings(FileSystem(), str(root))
    assert recorded["max_recipients"] == 7 and recorded["outcomes"] is True
    with Spool.open(root) as sp:
        assert sp.options.max_recipients == 7


def test_tuning_options_are_not_recorded(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, sync_every=5, checkpoint_interval=9.0):
        pass
    with Spool.open(root) as sp:
        assert sp.options.sync_every == SpoolOptions().sync_every
        assert sp.options.checkpoint_interval == SpoolOptions().checkpoint_interval


def test_a_relative_archive_dir_is_relative_to_the_spool_not_to_the_opener(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, archive_dir="../archive", segment_size=4096) as sp:
        for i in range(20):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 400)
        while (attempt := sp.claim()) is not None:
            attempt.delivered(attempt.envelope.recipients, "250 ok")
            attempt.close()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "spool.cli", "checkpoint", str(root)],
        cwd=elsewhere,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.returncode == 0, proc.stderr
    assert not (elsewhere / "archive").exists()
    archived = sorted(os.listdir(tmp_path / "archive"))
    assert archived and all(n.endswith(fmt.SEGMENT_SUFFIX) for n in archived)


def test_a_damaged_settings_file_is_restored_by_repair_from_the_copy_in_the_positions(
    tmp_path: Path,
) -> None:
    # A flipped byte in settings must not silently turn outcome tracking off (the unacked
    # bounces would be dropped at the next checkpoint).
    root = tmp_path / "spool"
    with Spool.open(root, outcomes=True, retry_intervals=[60]) as sp:
        sp.accept("a@example.org", ["b@example.net"], b"x")
        attempt = sp.claim()
        assert attempt is not None
        attempt.failed(["b@example.net"], "550 5.1.1 no such user")
        attempt.close()
    settings = root / fmt.SETTINGS_NAME
    settings.write_bytes(settings.read_bytes().replace(b'"outcomes":true', b'"outcomes":tru3'))
    with pytest.raises(CorruptSpool, match="settings"):
        Spool.open(root)
    report = check_spool(str(root))
    assert any(p.path == str(settings) for p in report.problems)
    repaired = repair_spool(str(root))
    assert repaired.after.clean, repaired.after.problems
    assert any("restored it from the copy" in line for line in repaired.actions)
    assert any(n.startswith("settings.") for n in os.listdir(root / fmt.CORRUPT_DIR))
    with Spool.open(root) as sp:
        assert sp.options.outcomes and sp.options.retry_intervals == (60.0,)
        assert sp.next_outcome() is not None  # the bounce is still handed out


def test_a_damaged_settings_file_without_a_copy_is_set_aside_and_the_defaults_apply(
    tmp_path: Path,
) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, outcomes=True):
        pass
    (root / fmt.POSITIONS_NAME).unlink()
    settings = root / fmt.SETTINGS_NAME
    settings.write_bytes(b"garbage\n")
    repaired = repair_spool(str(root))
    assert repaired.after.clean, repaired.after.problems
    assert any("defaults apply" in line for line in repaired.actions)
    with Spool.open(root) as sp:
        assert not sp.options.outcomes


def test_the_largest_records_the_limits_allow_fit_one_frame() -> None:
    # Every recipient at the longest address, every outcome with the longest reply: the
    # finish record and the replacement envelope that carry them must fit one frame.
    longest_reply = "5" + "€" * ((TEXT_MAX - 1) // 3)
    assert len(longest_reply.encode()) <= TEXT_MAX
    rcpts = tuple(f"{i:0{ADDRESS_MAX - 30}d}@{'d' * 20}.example" for i in range(RECIPIENTS_LIMIT))
    assert all(len(r) == ADDRESS_MAX - 1 for r in rcpts)
    outcomes = tuple(rec.Outcome(r, rec.DELIVERED, longest_reply, 1.8e9) for r in rcpts)
    msg_id = "6B49D20054D06D28"
    finish = rec.Finish(
        msg_id, 1.8e9, rec.BodyRef(rec.BODY_INLINE, 10**9, Position(1, 2)), outcomes
    )
    half = RECIPIENTS_LIMIT // 2
    envelope = rec.Envelope(
        msg_id,
        rcpts[0],
        rcpts[half:],
        1.8e9,
        1.8e9,
        rec.BodyRef(rec.BODY_FILE, 10**9),
        attempts=10**6,
        klass=63,
        held=longest_reply,
        crashes=999,
        supersedes=Position(2**40, 2**40),
        outcomes=outcomes[:half],
        last_reply=longest_reply,
        promoted_from=Position(2**40, 2**40),
    )
    for record in (finish, envelope):
        _ftype, payload = rec.encode(record)
        assert len(payload) <= fmt.FRAME_PAYLOAD_MAX, (type(record).__name__, len(payload))
    assert len(cbor2.dumps(longest_reply)) <= TEXT_MAX + 3
