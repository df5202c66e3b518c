"""Corruption and hostile files: damaged spools never crash the spool or its CLI.

Goal: contract item 7 for corrupt or truncated files. Whatever the damage, ``Spool.open``
and every read-only CLI command either recover (a torn tail is cut, its bytes kept in
``corrupt/``), or refuse with ``CorruptSpool`` naming the file and offset, and nothing
readable is dropped silently: after a successful open every message whose records and
body are undamaged is still queued with the same recipients, and a damaged body is
reported as ``CorruptSpool`` when read, never handed out as wrong data.

Method: a child process makes real traffic on a spool with 8 KiB segments (body files,
deferred, delivered and in-flight mail, records after the last restart positions) and
exits without closing. Each case copies that spool, damages the copy (seeded): bit flips
anywhere, zeroed 4 KiB pages, truncation of the newest segment at every offset of its
last frames and at sampled offsets elsewhere, appended garbage, a deleted middle segment,
damaged restart positions, damaged or truncated body files. It runs the read-only CLI
commands (which must also leave the files unchanged), then opens the spool, then claims
every message with a clock far ahead and reads every body (whose first 8 bytes are a CRC
of the rest, so wrong data cannot pass). The truth to compare with is the undamaged copy
opened the same way; each message's byte ranges on disk come from a walk of it.

The second half fuzzes the frame scanner and the record decoder with Hypothesis over
arbitrary bytes and over mutated valid frames (``SPOOL_FUZZ_EXAMPLES`` examples each).
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spool import CorruptSpool, Spool
from spool import format as fmt
from spool import records as rec
from spool.cli import main
from spool.framing import NEED_DATA, BadFrame, Frame, Scanner, encode_frame, parse_frame
from spool.fs import FileSystem
from spool.queue_view import walk
from spool.reader import LogCursor, list_segments
from spool.records import Position
from spool.segment_header import segment_header, segment_salt
from spool.testing import FakeClock, tree_snapshot
from tests.contract.children import TRAFFIC_OPTIONS, body_is_intact

ROOT = Path(__file__).resolve().parents[2]
FUZZ_EXAMPLES = int(os.environ.get("SPOOL_FUZZ_EXAMPLES", "300"))
Damage = Callable[[Path], str]  # damages a spool copy in place; returns a description


@attrs.frozen
class Truth:
    """The undamaged spool: queue after recovery and where each message's bytes are."""

    path: Path
    queue: dict[str, tuple[str, ...]]
    extents: dict[str, list[tuple[str, int, int]]]  # msg -> (file, start, end)
    segments: list[int]

    def seg_path(self, root: Path, seg: int) -> Path:
        return root / fmt.LOG_DIR / fmt.segment_name(seg)


def message_extents(root: str) -> dict[str, list[tuple[str, int, int]]]:
    """For each message, the byte ranges of its records, body frame and body file."""
    out: dict[str, list[tuple[str, int, int]]] = {}
    for pos, record, frame in walk(FileSystem(), root, skip_bodies=False):
        assert frame is not None
        name = fmt.segment_name(pos.segment)
        if record is None and frame.type == fmt.T_BODY:
            owner = rec.decode_body(frame.payload)[0]
        elif record is None:
            continue
        else:
            owner = record.target if isinstance(record, rec.Control) else record.msg_id
        out.setdefault(owner, []).append((name, pos.offset, pos.offset + frame.size))
    for name in os.listdir(os.path.join(root, fmt.BODY_DIR)):
        size = os.path.getsize(os.path.join(root, fmt.BODY_DIR, name))
        out.setdefault(name, []).append((name, 0, size))
    return out


def queue_after_open(root: str) -> tuple[dict[str, tuple[str, ...]], Spool]:
    sp = Spool.open(root, clock=FakeClock(2e9), **TRAFFIC_OPTIONS)
    try:
        return {e.msg_id: e.recipients for e in sp.list()}, sp
    except BaseException:
        sp.close()  # an open spool the caller never gets would hold its files to the end
        raise


@pytest.fixture(scope="module")
def truth(tmp_path_factory: pytest.TempPathFactory) -> Truth:
    base = tmp_path_factory.mktemp("corruption")
    pristine = base / "pristine"
    subprocess.run(
        [sys.executable, "-m", "tests.contract.children", "traffic", str(pristine)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=120,
    )
    extents = message_extents(str(pristine))
    probe = base / "probe"
    shutil.copytree(pristine, probe)
    queue, sp = queue_after_open(str(probe))
    sp.close()
    segments = list_segments(FileSystem(), str(pristine / fmt.LOG_DIR))
    assert len(segments) >= 5 and len(queue) >= 30
    assert os.listdir(pristine / fmt.BODY_DIR)
    return Truth(pristine, queue, extents, segments)


def run_cli(root: Path, truth: Truth) -> dict[str, int]:
    """Every read-only command; none may raise or change a byte. Exit codes by command."""
    before = tree_snapshot(str(root))
    some_id = sorted(truth.queue)[0]
    commands = {
        "check": ["check", str(root)],
        "list": ["list", str(root)],
        "stats": ["stats", "--json", str(root)],
        "dump": ["dump", str(root)],
        "show": ["show", str(root), some_id],
        "show-data": ["show", "--data", str(root), some_id],
        "recover-dry-run": ["recover", "--dry-run", str(root)],
    }
    codes = {}
    for name, args in commands.items():
        result = CliRunner().invoke(main, args)
        if result.exception is not None and not isinstance(result.exception, SystemExit):
            raise AssertionError(f"spool {name} raised {result.exception!r}") from (
                result.exception
            )
        assert result.exit_code in (0, 1), (name, result.exit_code, result.output)
        if result.exit_code == 1 and name != "check":
            assert "spool:" in result.output, (name, result.output)
        codes[name] = result.exit_code
    assert tree_snapshot(str(root)) == before, "a read-only command changed the spool"
    return codes


def assert_names_a_file(exc: CorruptSpool, root: Path) -> None:
    assert exc.offset >= 0
    assert Path(exc.path).resolve().is_relative_to(root.resolve()), exc.path


def check_damaged(root: Path, truth: Truth, damaged: set[tuple[str, int, int]], full: bool) -> str:
    """Open the damaged copy and check the contract; returns what happened.

    ``full``: also run the CLI and read every body (skipped for most truncation cases,
    which cannot damage a body the open did not cut).
    """
    codes = run_cli(root, truth) if full else None
    try:
        queue, sp = queue_after_open(str(root))
    except CorruptSpool as exc:
        assert_names_a_file(exc, root)
        if codes is not None:
            assert codes["check"] == 1, "open refuses a spool that check calls clean"
        return "refused"
    try:
        cut = sp.recovery.torn_at
        if cut is not None and sp.recovery.torn_bytes_cut:
            # A cut tail is kept in corrupt/ unless it was all zeros.
            tail_file = (
                root / fmt.CORRUPT_DIR / f"{fmt.segment_name(cut.segment)}.{cut.offset}.torn"
            )
            seg_bytes = (truth.seg_path(truth.path, cut.segment)).read_bytes()[cut.offset :]
            assert tail_file.exists() or not seg_bytes.strip(b"\0") or damaged
        for msg_id, rcpts in truth.queue.items():
            if touched(truth.extents.get(msg_id, []), damaged, cut):
                continue
            assert queue.get(msg_id) == rcpts, f"undamaged message {msg_id} changed or vanished"
        if full:
            read_every_body(sp, root)
    finally:
        sp.close()
    return "recovered" if cut is None else "cut"


def touched(
    extents: list[tuple[str, int, int]], damaged: set[tuple[str, int, int]], cut: Position | None
) -> bool:
    for name, start, end in extents:
        for d_name, d_start, d_end in damaged:
            if name == d_name and start < d_end and d_start < end:
                return True
        if cut is not None and name == fmt.segment_name(cut.segment) and end > cut.offset:
            return True
    return False


def read_every_body(sp: Spool, root: Path) -> None:
    """Claim everything due; each body is either intact or a CorruptSpool naming a file."""
    while True:
        try:
            attempt = sp.claim()
        except CorruptSpool as exc:
            assert_names_a_file(exc, root)
            return
        if attempt is None:
            return
        with attempt:
            try:
                data = attempt.read_data()
            except CorruptSpool as exc:
                assert_names_a_file(exc, root)
                continue
            assert body_is_intact(data), f"wrong body data handed out for {attempt.msg_id}"
            assert len(data) == attempt.envelope.body_size


# --- the damage ------------------------------------------------------------------------


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != fmt.LOCK_NAME)


def flip_bit(rng: random.Random) -> Damage:
    def damage(root: Path) -> str:
        path = rng.choice(files_of(root))
        data = bytearray(path.read_bytes())
        at = rng.randrange(len(data))
        data[at] ^= 1 << rng.randrange(8)
        path.write_bytes(bytes(data))
        return f"bit flip in {path.name} at {at}"

    return damage


def zero_page(rng: random.Random) -> Damage:
    def damage(root: Path) -> str:
        path = rng.choice(files_of(root))
        data = bytearray(path.read_bytes())
        page = rng.randrange(max(1, len(data) // 4096 + 1))
        data[page * 4096 : (page + 1) * 4096] = bytes(len(data[page * 4096 : (page + 1) * 4096]))
        path.write_bytes(bytes(data))
        return f"zeroed page {page} of {path.name}"

    return damage


def truncate(seg: int, size: int) -> Damage:
    def damage(root: Path) -> str:
        path = root / fmt.LOG_DIR / fmt.segment_name(seg)
        os.truncate(path, size)
        return f"segment {seg} truncated to {size}"

    return damage


def newest_frame_starts(truth: Truth) -> list[int]:
    seg = truth.segments[-1]
    cursor = LogCursor(FileSystem(), str(truth.path / fmt.LOG_DIR), Position(seg, 0))
    starts = [pos.offset for pos, _frame in cursor]
    cursor.close()
    return starts


def damage_cases(truth: Truth) -> list[tuple[str, Damage, bool]]:
    """(id, damage, whether to run the CLI too); seeded, so every run is the same."""
    rng = random.Random(1234)
    cases: list[tuple[str, Damage, bool]] = []
    cases += [(f"flip{i}", flip_bit(rng), True) for i in range(60)]
    cases += [(f"zero{i}", zero_page(rng), True) for i in range(15)]
    newest = truth.segments[-1]
    size = truth.seg_path(truth.path, newest).stat().st_size
    starts = newest_frame_starts(truth)
    # Every offset of the last frames (at most the last 300 bytes), then a sample.
    last_frames_from = max(starts[-2] if len(starts) >= 2 else 0, size - 300)
    for cut in range(last_frames_from, size):
        cases.append((f"cut-newest-{cut}", truncate(newest, cut), cut % 37 == 0))
    for cut in sorted(rng.sample(range(last_frames_from), min(40, last_frames_from))):
        cases.append((f"cut-newest-{cut}", truncate(newest, cut), cut % 5 == 0))
    for seg in truth.segments[:-1]:
        seg_size = truth.seg_path(truth.path, seg).stat().st_size
        cut = rng.randrange(seg_size)
        cases.append((f"cut-{seg}-{cut}", truncate(seg, cut), True))

    def garbage(seg: int, zeros: bool) -> Damage:
        def damage(root: Path) -> str:
            extra = (
                bytes(rng.randrange(1, 3000)) if zeros else rng.randbytes(rng.randrange(1, 3000))
            )
            with open(root / fmt.LOG_DIR / fmt.segment_name(seg), "ab") as f:
                f.write(extra)
            return f"{len(extra)} {'zero' if zeros else 'random'} bytes appended to {seg}"

        return damage

    for k in range(4):
        cases.append((f"garbage-newest-{k}", garbage(newest, zeros=k == 0), True))
    cases.append(("garbage-older", garbage(truth.segments[-3], zeros=False), True))

    def delete_segment(seg: int) -> Damage:
        def damage(root: Path) -> str:
            (root / fmt.LOG_DIR / fmt.segment_name(seg)).unlink()
            return f"segment {seg} deleted"

        return damage

    for seg in truth.segments[1:-1]:
        cases.append((f"delete-seg-{seg}", delete_segment(seg), True))

    def positions(how: str) -> Damage:
        def damage(root: Path) -> str:
            path = root / fmt.POSITIONS_NAME
            raw = path.read_bytes()
            if how == "delete":
                path.unlink()
            elif how == "truncate":
                path.write_bytes(raw[: len(raw) // 2])
            elif how == "garbage":
                path.write_bytes(rng.randbytes(len(raw)))
            elif how == "empty":
                path.write_bytes(b"")
            elif how == "past-end":
                # A well-formed file whose positions lie beyond the log: must not be trusted.
                from spool.positions import decode_positions, encode_positions

                old = decode_positions(raw)
                assert old is not None
                far = Position(old.consistent.segment + 50, 32)
                path.write_bytes(encode_positions(attrs.evolve(old, consistent=far)))
            return f"positions {how}"

        return damage

    for how in ("delete", "truncate", "garbage", "empty", "past-end"):
        cases.append((f"positions-{how}", positions(how), True))

    def body(how: str, k: int) -> Damage:
        def damage(root: Path) -> str:
            bodies = sorted((root / fmt.BODY_DIR).iterdir())
            path = bodies[k % len(bodies)]
            raw = bytearray(path.read_bytes())
            if how == "flip":
                raw[rng.randrange(len(raw))] ^= 0x10
                path.write_bytes(bytes(raw))
            elif how == "truncate":
                path.write_bytes(bytes(raw[: rng.randrange(len(raw))]))
            elif how == "delete":
                path.unlink()
            elif how == "extend":
                path.write_bytes(bytes(raw) + b"\0" * 100)
            return f"body {path.name} {how}"

        return damage

    for k in range(6):
        for how in ("flip", "truncate", "delete", "extend"):
            cases.append((f"body-{how}-{k}", body(how, k), k < 2))
    cases.append(("header-of-newest", _header_damage(newest), True))
    cases.append(("header-of-oldest", _header_damage(truth.segments[0]), True))
    return cases


def _header_damage(seg: int) -> Damage:
    def damage(root: Path) -> str:
        path = root / fmt.LOG_DIR / fmt.segment_name(seg)
        data = bytearray(path.read_bytes())
        salt = segment_salt(bytes(data[: fmt.SEGMENT_HEADER_SIZE]))
        data[: fmt.SEGMENT_HEADER_SIZE] = segment_header(seg + 1, salt)  # valid, wrong number
        path.write_bytes(bytes(data))
        return f"segment {seg} header names another segment"

    return damage


def changed_ranges(before: Path, after: Path) -> set[tuple[str, int, int]]:
    """(file name, start, end) of every byte that differs or is missing in ``after``."""
    out: set[tuple[str, int, int]] = set()
    for path in before.rglob("*"):
        if not path.is_file():
            continue
        old = path.read_bytes()
        other = after / path.relative_to(before)
        new = other.read_bytes() if other.exists() else b""
        if old == new:
            continue
        common = min(len(old), len(new))
        first = next((i for i in range(common) if old[i] != new[i]), common)
        last = next((i for i in range(common - 1, first - 1, -1) if old[i] != new[i]), first - 1)
        if last >= first:
            out.add((path.name, first, last + 1))
        if len(new) < len(old):
            out.add((path.name, len(new), len(old)))
    return out


def copy_linking(src: str, dst: str) -> None:
    """Copy a spool file, but hard-link body files (for damage that never writes one)."""
    if os.path.basename(os.path.dirname(src)) == fmt.BODY_DIR:
        os.link(src, dst)
    else:
        shutil.copy2(src, dst)


def test_every_damaged_copy_is_recovered_refused_or_quarantined_never_misread(
    truth: Truth, tmp_path: Path
) -> None:
    outcomes: dict[str, int] = {}
    cases = damage_cases(truth)
    assert len(cases) > 300
    for name, damage, cli in cases:
        root = tmp_path / "copy"
        if root.exists():
            shutil.rmtree(root)
        # Truncations never write a body file: those copies share them by hard link.
        shutil.copytree(
            truth.path,
            root,
            copy_function=copy_linking if name.startswith("cut-") else shutil.copy2,
        )
        what = damage(root)
        damaged = changed_ranges(truth.path, root)
        try:
            outcome = check_damaged(root, truth, damaged, cli)
        except AssertionError as exc:
            raise AssertionError(f"case {name} ({what}): {exc}") from exc
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    print(f"\ncorruption: {len(cases)} damaged copies: {outcomes}")
    assert outcomes.get("refused", 0) > 0 and outcomes.get("recovered", 0) > 0
    assert outcomes.get("cut", 0) > 0


# --- fuzzing the scanner and the decoder -------------------------------------------------

FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SAMPLE_RECORDS: list[rec.Record] = [
    rec.Envelope(
        "6B0357990E172DB3",
        "a@example.org",
        ("b@example.net", "c@example.net"),
        accepted_at=1.8e9,
        written_at=1.8e9,
        body=rec.BodyRef(rec.BODY_INLINE, 10),
    ),
    rec.Start("6B0357990E172DB3", Position(3, 32), 0, 1.8e9),
    rec.Delta("6B0357990E172DB3", rec.DELIVERED, ("b@example.net",), "250 ok", 1.8e9),
    rec.Finish("6B0357990E172DB3", 1.8e9, rec.BodyRef(rec.BODY_FILE, 10), (), "done"),
    rec.Control("outcome-ack", "6B0357990E172DB3", 1.8e9),
]
VALID_FRAMES = [encode_frame(*rec.encode(r)) for r in SAMPLE_RECORDS] + [
    encode_frame(fmt.T_BODY, rec.encode_body("6B0357990E172DB3", b"0123456789")),
    encode_frame(fmt.T_PAD, bytes(40)),
]


def scan_all(data: bytes, chunks: list[int]) -> list[Frame | BadFrame]:
    """Scan ``data`` fed in pieces of the given sizes; every frame, then the bad one."""
    scanner = Scanner()
    out: list[Frame | BadFrame] = []
    fed = 0
    sizes = iter(chunks)
    while True:
        result = scanner.next()
        if isinstance(result, Frame):
            out.append(result)
            continue
        if isinstance(result, BadFrame):
            out.append(result)
            return out
        assert result is NEED_DATA
        if fed >= len(data):
            return out
        step = max(1, next(sizes, len(data)))
        scanner.feed(data[fed : fed + step])
        fed += step


def decode_checked(frame: Frame) -> None:
    """Decode a checked frame: a record or ``RecordError``, nothing else."""
    with contextlib.suppress(rec.RecordError):
        if frame.type == fmt.T_BODY:
            rec.decode_body(frame.payload)
        elif frame.type != fmt.T_PAD:
            rec.decode(frame.type, frame.payload)


@FUZZ
@given(st.binary(max_size=4096), st.lists(st.integers(1, 600), max_size=20))
def test_scanner_and_decoder_on_arbitrary_bytes_raise_nothing_unexpected(
    data: bytes, chunks: list[int]
) -> None:
    whole = scan_all(data, [len(data)])
    assert scan_all(data, chunks) == whole, "chunking changed what was parsed"
    for item in whole:
        if isinstance(item, Frame):
            decode_checked(item)


@FUZZ
@given(
    st.lists(st.sampled_from(range(len(VALID_FRAMES))), min_size=1, max_size=8),
    st.lists(
        st.tuples(st.sampled_from(["flip", "insert", "delete", "zero"]), st.integers(0, 10**6)),
        min_size=1,
        max_size=4,
    ),
    st.randoms(use_true_random=False),
)
def test_mutated_valid_frames_are_never_misread(
    picks: list[int], mutations: list[tuple[str, int]], rnd: random.Random
) -> None:
    data = bytearray(b"".join(VALID_FRAMES[i] for i in picks))
    for kind, at in mutations:
        at %= len(data) + 1
        if kind == "flip" and at < len(data):
            data[at] ^= 1 << rnd.randrange(8)
        elif kind == "insert":
            data[at:at] = rnd.randbytes(rnd.randrange(1, 20))
        elif kind == "delete":
            del data[at : at + rnd.randrange(1, 20)]
        elif kind == "zero":
            data[at : at + 512] = bytes(len(data[at : at + 512]))
    originals = {
        (f.type, f.payload)
        for f in map(lambda b: parse_frame(b, 0), VALID_FRAMES)
        if isinstance(f, Frame)
    }
    for item in scan_all(bytes(data), [rnd.randrange(1, 64) for _ in range(40)]):
        if isinstance(item, Frame):
            assert (item.type, item.payload) in originals, "a damaged frame passed its check"
            decode_checked(item)


@settings(max_examples=max(20, FUZZ_EXAMPLES // 10), deadline=None)
@given(st.binary(max_size=3000), st.booleans())
def test_reader_over_a_segment_of_arbitrary_bytes_yields_frames_a_tear_or_corruption(
    tail: bytes, newest: bool
) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        log_dir = os.path.join(tmp, fmt.LOG_DIR)
        os.mkdir(log_dir)
        # VALID_FRAMES are framed with salt 0: segments salted 0 read them.
        Path(log_dir, fmt.segment_name(1)).write_bytes(
            segment_header(1, 0) + VALID_FRAMES[0] + tail
        )
        if not newest:
            Path(log_dir, fmt.segment_name(2)).write_bytes(segment_header(2, 0))
        cursor = LogCursor(FileSystem(), log_dir, Position(1, 0), newest_segment=2 - newest)
        try:
            frames = [f for _p, f in cursor]
        except CorruptSpool as exc:
            assert exc.path.endswith(fmt.segment_name(1)) and exc.offset >= 0
            return
        finally:
            cursor.close()
        assert frames, "the valid first frame was dropped"
        for frame in frames:
            assert isinstance(frame, Frame)
            decode_checked(frame)
