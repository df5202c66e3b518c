"""Bad input and misuse: a clear, typed error, and not a byte changed on disk.

Goal: contract item 7 beyond what tests/integration/test_api.py already covers: every
invalid address form, size and count limits at and past their edge, data that is not
bytes, reports that make no sense, use after close, a second owner that is another
process, a directory owned by someone else or not private, a path through a file, a
read-only file system and a full disk (real ones where this machine lets us mount a
tmpfs, simulated with ``FaultFS`` otherwise and in addition).

Method: real spools in tmp dirs; ``tree_snapshot`` of the spool before and after each
refused call (after ``sync`` so that no bookkeeping is in flight). Internationalised
addresses (SMTPUTF8) are accepted when valid: UTF-8 local parts, IDNA2008 domains.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spool import (
    BadSpoolDirectory,
    DiskFull,
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    Spool,
    SpoolClosed,
    SpoolFailed,
    SpoolLocked,
)
from spool.directory import user_name
from spool.testing import FaultFS, tree_snapshot

ROOT = Path(__file__).resolve().parents[2]
OK = "bob@example.net"
LABEL63 = "a" * 63

INVALID_ADDRESSES: list[tuple[object, str]] = [
    ("bob@example.net\x00", "NUL"),
    ("bob\r@example.net", "CR"),
    ("bob@example.net\n", "LF"),
    ("bob@exa\r\nmple.net", "CRLF"),
    ("a" * 65 + "@example.net", "local part longer than 64"),
    ("b@" + ".".join([LABEL63] * 4) + ".net", "domain longer than 255"),
    ("a" * 64 + "@" + ".".join([LABEL63] * 3) + ".example.net", "path longer than 256"),
    ("b@" + "a" * 64 + ".net", "label longer than 63"),
    ("bobexample.net", "missing @"),
    ("@example.net", "missing local part"),
    ("bob@", "missing domain"),
    ("bob@@example.net", "two @"),
    ("bo b@example.net", "space in local part"),
    ("bob.@example.net", "dot at the end of the local part"),
    ("bob@-example.net", "label starts with a hyphen"),
    ("bob@example..net", "empty label"),
    ("bob@[192.0.2.1", "unclosed address literal"),
    ("bob@ex\u2603mple.net", "domain that is not IDNA2008"),
    ("b\x85ob@example.net", "C1 control in the local part"),
    ("<bob@example.net>", "angle brackets"),
    (b"bob@example.net", "bytes"),
    (None, "None"),
    (42, "an int"),
]


@pytest.fixture
def quiet(spool_dir: str) -> Iterator[Spool]:
    """An open spool with one message in it, synced: a stable tree to compare."""
    sp = Spool.open(spool_dir, max_message_size=10_000, max_recipients=5, inline_body_max=1000)
    sp.accept("alice@example.org", [OK], b"first")
    sp.sync()
    yield sp
    sp.close()


def refused(
    sp: Spool, error: type[Exception], call: Callable[[], Any], match: str | None = None
) -> None:
    """``call`` raises ``error`` and leaves every file of the spool as it was."""
    sp.sync()
    before = tree_snapshot(sp.path)
    with pytest.raises(error, match=match):
        call()
    with contextlib.suppress(SpoolClosed, SpoolFailed):
        sp.sync()
    assert tree_snapshot(sp.path) == before


@pytest.mark.parametrize(
    ("address", "why"), INVALID_ADDRESSES, ids=[w for _, w in INVALID_ADDRESSES]
)
def test_every_invalid_recipient_form_is_refused_and_writes_nothing(
    quiet: Spool, address: object, why: str
) -> None:
    refused(quiet, InvalidAddress, lambda: quiet.accept("alice@example.org", [OK, address], b"x"))  # type: ignore[list-item]


@pytest.mark.parametrize(
    ("address", "why"), INVALID_ADDRESSES, ids=[w for _, w in INVALID_ADDRESSES]
)
def test_every_invalid_sender_form_is_refused_and_writes_nothing(
    quiet: Spool, address: object, why: str
) -> None:
    refused(quiet, InvalidAddress, lambda: quiet.accept(address, [OK], b"x"))  # type: ignore[arg-type]


def test_internationalised_addresses_are_accepted_and_compared_in_a_label_form(
    quiet: Spool,
) -> None:
    msg_id = quiet.accept("jörg@example.org", ["ann@bücher.example", "用户@例子.广告"], b"x")
    assert msg_id
    # The same mailbox twice, once in U-labels and once in A-labels: a duplicate.
    refused(
        quiet,
        InvalidMessage,
        lambda: quiet.accept(
            "a@example.org", ["b@bücher.example", "b@xn--bcher-kva.example"], b"x"
        ),
        "duplicate",
    )


def test_addresses_exactly_at_the_length_limits_are_accepted(quiet: Spool) -> None:
    local64 = "a" * 64 + "@example.net"
    path256 = "a" * 64 + "@" + ".".join([LABEL63] * 3)
    assert len(path256) == 256
    quiet.accept(
        "alice@example.org", [local64, path256, "c@[192.0.2.1]", '"x y"@example.net'], b"x"
    )
    refused(quiet, InvalidAddress, lambda: quiet.accept("alice@example.org", ["a" + path256], b"x"))


def test_data_at_the_size_limit_is_accepted_and_one_byte_more_is_refused(quiet: Spool) -> None:
    quiet.accept("alice@example.org", [OK], b"x" * 10_000)  # a body file (over 1000)
    refused(quiet, MessageTooLarge, lambda: quiet.accept("alice@example.org", [OK], b"x" * 10_001))


def test_recipient_count_at_the_limit_is_accepted_and_one_more_is_refused(quiet: Spool) -> None:
    quiet.accept("alice@example.org", [f"r{i}@example.net" for i in range(5)], b"x")
    six = [f"r{i}@example.net" for i in range(6)]
    refused(quiet, MessageTooLarge, lambda: quiet.accept("alice@example.org", six, b"x"))


@pytest.mark.parametrize(
    "rcpts",
    [
        [OK, OK],
        ["a@example.net", OK, "a@example.net"],
        iter([OK, OK]),
        ["a@example.net", "a@EXAMPLE.Net"],
    ],
    ids=["twice", "twice-apart", "generator", "domain-case"],
)
def test_duplicate_recipients_are_refused(quiet: Spool, rcpts: Any) -> None:
    refused(
        quiet, InvalidMessage, lambda: quiet.accept("alice@example.org", rcpts, b"x"), "duplicate"
    )


def test_local_parts_that_differ_in_case_are_different_recipients(quiet: Spool) -> None:
    # Only the destination host may interpret a local part (RFC 5321 2.4).
    quiet.accept("alice@example.org", ["Bob@example.net", "bob@example.net"], b"x")


@pytest.mark.parametrize(
    "data",
    [bytearray(b"x"), memoryview(b"x"), "x", None, 42, [b"x"]],
    ids=lambda d: type(d).__name__,
)
def test_data_that_is_not_bytes_is_refused(quiet: Spool, data: object) -> None:
    refused(quiet, InvalidMessage, lambda: quiet.accept("alice@example.org", [OK], data))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("report", "match"),
    [
        (lambda a: a.delivered(["nobody@example.net"], "250 ok"), "not pending"),
        (lambda a: a.failed([OK, OK], "550 no"), "twice"),
        (lambda a: a.deferred([], "451 later"), "no recipients"),
        (lambda a: a.delivered(OK, "250 ok"), "not one string"),
        (lambda a: a.delivered([OK], b"250 ok"), "reply must be a str"),
        (lambda a: a.delivered([OK.upper()], "250 ok"), "not pending"),
    ],
    ids=["unknown", "listed-twice", "empty", "a-string", "bytes-reply", "other-case"],
)
def test_nonsense_reports_are_value_errors_and_write_nothing(
    quiet: Spool, report: Callable[[Any], None], match: str
) -> None:
    attempt = quiet.claim()
    assert attempt is not None
    refused(quiet, ValueError, lambda: report(attempt), match)
    attempt.delivered([OK], "250 ok")  # still usable afterwards
    refused(quiet, ValueError, lambda: attempt.failed([OK], "550 no"), "already reported")
    attempt.close()


def test_every_call_on_a_closed_spool_or_attempt_is_refused_and_writes_nothing(
    spool_dir: str,
) -> None:
    sp = Spool.open(spool_dir)
    msg_id = sp.accept("alice@example.org", [OK, "carol@example.net"], b"x")
    attempt = sp.claim()
    assert attempt is not None
    attempt.delivered([OK], "250 ok")
    sp.close()
    before = tree_snapshot(spool_dir)
    calls: list[Callable[[], object]] = [
        lambda: sp.accept("alice@example.org", [OK], b"x"),
        sp.claim,
        sp.sync,
        sp.checkpoint,
        lambda: list(sp.list()),
        lambda: sp.show(msg_id),
        lambda: sp.hold(msg_id),
        lambda: sp.release(msg_id),
        lambda: sp.delete(msg_id),
        lambda: sp.retry_now(msg_id),
        attempt.read_data,
        lambda: attempt.failed(["carol@example.net"], "550 no"),
        lambda: attempt.deferred(["carol@example.net"], "451 later"),
    ]
    for call in calls:
        with pytest.raises(SpoolClosed):
            call()
    sp.close()  # idempotent
    attempt.close()
    assert tree_snapshot(spool_dir) == before


def test_a_closed_attempt_refuses_every_report_and_read(quiet: Spool) -> None:
    attempt = quiet.claim()
    assert attempt is not None
    attempt.close()
    for call in (
        attempt.read_data,
        lambda: attempt.delivered([OK], "250 ok"),
        lambda: attempt.failed([OK], "550 no"),
        lambda: attempt.deferred([OK], "451 later"),
    ):
        refused(quiet, SpoolClosed, call)


def test_operator_actions_on_unknown_messages_are_key_errors(quiet: Spool) -> None:
    for call in (quiet.hold, quiet.release, quiet.delete, quiet.retry_now, quiet.show):
        refused(quiet, KeyError, lambda c=call: c("0000000000000000"))  # type: ignore[misc]
    msg_id = next(iter(quiet.list())).msg_id
    refused(quiet, ValueError, lambda: quiet.release(msg_id), "not held")


def test_an_owner_in_another_process_is_named_and_its_death_frees_the_spool(
    spool_dir: str,
) -> None:
    with Spool.open(spool_dir) as sp:
        sp.accept("alice@example.org", [OK], b"x")
    owner = subprocess.Popen(
        [sys.executable, "-m", "tests.contract.children", "hold-open", spool_dir],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout is not None and owner.stdout.readline().strip() == "open"
        before = tree_snapshot(spool_dir)
        with pytest.raises(SpoolLocked) as info:
            Spool.open(spool_dir)
        assert info.value.pid == owner.pid and str(owner.pid) in str(info.value)
        assert tree_snapshot(spool_dir) == before
    finally:
        owner.send_signal(signal.SIGKILL)
        owner.wait()
    with Spool.open(spool_dir) as sp:  # the kernel dropped the lock with its holder
        assert len(list(sp.list())) == 1


def test_a_second_handle_in_the_same_process_is_refused_after_a_close_and_reopen(
    spool_dir: str,
) -> None:
    first = Spool.open(spool_dir)
    first.close()
    second = Spool.open(spool_dir)
    try:
        with pytest.raises(SpoolLocked):
            Spool.open(spool_dir)
    finally:
        second.close()


def test_a_spool_directory_owned_by_another_user_is_refused_untouched(spool_dir: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("changing a directory's owner needs root")
    with Spool.open(spool_dir) as sp:
        sp.accept("alice@example.org", [OK], b"x")
    before = tree_snapshot(spool_dir)
    os.chown(spool_dir, 65534, 65534)
    owner = user_name(65534)  # "nobody", or "uid 65534" where the user has no name
    with pytest.raises(BadSpoolDirectory, match=f"owned by {owner}.*run the command as {owner}"):
        Spool.open(spool_dir)
    assert tree_snapshot(spool_dir) == before


@pytest.mark.parametrize("mode", [0o770, 0o702, 0o722])
def test_a_spool_directory_others_can_write_is_refused_untouched(spool_dir: str, mode: int) -> None:
    with Spool.open(spool_dir) as sp:
        sp.accept("alice@example.org", [OK], b"x")
    before = tree_snapshot(spool_dir)
    os.chmod(spool_dir, mode)
    with pytest.raises(BadSpoolDirectory, match="lets others write"):
        Spool.open(spool_dir)
    assert tree_snapshot(spool_dir) == before


@pytest.mark.parametrize("below", ["spool", "a/b/spool"])
def test_a_path_through_a_file_is_a_bad_directory_not_an_os_error(
    tmp_path: Path, below: str
) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(BadSpoolDirectory):
        Spool.open(tmp_path / "file" / below)
    assert (tmp_path / "file").read_text() == "x"


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A real tmpfs of ``size`` at ``path``, or a skip if this machine forbids mounting."""
    path.mkdir()
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.strip()}); FaultFS tests cover it")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True)


def remount(path: Path, options: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True)


def test_a_read_only_file_system_is_refused_for_a_new_and_an_existing_spool(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        spool_dir = mnt / "spool"
        with Spool.open(spool_dir, min_free_bytes=0) as sp:  # a 4 MiB disk: no reserve
            sp.accept("alice@example.org", [OK], b"x")
        remount(mnt, "ro")
        before = tree_snapshot(str(mnt))
        with pytest.raises(BadSpoolDirectory, match="read-only"):
            Spool.open(spool_dir)
        with pytest.raises(BadSpoolDirectory, match="Read-only file system"):
            Spool.open(mnt / "new-spool")
        assert tree_snapshot(str(mnt)) == before
        remount(mnt, "rw")
        with Spool.open(spool_dir) as sp:
            assert len(list(sp.list())) == 1


def test_a_read_only_file_system_under_an_open_spool_stops_it_with_erofs(
    spool_dir: str,
) -> None:
    fs = FaultFS()
    sp = Spool.open(spool_dir, fs=fs)
    kept = sp.accept("alice@example.org", [OK], b"x")
    fs.fail("pwrite", err=errno.EROFS)
    with pytest.raises(SpoolFailed) as info:
        sp.accept("alice@example.org", [OK], b"y")
    assert info.value.errno == errno.EROFS
    sp.close()
    with Spool.open(spool_dir) as again:
        assert [e.msg_id for e in again.list()] == [kept]


def test_a_full_disk_under_the_log_stops_the_spool_and_changes_nothing(spool_dir: str) -> None:
    fs = FaultFS()
    sp = Spool.open(spool_dir, fs=fs)
    kept = sp.accept("alice@example.org", [OK], b"x")
    sp.sync()
    fs.fail("pwrite", err=errno.ENOSPC)
    refused(sp, SpoolFailed, lambda: sp.accept("alice@example.org", [OK], b"y"), "No space")
    sp.close()
    with Spool.open(spool_dir) as again:
        assert [e.msg_id for e in again.list()] == [kept]


def test_a_full_disk_under_a_body_file_is_disk_full_and_leaves_no_partial_file(
    spool_dir: str,
) -> None:
    fs = FaultFS()
    with Spool.open(spool_dir, fs=fs, inline_body_max=100) as sp:
        sp.accept("alice@example.org", [OK], b"x")
        fs.fail("pwrite", err=errno.ENOSPC, sticky=False)
        refused(sp, DiskFull, lambda: sp.accept("alice@example.org", [OK], b"y" * 500), "452")
        sp.accept("alice@example.org", [OK], b"z" * 500)  # space came back: mail flows again
        assert len(list(sp.list())) == 2


def test_a_real_full_file_system_gives_typed_errors_and_loses_nothing_acknowledged(
    tmp_path: Path,
) -> None:
    with tmpfs(tmp_path / "mnt", "1m") as mnt:
        spool_dir = mnt / "spool"
        # No reserve: the disk itself must run full (test_disk_full.py tests the reserve).
        sp = Spool.open(spool_dir, inline_body_max=50_000, segment_size=64 * 1024, min_free_bytes=0)
        acked: list[str] = []
        errors: list[Exception] = []
        for i in range(200):
            data = os.urandom(120_000 if i % 3 == 0 else 3_000)
            before = tree_snapshot(str(spool_dir))
            try:
                acked.append(sp.accept("alice@example.org", [f"r{i}@example.net"], data))
            except DiskFull as exc:
                errors.append(exc)
                assert tree_snapshot(str(spool_dir)) == before  # refused: nothing changed
            except SpoolFailed as exc:
                assert exc.errno == errno.ENOSPC
                errors.append(exc)
                break
        assert errors and acked, "the file system never filled up"
        sp.close()  # a full disk makes the last checkpoint fail; close must still finish
        remount(mnt, "size=8m")
        with Spool.open(spool_dir) as again:
            assert {e.msg_id for e in again.list()} == set(acked)
            assert again.accept("alice@example.org", [OK], b"room again")


def test_a_segment_this_user_may_not_read_is_refused_never_called_damage() -> None:
    # Before: the reader named another user's segment (mode 0600) "corrupt spool file ...
    # not a segment file (Permission denied)" and sent the operator to `spool check
    # --repair`, which would have set the segment, and the mail in it, aside. Run as the
    # spool's own user (nobody), in a child that dropped to it after its imports.
    if os.geteuid() != 0:
        pytest.skip("another user's file needs root to make")
    import shutil
    import tempfile

    from spool.cli import main

    top = Path(tempfile.mkdtemp(prefix="spool-foreign-"))  # not under root's own 0700 tree
    try:
        os.chmod(top, 0o755)
        root = top / "spool"
        with Spool.open(root) as sp:
            sp.accept("alice@example.org", [OK], b"x" * 300)
        for path in [*root.rglob("*"), root]:
            os.chown(path, 65534, 65534)
        (segment,) = (root / "log").iterdir()
        os.chown(segment, 0, 0)  # root's, mode 0600: nobody may not read it
        run_as_nobody(main, root, segment)
    finally:
        shutil.rmtree(top)


def run_as_nobody(main: Callable[..., Any], root: Path, segment: Path) -> None:
    """Each command as nobody: refused with the one line, nothing changed."""
    before = tree_snapshot(str(root))
    for command in (["list"], ["recover"], ["check"], ["check", "--repair"]):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: nobody, then the command; its output to the pipe
            os.close(read)
            sys.stdout = sys.stderr = os.fdopen(write, "w")  # not the test's captured ones
            code = 3
            try:
                os.setgid(65534)
                os.setuid(65534)
                main([*command, str(root)], standalone_mode=True)
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 3
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        os.close(write)
        with os.fdopen(read) as f:
            said = f.read()
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 1, said
        assert f"cannot read {segment}: Permission denied; its owner or mode" in said, said
        assert "corrupt" not in said and "Not damage" in said
    after = tree_snapshot(str(root))
    assert after.pop("lock") and before.pop("lock")  # it names the last pid to take it
    assert after == before


def test_check_names_files_in_the_log_directory_that_are_not_segments(tmp_path: Path) -> None:
    # Before: silent (the spool never reads them, and an operator wondered whether their
    # copy had been checked).
    root = tmp_path / "spool"
    with Spool.open(root) as sp:
        sp.accept("alice@example.org", [OK], b"x" * 300)
    (root / "log" / "README").write_text("notes\n")
    (root / "log" / "00000000000000000001.seg.bak").write_bytes(b"copy")
    before = tree_snapshot(str(root))
    done = subprocess.run(
        [sys.executable, "-m", "spool.cli", "check", str(root)],
        capture_output=True, text=True, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "note: 2 file(s) in log/ not named as segments, not read: "
        "00000000000000000001.seg.bak, README"
    ) in done.stdout
    assert tree_snapshot(str(root)) == before
