"""What the fourth review of ``check --repair`` left unfixed (docs/reliability.md): an
entry of the wrong kind where the spool keeps one of its own stopped a repair half way
on an ``OSError``; a body file of an earlier format version beside the copy this version
wrote of the same body was taken for a foreign file, and the message was never
delivered. Each built as found, asserting the contract it broke."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from crc32c import crc32c

from spool import Spool
from spool import format as fmt
from spool.check import check_spool, repair_spool
from spool.errors import BadSpoolDirectory, CorruptSpool
from spool.testing import FakeClock
from tests.contract.repairing import OPTS, T0, delivered_contents, flip, records


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every entry under ``root``: a file's bytes, else what it is."""
    out: dict[str, bytes | str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = f"link to {os.readlink(path)}"
            elif path.is_file():
                out[rel] = path.read_bytes()
            else:
                out[rel] = "directory" if path.is_dir() else "special"
    return out


def _staged_and_blocked(root: Path, block: Callable[[Path], object]) -> str:
    """M accepted, its body staged in incoming/; ``block`` puts something at bodies/M
    before the checkpoint, which then cannot settle M's body but writes positions past
    its envelope. M's id."""
    with Spool.open(root, clock=FakeClock(T0), checkpoint_interval=1000.0, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        block(root / fmt.BODY_DIR / m)
        sp.checkpoint()
    return m


def _flip_a_middle_bit(path: Path) -> None:
    """Damage a checksummed metadata file (positions, settings) by one bit."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))


def _make(path: Path, what: str) -> None:
    if what == "file":
        path.write_bytes(b"not the spool's\n")
    elif what == "directory":
        path.mkdir()
    elif what == "fifo":
        os.mkfifo(path)
    else:
        os.symlink(path.parent / "nowhere", path)


def _queued_with_damage(root: Path) -> list[str]:
    """Three queued messages over three batches, one bit of the second's envelope
    flipped: a repair must write to ``corrupt/``."""
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        ids = []
        for i in range(3):
            ids.append(sp.accept("alice@x.org", [f"r{i}@x.net"], b"m" * 50))
            sp.sync()
    envelope = next(p for p, r, _ in records(root) if getattr(r, "msg_id", None) == ids[1])
    flip(root, (envelope.offset + 30, 0x04), segment=envelope.segment)
    return ids


CASES = [
    (fmt.CORRUPT_DIR, "file"),
    (fmt.CORRUPT_DIR, "dangling link"),
    (fmt.INCOMING_DIR, "file"),
    (fmt.BODY_DIR, "dangling link"),
    (fmt.LOG_DIR, "file"),
    (fmt.LOCK_NAME, "directory"),
    (fmt.LOCK_NAME, "fifo"),
    (fmt.REPAIRING_NAME, "directory"),
    (fmt.REPAIRING_NAME, "dangling link"),
]


@pytest.mark.parametrize(("name", "what"), CASES)
def test_an_entry_of_the_wrong_kind_is_refused_before_any_change(
    tmp_path: Path, name: str, what: str
) -> None:
    # A file where corrupt/ belongs (or a directory named repairing or lock) stopped
    # `check --repair` with an OSError after its first changes: the repairing flag and
    # new positions written, the spool refusing every open until a repair ran through.
    root = tmp_path / "spool"
    ids = _queued_with_damage(root)
    entry, aside = root / name, tmp_path / "aside"
    if entry.exists():
        entry.rename(aside)  # kept: the operator puts it back below
    _make(entry, what)
    before = _tree(root)
    for action in (
        lambda: check_spool(str(root)),
        lambda: repair_spool(str(root)),
        lambda: Spool.open(root, clock=FakeClock(T0), **OPTS).close(),
    ):
        with pytest.raises(BadSpoolDirectory, match=f"{name} is .* move it out"):
            action()
        assert _tree(root) == before  # nothing changed
    # The operator moves the entry away, as the error says: the repair runs through.
    if entry.is_dir() and not entry.is_symlink():
        shutil.rmtree(entry)
    else:
        entry.unlink()
    if aside.exists():
        aside.rename(entry)
    report = repair_spool(str(root))
    assert report.after.clean
    assert delivered_contents(root) == dict.fromkeys(ids, b"m" * 50)


@pytest.mark.parametrize("name", [fmt.POSITIONS_NAME, fmt.SETTINGS_NAME])
def test_a_directory_in_place_of_positions_or_settings_refuses_the_open_clearly(
    tmp_path: Path, name: str
) -> None:
    # The open took a directory at `positions` for no positions, recovered, and failed at
    # its checkpoint with "close and reopen the spool", which never helped.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        msg = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    (root / name).unlink()
    (root / name).mkdir()
    with pytest.raises(CorruptSpool, match=r"not a regular file|damaged") as raised:
        Spool.open(root, clock=FakeClock(T0), **OPTS)
    assert "check --repair" in str(raised.value)
    assert repair_spool(str(root)).after.clean
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg


def _as_version_1(raw: bytes) -> bytes:
    """The same body file as format version 1 wrote it (only the version differs)."""
    magic, _version, r, length, data_crc, _crc = fmt.BODY_HEADER.unpack_from(raw)
    head = fmt.BODY_HEADER.pack(magic, 1, r, length, data_crc, 0)[:-4]
    return head + crc32c(head).to_bytes(4, "little") + raw[fmt.BODY_HEADER_SIZE :]


def test_a_version_1_body_file_beside_this_versions_copy_is_the_same_body(
    tmp_path: Path,
) -> None:
    # A spool from version 1 with M's body settled in bodies/; the body copied again by
    # this version (a restored envelope, a promotion after a hold) into incoming/. The
    # headers differ in their version byte only: the two were taken for two different
    # bodies, every claim of M refused and the repair held it for the operator.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
    settled = root / fmt.BODY_DIR / m
    copy = settled.read_bytes()
    settled.write_bytes(_as_version_1(copy))
    (root / fmt.INCOMING_DIR / m).write_bytes(copy)
    (root / fmt.POSITIONS_NAME).unlink()  # recovery scans M's envelope again
    assert check_spool(str(root)).clean
    assert delivered_contents(root) == {m: b"M" * 500}
    assert check_spool(str(root)).clean


# --- found by the review of those fixes ------------------------------------------------


@pytest.mark.parametrize("name", [fmt.POSITIONS_NAME, fmt.SETTINGS_NAME])
@pytest.mark.parametrize("link", ["dangling", "looping"])
def test_a_link_to_nothing_at_positions_or_settings_opens_or_is_repaired(
    tmp_path: Path, name: str, link: str
) -> None:
    # The fix above refused it as "not a regular file", pointing at check --repair, while
    # check called the spool clean and the repair had nothing to do: never opened again.
    # A spool check calls clean opens; one it does not, the repair sets right.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        msg = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    entry = root / name
    entry.unlink()
    os.symlink(tmp_path / "nowhere" if link == "dangling" else entry, entry)
    if not check_spool(str(root)).clean:  # a looping link reads as a damaged file
        assert link == "looping"
        assert repair_spool(str(root)).after.clean
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg
        attempt.close()
    assert not entry.is_symlink()  # replaced by the open's own file
    assert check_spool(str(root)).clean


def test_a_directory_at_the_control_socket_is_refused_before_serving(tmp_path: Path) -> None:
    # check called the spool clean; `spool serve` recovered it, then died binding its
    # socket with a bare IsADirectoryError.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    (root / fmt.SOCKET_NAME).mkdir()
    with pytest.raises(BadSpoolDirectory, match="control socket"):
        check_spool(str(root))
    proc = subprocess.run(
        [sys.executable, "-m", "spool.cli", "serve", str(root)],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.count("\n") == 1 and "control socket" in proc.stderr, proc.stderr


def test_a_link_in_incoming_to_the_settled_body_never_replaces_it(tmp_path: Path) -> None:
    # incoming/M a symbolic link to bodies/M: the two read as agreeing copies, check
    # called the spool clean, and the open's checkpoint renamed the link over the body
    # file: bodies/M a link to itself, M's data gone.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
    settled = root / fmt.BODY_DIR / m
    os.symlink(settled, root / fmt.INCOMING_DIR / m)
    (root / fmt.POSITIONS_NAME).unlink()  # recovery scans M's envelope again
    report = check_spool(str(root))
    assert any("symbolic link" in p.what for p in report.problems)
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        sp.checkpoint()
    assert settled.is_file() and not settled.is_symlink()
    assert repair_spool(str(root)).after.clean
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        attempt = sp.claim()
        assert attempt is not None and attempt.read_data() == b"M" * 500
        attempt.delivered(["bob@x.net"], "250 ok")
        attempt.close()


# --- found by a second review of those fixes -------------------------------------------


@pytest.mark.parametrize("what", ["link to the staged body", "dangling link", "directory"])
def test_a_stray_entry_in_the_way_of_a_staged_body_never_costs_it(
    tmp_path: Path, what: str
) -> None:
    # A link at bodies/M while M's body was staged: the checkpoint no longer moved the
    # file over it and wrote positions past M's envelope; the repair moved the link aside
    # and the next open took incoming/M for an accept's leftover and removed it. With a
    # dangling link, a plain reopen did that already (the link read as nothing there).
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), checkpoint_interval=1000.0, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        in_the_way = root / fmt.BODY_DIR / m
        if what == "directory":
            in_the_way.mkdir()
        else:
            target = root / fmt.INCOMING_DIR / m if what.startswith("link") else tmp_path / "x"
            os.symlink(target, in_the_way)
        sp.checkpoint()
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        sp.checkpoint()  # a plain reopen keeps M's body
    assert (root / fmt.INCOMING_DIR / m).is_file() or (root / fmt.BODY_DIR / m).is_file()
    report = repair_spool(str(root))
    assert report.after.clean
    for _ in range(2):  # the open after the repair, and one more
        with Spool.open(root, clock=FakeClock(T0 + 20), **OPTS) as sp:
            sp.checkpoint()
    assert check_spool(str(root)).clean
    assert delivered_contents(root) == {m: b"M" * 500}


@pytest.mark.parametrize("sub", [fmt.BODY_DIR, fmt.INCOMING_DIR])
def test_a_link_under_an_unused_name_is_set_aside_once(tmp_path: Path, sub: str) -> None:
    # The link was listed both as a stray entry and as an orphan body file: the repair
    # moved it as the one, then stopped on the other (FileNotFoundError), leaving the
    # repairing flag: every open refused.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        msg = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    (tmp_path / "some_file").write_bytes(b"hello")
    os.symlink(tmp_path / "some_file", root / sub / "0123456789ABCDEF")
    report = check_spool(str(root))
    assert report.stray_entries == (f"{sub}/0123456789ABCDEF",) and not report.orphan_bodies
    assert repair_spool(str(root)).after.clean
    assert not (root / fmt.REPAIRING_NAME).exists()
    assert (tmp_path / "some_file").read_bytes() == b"hello"
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == msg


def test_a_damaged_body_is_kept_not_a_link_beside_it(tmp_path: Path) -> None:
    # M's settled body damaged, a link at incoming/M to an unrelated file: the repair took
    # the link for "the damaged body file" and kept it in corrupt/, while the damaged
    # file itself was removed with the bounce: the bounce named a copy that was a link.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
    settled = root / fmt.BODY_DIR / m
    data = bytearray(settled.read_bytes())
    data[100] ^= 1
    settled.write_bytes(bytes(data))
    (tmp_path / "elsewhere").write_bytes(b"anything")
    os.symlink(tmp_path / "elsewhere", root / fmt.INCOMING_DIR / m)
    report = repair_spool(str(root))
    assert report.after.clean
    kept = {p.name: p for p in (root / fmt.CORRUPT_DIR).iterdir()}
    [bad] = [p for name, p in kept.items() if name.startswith(f"body.{m}.")]
    assert not bad.is_symlink() and bad.read_bytes() == bytes(data)
    assert (tmp_path / "elsewhere").read_bytes() == b"anything"


# --- found by a third review of those fixes --------------------------------------------


def test_damaged_positions_and_a_stray_in_the_way_are_repaired_in_one_run(
    tmp_path: Path,
) -> None:
    # The positions, moved aside for the stray, were moved aside again as damaged: the
    # repair stopped on FileNotFoundError, leaving its flag; every open refused.
    root = tmp_path / "spool"
    m = _staged_and_blocked(root, Path.mkdir)
    _flip_a_middle_bit(root / fmt.POSITIONS_NAME)
    assert repair_spool(str(root)).after.clean
    assert not (root / fmt.REPAIRING_NAME).exists()
    assert delivered_contents(root) == {m: b"M" * 500}


@pytest.mark.parametrize("link", ["to another message's body", "dangling"])
def test_a_body_copy_never_goes_through_a_link_in_incoming(tmp_path: Path, link: str) -> None:
    # Rule "a link is no body file" held for reads only: a hold copied M's inline body
    # through the link at incoming/M (over O's settled body, which then read as M's; or
    # outside the spool), and the checkpoint moved the link into bodies/: M lost, O
    # delivered with M's data.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        o = sp.accept("alice@x.org", ["olga@x.net"], b"O" * 500)  # a body file
        m = sp.accept("alice@x.org", ["mike@x.net"], b"m" * 50)  # inline
    target = os.path.join("..", fmt.BODY_DIR, o) if link.startswith("to") else tmp_path / "x"
    os.symlink(target, root / fmt.INCOMING_DIR / m)
    with Spool.open(root, clock=FakeClock(T0 + 1), **OPTS) as sp:
        sp.hold(m, "look at it")
        sp.checkpoint()
        sp.release(m)
    assert not (tmp_path / "x").exists()
    assert check_spool(str(root)).clean
    assert delivered_contents(root) == {o: b"O" * 500, m: b"m" * 50}


def test_a_bounce_copy_never_goes_through_a_link_in_incoming(tmp_path: Path) -> None:
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), outcomes=True, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["mike@x.net"], b"m" * 50)
    os.symlink(tmp_path / "x", root / fmt.INCOMING_DIR / m)
    with Spool.open(root, clock=FakeClock(T0 + 1), outcomes=True, **OPTS) as sp:
        sp.bounce(m)
        outcome = sp.next_outcome(timeout=5)
        assert outcome is not None and outcome.msg_id == m
        assert sp.outcome_body(outcome) == b"m" * 50
    assert not (tmp_path / "x").exists()


def test_a_staged_body_kept_from_bodies_survives_the_way_clearing(tmp_path: Path) -> None:
    # A directory at bodies/M kept the checkpoint from settling M's staged body, and its
    # positions passed M's envelope. The directory removed by hand: check called the
    # spool clean, and the next open removed incoming/M as an accept's leftover.
    root = tmp_path / "spool"
    m = _staged_and_blocked(root, Path.mkdir)
    (root / fmt.BODY_DIR / m).rmdir()
    assert check_spool(str(root)).clean
    for _ in range(2):
        with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
            sp.checkpoint()
    assert check_spool(str(root)).clean
    assert (root / fmt.BODY_DIR / m).is_file()  # settled once the way was clear
    assert delivered_contents(root) == {m: b"M" * 500}


@pytest.mark.parametrize("name", ["../positions", "", "6b49d200e3385e58", 7])
def test_positions_naming_no_message_id_as_unsettled_are_damaged(
    tmp_path: Path, name: object
) -> None:
    # The ids of `unsettled` name body file paths: a hand-edited file (its CRC made
    # right) naming anything else is damaged positions, ignored whole (a full scan).
    from spool.metafile import encode_metafile
    from spool.positions import decode_positions, encode_positions

    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    positions = decode_positions((root / fmt.POSITIONS_NAME).read_bytes())
    assert positions is not None
    good = positions.to_obj() | {"unsettled": ["6B49D200E3385E58"]}
    assert decode_positions(encode_metafile(good)) is not None
    assert decode_positions(encode_positions(positions)) == positions
    bad = positions.to_obj() | {"unsettled": [name]}
    assert decode_positions(encode_metafile(bad)) is None


# --- found by a fourth review ----------------------------------------------------------


def test_a_body_copy_never_goes_through_a_hard_link_in_incoming(tmp_path: Path) -> None:
    # A hard link at incoming/M to O's settled body, made while the spool was open: the
    # hold's copy of M's inline body truncated and rewrote it, so O read as M's data.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), **OPTS) as sp:
        o = sp.accept("alice@x.org", ["olga@x.net"], b"O" * 500)
        m = sp.accept("alice@x.org", ["mike@x.net"], b"m" * 50)
    with Spool.open(root, clock=FakeClock(T0 + 1), **OPTS) as sp:
        os.link(root / fmt.BODY_DIR / o, root / fmt.INCOMING_DIR / m)
        sp.hold(m, "look at it")
        sp.checkpoint()
        sp.release(m)
    assert check_spool(str(root)).clean
    assert delivered_contents(root) == {o: b"O" * 500, m: b"m" * 50}


def test_positions_naming_unsettled_files_are_a_version_older_builds_refuse(
    tmp_path: Path,
) -> None:
    # A build that predates `unsettled` read the positions (version 1), ignored the key,
    # and removed the staged file as an accept's leftover. Version 2 makes it scan the
    # whole log instead (it reads only version 1); this build reads both.
    from spool.fs import FileSystem
    from spool.positions import load_positions

    root = tmp_path / "spool"
    m = _staged_and_blocked(root, Path.mkdir)
    assert b'"version":2' in (root / fmt.POSITIONS_NAME).read_bytes()
    loaded = load_positions(FileSystem(), str(root))
    assert loaded is not None and loaded.unsettled == {m}
    (root / fmt.BODY_DIR / m).rmdir()
    with Spool.open(root, clock=FakeClock(T0 + 10), **OPTS) as sp:
        sp.checkpoint()  # settled now: back to version 1
    assert b'"version":1' in (root / fmt.POSITIONS_NAME).read_bytes()
    assert delivered_contents(root) == {m: b"M" * 500}


def test_a_finished_message_takes_only_its_own_body_file(tmp_path: Path) -> None:
    # A file that is no body beside M's staged body: delivering M removed both names, so
    # the file check said the repair would keep in corrupt/ was gone.
    root = tmp_path / "spool"
    with Spool.open(root, clock=FakeClock(T0), checkpoint_interval=1000.0, **OPTS) as sp:
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        foreign = root / fmt.BODY_DIR / m
        foreign.write_bytes(b"operator notes, not a body")
        sp.checkpoint()
    assert delivered_contents(root) == {m: b"M" * 500}
    with Spool.open(root, clock=FakeClock(T0 + 86400), **OPTS) as sp:
        sp.checkpoint()
    assert foreign.read_bytes() == b"operator notes, not a body"
    assert not (root / fmt.INCOMING_DIR / m).exists()
    assert repair_spool(str(root)).after.clean
    kept = [p.read_bytes() for p in (root / fmt.CORRUPT_DIR).iterdir() if m in p.name]
    assert kept == [b"operator notes, not a body"]


# --- found by a fifth review -----------------------------------------------------------


def test_settings_are_restored_from_positions_the_repair_set_aside(tmp_path: Path) -> None:
    # A stray in the way of a staged body made the repair move the positions aside
    # before it restored damaged settings from their copy there: "no copy found", the
    # defaults applied (outcome tracking off), and a bounce's kept body later filed as an
    # orphan.
    root = tmp_path / "spool"
    opts = {**OPTS, "outcomes": True, "checkpoint_interval": 1000.0}
    with Spool.open(root, clock=FakeClock(T0), **opts) as sp:  # type: ignore[arg-type]
        f = sp.accept("alice@x.org", ["fay@x.net"], b"f" * 50)
        sp.bounce(f)
        m = sp.accept("alice@x.org", ["bob@x.net"], b"M" * 500)
        (root / fmt.BODY_DIR / m).write_bytes(b"not a body")
        sp.checkpoint()
    _flip_a_middle_bit(root / fmt.SETTINGS_NAME)
    report = repair_spool(str(root))
    assert report.after.clean and not report.after.orphan_bodies
    assert any("restored it from the copy" in line for line in report.actions)
    with Spool.open(root, clock=FakeClock(T0 + 10)) as sp:  # the recorded options
        assert sp.options.outcomes and sp.options.inline_body_max == OPTS["inline_body_max"]
        outcome = sp.next_outcome(timeout=5)
        assert outcome is not None and outcome.msg_id == f
        assert sp.outcome_body(outcome) == b"f" * 50


# --- found by the crash-state piece on this code (docs/reliability.md, the figures) ------


def test_a_burst_over_an_opens_padding_holds_no_mail(tmp_path: Path) -> None:
    # Seed 10158 of the explorer (workload outcomes-and-reopens), rebuilt: M deferred
    # (live, its records may follow its envelope anywhere), a kill -9, then an open whose
    # recovery begins segment 2 with a 480-byte PAD frame; four bytes of that frame's
    # header hit. No record of M was there, yet the repair held M ("records possibly
    # lost"). (A clean close flushes before its last positions, so the kill it must be.)
    base, root = tmp_path / "live", tmp_path / "spool"
    sp = Spool.open(base, clock=FakeClock(T0), **OPTS)
    m = sp.accept("alice@x.org", ["bob@x.net"], b"m" * 50)
    attempt = sp.claim()
    assert attempt is not None
    attempt.deferred(["bob@x.net"], "451 4.3.0 later")
    attempt.close()
    sp.sync()
    shutil.copytree(base, root)  # what a kill -9 here leaves
    sp.close()
    with Spool.open(root, clock=FakeClock(T0 + 1), **OPTS) as sp:
        n = sp.accept("alice@x.org", ["carol@x.net"], b"n" * 50)
    first = next(p for p, _r, f in records(root) if p.segment == 2)
    assert first.offset == 32 and next(f for p, _r, f in records(root) if p == first).type == (
        fmt.T_PAD
    )
    flip(root, (33, 0x5A), (34, 0xA5), (35, 0x3C), (36, 0xC3), segment=2)
    report = repair_spool(str(root))
    assert report.after.clean
    assert not report.fates, report.fates
    assert sorted(delivered_contents(root)) == sorted([m, n])
