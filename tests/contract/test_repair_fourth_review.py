"""Breaks a fourth adversarial review found (docs/reliability.md, "Found by running it"):
files that are not what the spool wrote where it expects its own, a segment copied over
another, a segment gone with the body files of its messages. Each built as the review
did, asserting the contract it broke."""

from __future__ import annotations

import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from spool import Spool
from spool import format as fmt
from spool.check import check_spool, repair_spool
from spool.errors import CorruptSpool
from spool.fs import FileSystem
from spool.queue_view import walk
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, delivered_contents, run_child


def _fifo(path: Path) -> None:
    os.mkfifo(path)


def _socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as sk:
        sk.bind(str(path))


def _dangling(path: Path) -> None:
    os.symlink(path.parent / "nowhere", path)


def _loop(path: Path) -> None:
    os.symlink(path, path)


def _empty(path: Path) -> None:
    path.write_bytes(b"")


def _directory(path: Path) -> None:
    path.mkdir()


MAKERS: dict[str, Callable[[Path], None]] = {
    "fifo": _fifo,
    "socket": _socket,
    "dangling link": _dangling,
    "looping link": _loop,
    "empty file": _empty,
    "directory": _directory,
}


def _delivered_once_each(root: Path) -> dict[str, int]:
    """Claim and deliver everything due a day later; how often each message came."""
    seen: dict[str, int] = {}
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        while (attempt := sp.claim()) is not None:
            seen[attempt.msg_id] = seen.get(attempt.msg_id, 0) + 1
            attempt.read_data()
            attempt.delivered(list(attempt.envelope.recipients), "250 ok")
            attempt.close()
    return seen


def _spool_over_segments(root: Path, count: int, body: int) -> list[str]:
    """``count`` queued messages, one batch each, over segments of 4 KiB."""
    with Spool.open(root, clock=FakeClock(T0), segment_size=4096, **OPTS) as sp:
        ids = []
        for i in range(count):
            ids.append(sp.accept("alice@x.org", [f"r{i}@x.net"], b"m" * body))
            sp.sync()
    return ids


def _segment_of(root: Path) -> dict[str, int]:
    return {
        r.msg_id: p.segment
        for p, r, _ in walk(FileSystem(), str(root))
        if r is not None and type(r).__name__ == "Envelope"
    }


@pytest.mark.parametrize("what", sorted(MAKERS))
def test_a_stray_entry_in_incoming_never_costs_the_settled_body(tmp_path: Path, what: str) -> None:
    # The owner's open took incoming/M for an accept's leftover and removed it by name:
    # from incoming/ and from bodies/, where M's intact body was. Every claim of M then
    # failed (a directory made the open itself fail).
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 500)
    MAKERS[what](root / fmt.INCOMING_DIR / m)
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == m
        assert attempt.read_data() == b"m" * 500
        attempt.close()
    assert (root / fmt.BODY_DIR / m).is_file()
    report = check_spool(str(root))
    assert not report.clean  # the stray entry is named
    assert repair_spool(str(root)).after.clean
    assert _delivered_once_each(root) == {m: 1}


@pytest.mark.parametrize("what", ["socket", "looping link", "fifo", "directory"])
@pytest.mark.parametrize("where", [fmt.BODY_DIR, fmt.INCOMING_DIR])
def test_a_special_file_in_place_of_a_body_file_is_named_not_a_crash(
    tmp_path: Path, what: str, where: str
) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 500)
        n = sp.accept("alice@x.org", ["carol@x.net"], b"n" * 500)
    if where == fmt.BODY_DIR:
        os.unlink(root / fmt.BODY_DIR / m)
    MAKERS[what](root / where / m)
    assert not check_spool(str(root)).clean
    report = repair_spool(str(root))
    assert report.after.clean
    if where == fmt.BODY_DIR:
        assert m in {msg for msg, _ in report.fates}  # its body is gone: failed, a bounce
        assert _delivered_once_each(root) == {n: 1}
    else:
        assert _delivered_once_each(root) == {m: 1, n: 1}


def test_a_segment_copied_over_another_delivers_nothing_twice(tmp_path: Path) -> None:
    # Segment 2's file replaced by a copy of segment 1 (its intact header names 1): the
    # repair set aside the header alone and kept the copied frames, so segment 1's
    # messages had a second live first envelope each, and were delivered twice.
    root = tmp_path / "spool"
    ids = _spool_over_segments(root, 30, 50)
    first = [m for m, seg in _segment_of(root).items() if seg == 1]
    log = root / fmt.LOG_DIR
    shutil.copyfile(log / fmt.segment_name(1), log / fmt.segment_name(2))
    report = check_spool(str(root))
    assert any("names segment 1" in p.what for p in report.problems)
    repaired = repair_spool(str(root))
    assert repaired.after.clean
    assert set(first) <= {m for m, _ in repaired.fates}  # held: records possibly lost
    delivered = _delivered_once_each(root)
    assert max(delivered.values()) == 1
    assert not set(first) & set(delivered)
    assert len(delivered) >= len(ids) - 2 * len(first) - 2  # segment 2's own are gone


@pytest.mark.parametrize("how", ["missing", "empty"])
def test_the_body_files_of_a_lost_segment_name_their_messages(tmp_path: Path, how: str) -> None:
    # Segment 2 deleted or truncated: the body files of its messages were filed as orphans
    # "left by a crash", their messages named nowhere.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), segment_size=4096, **OPTS) as sp:
        ids = []
        for i in range(30):
            ids.append(sp.accept("alice@x.org", [f"r{i}@x.net"], b"m" * (50 if i % 2 else 500)))
            sp.sync()
    second = [m for m, seg in _segment_of(root).items() if seg == 2]
    with_files = [m for m in second if (root / fmt.BODY_DIR / m).exists()]
    assert with_files
    path = root / fmt.LOG_DIR / fmt.segment_name(2)
    if how == "missing":
        path.unlink()
    else:
        path.write_bytes(b"")
    report = repair_spool(str(root))
    assert report.after.clean
    named = {m for m, _ in report.fates}
    assert set(with_files) <= named
    kept = os.listdir(root / fmt.CORRUPT_DIR)
    assert all(
        any(n.startswith(f"body.{m}.") and "lost-envelope" in n for n in kept) for m in with_files
    )


@pytest.mark.parametrize("what", ["fifo", "socket", "directory"])
def test_a_special_file_in_place_of_a_segment_is_named_and_set_aside(
    tmp_path: Path, what: str
) -> None:
    root = tmp_path / "spool"
    _spool_over_segments(root, 30, 50)
    where = _segment_of(root)
    path = root / fmt.LOG_DIR / fmt.segment_name(2)
    path.unlink()
    MAKERS[what](path)
    report = check_spool(str(root))
    assert any("not a segment file" in p.what for p in report.problems)
    assert repair_spool(str(root)).after.clean
    delivered = _delivered_once_each(root)
    assert max(delivered.values()) == 1
    assert {m for m, seg in where.items() if seg >= 3} <= set(delivered)


@pytest.mark.parametrize("name", [fmt.POSITIONS_NAME, fmt.SETTINGS_NAME])
@pytest.mark.parametrize("what", ["fifo", "directory"])
def test_a_special_file_in_place_of_positions_or_settings_is_repaired(
    tmp_path: Path, name: str, what: str
) -> None:
    root = tmp_path / "spool"
    ids = _spool_over_segments(root, 3, 50)
    path = root / name
    path.unlink()
    MAKERS[what](path)
    assert not check_spool(str(root)).clean
    assert repair_spool(str(root)).after.clean
    assert _delivered_once_each(root) == dict.fromkeys(ids, 1)


# --- found by the review of those fixes ------------------------------------------------


@pytest.mark.parametrize("second", ["damaged copy", "another message's body"])
def test_a_second_file_in_incoming_never_replaces_the_settled_body(
    tmp_path: Path, second: str
) -> None:
    # M's body settled in bodies/; a second file at incoming/M and the positions gone, so
    # that recovery scans M's envelope again: its checkpoint moved incoming/M over the
    # intact body (M then lost, or delivered with N's content). A valid foreign file was
    # read as M's body, and check called the spool clean.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        n = sp.accept("alice@x.org", ["carol@x.net"], b"N" * 500)
    bodies, incoming = root / fmt.BODY_DIR, root / fmt.INCOMING_DIR
    if second == "damaged copy":
        data = bytearray((bodies / m).read_bytes())
        data[-1] ^= 1
        (incoming / m).write_bytes(bytes(data))
    else:
        shutil.copyfile(bodies / n, incoming / m)
    (root / fmt.POSITIONS_NAME).unlink()
    named = "second file" if second == "damaged copy" else "two different valid body files"
    assert any(named in p.what for p in check_spool(str(root)).problems)
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        sp.checkpoint()
    assert (bodies / m).read_bytes() != (incoming / m).read_bytes()
    report = repair_spool(str(root))
    assert report.after.clean
    if second == "another message's body":
        # Two valid files that differ: which is M's cannot be told. Held, both kept.
        assert [msg for msg, _ in report.fates] == [m]
        assert any(p.name.endswith(".second") for p in (root / fmt.CORRUPT_DIR).iterdir())
        assert delivered_contents(root) == {n: b"N" * 500}
        with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
            sp.release(m)  # the operator looked: the file in bodies/ is M's
    else:
        assert not report.fates
    assert delivered_contents(root) == {m: b"M" * 500} | (
        {n: b"N" * 500} if second == "damaged copy" else {}
    )


def test_a_foreign_file_in_bodies_beside_a_staged_body_is_never_delivered(
    tmp_path: Path,
) -> None:
    # The mirror: M's body still staged in incoming/, N's body file copied to bodies/M.
    # Reads took the settled one, and the repair set M's own body aside as the second
    # file: M delivered with N's content, the repair saying no mail was touched.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), checkpoint_interval=1000.0, **OPTS) as sp:
        n = sp.accept("alice@x.org", ["carol@x.net"], b"N" * 500)
        sp.checkpoint()
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        assert (root / fmt.INCOMING_DIR / m).is_file()
        shutil.copyfile(root / fmt.BODY_DIR / n, root / fmt.BODY_DIR / m)
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == n
        attempt.close()
        with pytest.raises(CorruptSpool):  # neither copy is delivered
            while (attempt := sp.claim()) is not None:
                attempt.read_data()
    report = repair_spool(str(root))
    assert report.after.clean and [msg for msg, _ in report.fates] == [m]
    kept = [p for p in (root / fmt.CORRUPT_DIR).iterdir() if p.name.endswith(".second")]
    assert [p.read_bytes()[-500:] for p in kept] == [b"M" * 500]  # M's own, kept
    assert m not in delivered_contents(root)  # held for the operator


def test_a_bounce_copy_a_crash_cut_short_is_written_again_and_kept(tmp_path: Path) -> None:
    # Outcome tracking: a failure's finish copies the inline body to incoming/M; a crash
    # before the finish is durable. Recovery took the copy for an orphan and doomed it,
    # then wrote the finish again with a new copy, which the open's checkpoint removed:
    # the outcome named a body file that was gone, and check called the spool clean.
    root = tmp_path / "spool"
    tuning = {"sync_interval": 1000.0, "sync_every": 10**6, "checkpoint_interval": 1000.0}
    script = f"""
        import os
        from spool import Spool
        from spool.testing import FakeClock
        sp = Spool.open({str(root)!r}, clock=FakeClock({T0}), outcomes=True, **{tuning!r},
                        **{OPTS!r})
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 50)
        sp.checkpoint()
        attempt = sp.claim()
        sp.sync()  # the start durable, the finish not
        attempt.failed(["bob@x.net"], "550 5.1.1 no such user")
        attempt.close()
        assert os.listdir({str(root / fmt.INCOMING_DIR)!r}) == [m]
        os._exit(0)
    """
    run_child(script)
    with Spool.open(root, clock=FakeClock(T0 + 10), outcomes=True, **OPTS) as sp:
        outcome = sp.next_outcome()
        assert outcome is not None and outcome.body.kind == "file"
        assert sp.outcome_body(outcome) == b"M" * 50
    assert check_spool(str(root)).clean


@pytest.mark.parametrize("which", ["first", "last"])
def test_a_segment_lost_at_either_end_names_its_messages(tmp_path: Path, which: str) -> None:
    # The first or the last segment deleted: only gaps between segments counted as
    # missing. The first: check called the spool clean and the body files of its messages
    # were filed as orphans. The last: its body files the same, and the repair left
    # "restart positions point past the end of the log" behind.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), segment_size=4096, **OPTS) as sp:
        for i in range(30):
            sp.accept("alice@x.org", [f"r{i}@x.net"], b"m" * (50 if i % 2 else 500))
            sp.sync()
    where = _segment_of(root)
    gone = min(where.values()) if which == "first" else max(where.values())
    with_files = [
        m for m, seg in where.items() if seg == gone and (root / fmt.BODY_DIR / m).exists()
    ]
    assert with_files
    (root / fmt.LOG_DIR / fmt.segment_name(gone)).unlink()
    assert not check_spool(str(root)).clean
    report = repair_spool(str(root))
    assert report.after.clean
    assert set(with_files) <= {m for m, _ in report.fates}
    delivered = _delivered_once_each(root)
    assert max(delivered.values(), default=1) == 1
    if which == "first":  # the others are intact, and nothing of the lost ones comes back
        assert set(delivered) == {m for m, seg in where.items() if seg != gone}
