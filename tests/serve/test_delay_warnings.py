"""Delay warnings (``spool serve --delay-warning``): one RFC 3464 ``delayed`` report per
message still queued after the delay, kept "once" across restarts by ``delay-warned``."""

from __future__ import annotations

import email
import email.policy
import errno
import subprocess
import sys
import time
from email.message import EmailMessage
from pathlib import Path

import pytest

import spool
from spool import Spool, delay_warnings
from spool import format as fmt
from spool.attempts import UNREPORTED_REPLY
from spool.delay_warnings import DelayWarner, read_warned
from spool.fs import FileSystem
from spool.testing.doubles import FaultFS
from tests.serve.running import ROOT, child_env, owner

HOUR = 3600.0
GREYLISTED = "451 4.7.1 greylisted, try again later"
FS = FileSystem()


def warnings_to(sp: Spool, sender: str) -> dict[str, EmailMessage]:
    """The warnings queued for ``sender`` (from the null sender), parsed, by the id of the
    message each is about. Claims every due message to read them, and closes it again."""
    found: dict[str, EmailMessage] = {}
    attempts = []
    while (attempt := sp.claim()) is not None:
        attempts.append(attempt)
        if attempt.envelope.sender == "" and attempt.envelope.recipients == (sender,):
            msg = email.message_from_bytes(attempt.read_data(), policy=email.policy.default)
            assert isinstance(msg, EmailMessage)
            if msg["Subject"] == "Delayed Mail (still being retried)":
                _text, status = msg.iter_parts()
                found[status.get_payload()[0]["X-Spool-Queue-ID"]] = msg
    for attempt in attempts:
        attempt.close()
    return found


def test_each_late_message_warns_its_sender_once_across_restarts(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    with Spool.open(d) as sp:
        late = sp.accept("a@example.org", ["b@example.net", "c@example.net"], b"Subject: 1\r\n\r\n")
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == late
        attempt.deferred(["b@example.net"], GREYLISTED)
        attempt.close()  # c@ not reported: deferred with the spool's own reply
        never = sp.accept("a@example.org", ["d@example.net"], b"Subject: 2\r\n\r\n")
        sp.accept("", ["a@example.org"], b"a bounce: never warned about")
        held = sp.accept("a@example.org", ["e@example.net"], b"held by the operator")
        sp.hold(held, "wait")
        accepted = max(e.accepted_at for e in sp.list())
        warner = DelayWarner(sp, str(d), "mx.example.org", HOUR)
        warner.start()
        try:
            assert warner.look(now=accepted + HOUR - 1) == 0  # not yet
            assert warner.look(now=accepted + HOUR) == 2  # late and never, nothing else
            assert warner.look(now=accepted + 2 * HOUR) == 0  # once
        finally:
            warner.stop()
        assert read_warned(FS, str(d / fmt.DELAY_WARNED_NAME)) == {late, never}
    with Spool.open(d) as sp:  # a restart: the marks are on disk
        again = DelayWarner(sp, str(d), "mx.example.org", HOUR)
        again.start()
        try:
            assert again.look(now=accepted + 3 * HOUR) == 0
        finally:
            again.stop()
        warnings = warnings_to(sp, "a@example.org")
    assert sorted(warnings) == sorted([late, never])
    msg = warnings[late]
    assert msg["To"].addresses[0].addr_spec == "a@example.org"
    assert msg["Auto-Submitted"] == "auto-replied"
    text, status = msg.iter_parts()
    assert "THIS IS A WARNING ONLY" in text.get_content()
    assert "<b@example.net>: 451 4.7.1 greylisted" in text.get_content()
    _per_message, *blocks = status.get_payload()
    fields = ("Final-Recipient", "Action", "Status", "Diagnostic-Code")
    assert [tuple(b[f] for f in fields) for b in blocks] == [
        ("rfc822; b@example.net", "delayed", "4.7.1", f"smtp; {GREYLISTED}"),
        ("rfc822; c@example.net", "delayed", "4.4.0", f"smtp; {UNREPORTED_REPLY}"),
    ]  # fmt: skip
    assert all(b["Will-Retry-Until"] for b in blocks)
    _text, status = warnings[never].iter_parts()
    [block] = status.get_payload()[1:]
    assert (block["Status"], block["Diagnostic-Code"]) == ("4.0.0", None)  # not attempted


def test_a_torn_mark_is_skipped_and_gone_ids_are_pruned_at_start(tmp_path: Path) -> None:
    d = tmp_path / "spool"
    with Spool.open(d) as sp:
        kept = sp.accept("a@example.org", ["b@example.net"], b"x")
        path = d / fmt.DELAY_WARNED_NAME
        # A message warned and long gone, this one, and an append a crash cut short.
        path.write_bytes(b"0000000000000001\n" + kept.encode() + b"\n" + b"00000000000")
        assert read_warned(FS, str(path)) == {"0000000000000001", kept}
        warner = DelayWarner(sp, str(d), "mx.example.org", HOUR)
        warner.start()
        warner.stop()
        assert path.read_bytes() == kept.encode() + b"\n"
        assert warner.look(now=time.time() + 2 * HOUR) == 0  # already warned


def test_serve_warns_after_the_delay_and_not_again_after_a_restart(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    with owner(d, "--delay-warning", "1s"), spool.connect(d) as client:
        late = client.accept("a@example.org", ["b@example.net"], b"Subject: late\r\n\r\n")
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if any(e.sender == "" for e in client.list()):
                break
            time.sleep(0.2)
        warnings = [e for e in client.list() if e.sender == ""]
        assert [e.recipients for e in warnings] == [("a@example.org",)]
    with owner(d, "--delay-warning", "1s"), spool.connect(d) as client:
        time.sleep(2.5)  # two looks or more: the mark holds
        assert [e.msg_id for e in client.list() if e.sender == ""] == [warnings[0].msg_id]
        assert late in [e.msg_id for e in client.list()]


@pytest.mark.parametrize("bad", ["0", "0s", "soon"])
def test_a_delay_warning_that_is_no_time_is_refused(tmp_path: Path, bad: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "spool.cli", "serve", str(tmp_path / "s"), "--delay-warning", bad],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--delay-warning" in proc.stderr, proc.stderr
    assert not (tmp_path / "s").exists()  # nothing made


def test_a_delay_warned_path_that_cannot_be_read_stops_the_start_cleanly(tmp_path: Path) -> None:
    # Found by review: a directory there made the start fail half way, and the cleanup
    # then failed too (joining a thread never started): the owner ignored SIGTERM for
    # ever while its workers went on delivering.
    d = tmp_path / "spool"
    Spool.open(d).close()
    (d / fmt.DELAY_WARNED_NAME).mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "spool.cli", "serve", str(d), "--agent", "demo",
         "--workers", "1", "--delay-warning", "1s"],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode != 0 and "delay-warned: cannot be read" in done.stderr, done.stderr
    assert "move it out of the spool directory" in done.stderr
    with Spool.open(d):  # nothing holds the lock
        pass


def test_a_look_cut_short_by_a_full_disk_prunes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by review: a look that stopped at a refused warning (DiskFull) counted every
    # warned message after it in the queue as gone, rewrote the file without them, and
    # the next look warned all of them again.
    monkeypatch.setattr(delay_warnings, "PRUNE_AFTER", 1)
    d = tmp_path / "spool"
    with Spool.open(d) as sp:
        ids = [sp.accept("a@example.org", [f"r{i}@example.net"], b"x") for i in range(4)]
    (d / fmt.DELAY_WARNED_NAME).write_text("".join(f"{i}\n" for i in ids[1:]))
    accepted = 0.0
    with Spool.open(d, min_free_bytes=2**40) as sp:  # every accept refused: DiskFull
        accepted = max(e.accepted_at for e in sp.list())
        warner = DelayWarner(sp, str(d), "mx.example.org", HOUR)
        warner.start()
        try:
            assert warner.look(now=accepted + HOUR) == 0  # ids[0]'s warning waits
        finally:
            warner.stop()
    assert read_warned(FS, str(d / fmt.DELAY_WARNED_NAME)) == set(ids[1:])
    with Spool.open(d, min_free_bytes=0) as sp:  # (the reserve is recorded: set it back)
        warner = DelayWarner(sp, str(d), "mx.example.org", HOUR)
        warner.start()
        try:
            assert warner.look(now=accepted + HOUR) == 1  # ids[0] alone
        finally:
            warner.stop()


def test_a_mark_that_cannot_be_written_is_logged_and_not_warned_again(tmp_path: Path) -> None:
    # Found by review: an OSError writing the mark killed the warner's thread for good.
    d = tmp_path / "spool"
    with Spool.open(d) as sp:
        msg = sp.accept("a@example.org", ["b@example.net"], b"x")
        accepted = next(e.accepted_at for e in sp.list())
        fs = FaultFS()
        warner = DelayWarner(sp, str(d), "mx.example.org", HOUR, fs=fs)
        warner.start()
        fs.fail("pwrite", err=errno.ENOSPC)
        try:
            assert warner.look(now=accepted + HOUR) == 1
            assert warner.look(now=accepted + HOUR) == 0  # known warned in memory
        finally:
            warner.stop()
        assert fs.failures == 1
    assert msg not in read_warned(FS, str(d / fmt.DELAY_WARNED_NAME))  # again after a start


def test_the_owners_stop_runs_every_step_whatever_fails() -> None:
    # The review's hang came from one failed step skipping the rest of the stop.
    from spool.serving import _all_of

    ran = []

    def fails() -> None:
        ran.append("fails")
        raise RuntimeError("cannot join thread before it is started")

    with pytest.raises(RuntimeError, match="cannot join"):
        _all_of([lambda: ran.append("front"), fails, lambda: ran.append("workers")])
    assert ran == ["front", "fails", "workers"]
