"""The embedding API against real files: round trips, concurrency, errors, reopen."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from spool import (
    BadSpoolDirectory,
    CorruptSpool,
    DiskFull,
    InvalidAddress,
    InvalidMessage,
    MessageTooLarge,
    Spool,
    SpoolClosed,
    SpoolFailed,
    SpoolLocked,
)
from spool import format as fmt
from spool.testing import CountingFS, FakeClock, FaultFS, tree_snapshot

RCPTS = ["bob@example.net", "carol@example.com"]
DATA = b"Subject: hi\r\n\r\nhello\r\n"


def drain(sp: Spool) -> list[tuple[str, tuple[str, ...], bytes]]:
    """Claim every due message, deliver all its recipients, return what was seen."""
    seen = []
    while (attempt := sp.claim()) is not None:
        with attempt:
            seen.append((attempt.msg_id, attempt.envelope.recipients, attempt.read_data()))
            attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
    return seen


def test_accept_claim_deliver_round_trip(sp: Spool) -> None:
    msg_id = sp.accept("alice@example.org", RCPTS, DATA)
    attempt = sp.claim()
    assert attempt is not None
    with attempt:
        env = attempt.envelope
        assert (env.msg_id, env.sender, env.recipients, env.attempts) == (
            msg_id,
            "alice@example.org",
            tuple(RCPTS),
            0,
        )
        assert env.body_size == len(DATA) and attempt.read_data() == DATA
        attempt.delivered(RCPTS, "250 ok")
    assert sp.claim() is None
    stats = sp.statistics()
    assert (stats.accepted, stats.delivered, stats.in_flight) == (1, 2, 0)


def test_large_bodies_go_to_their_own_file_and_read_back(spool_dir: str) -> None:
    big = os.urandom(300_000)
    with Spool.open(spool_dir, inline_body_max=100_000) as sp:
        msg_id = sp.accept("", ["bob@example.net"], big)
        # In incoming/ until a checkpoint covers its envelope, then in bodies/ (bodies.py).
        assert os.listdir(os.path.join(spool_dir, fmt.INCOMING_DIR)) == [msg_id]
        attempt = sp.claim()
        assert attempt is not None and attempt.read_data() == big
        sp.checkpoint()
        assert os.listdir(os.path.join(spool_dir, fmt.INCOMING_DIR)) == []
        assert os.path.exists(os.path.join(spool_dir, fmt.BODY_DIR, msg_id))
        assert attempt.read_data() == big
        attempt.close()


def test_null_sender_is_accepted(sp: Spool) -> None:
    sp.accept("", ["postmaster@example.org"], b"bounce")
    attempt = sp.claim()
    assert attempt is not None and attempt.envelope.sender == ""
    attempt.close()


def test_deferred_recipients_come_back_after_the_retry_interval(
    spool_dir: str, clock: FakeClock
) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[60, 600]) as sp:
        msg_id = sp.accept("alice@example.org", RCPTS, DATA)
        attempt = sp.claim()
        assert attempt is not None
        with attempt:
            attempt.delivered(["bob@example.net"], "250 ok")
            attempt.deferred(["carol@example.com"], "451 try later")
        sp.sync()
        assert sp.claim() is None
        clock.advance(59)
        assert sp.claim() is None
        clock.advance(2)
        again = sp.claim()
        assert again is not None
        assert (again.msg_id, again.envelope.recipients) == (msg_id, ("carol@example.com",))
        assert again.envelope.attempts == 1
        again.close()  # unreported: deferred again, to the next class
        sp.sync()
        clock.advance(61)
        assert sp.claim() is None
        clock.advance(600)
        assert sp.claim() is not None


def test_reopen_after_close_finds_every_pending_message(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock) as sp:
        ids = {sp.accept("alice@example.org", RCPTS, DATA + bytes([i])) for i in range(50)}
        attempt = sp.claim()
        assert attempt is not None
        delivered_id = attempt.msg_id
        with attempt:
            attempt.delivered(RCPTS, "250 ok")
    with Spool.open(spool_dir, clock=clock) as sp:
        seen = drain(sp)
    assert {s[0] for s in seen} == ids - {delivered_id}
    assert all(s[1] == tuple(RCPTS) for s in seen)


def test_open_attempts_at_close_are_deferred_not_lost(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[10]) as sp:
        msg_id = sp.accept("alice@example.org", RCPTS, DATA)
        attempt = sp.claim()
        assert attempt is not None
        attempt.delivered(["bob@example.net"], "250 ok")
    clock.advance(11)
    with Spool.open(spool_dir, clock=clock, retry_intervals=[10]) as sp:
        assert sp.recovery.working_found == 0
        again = sp.claim()
        assert again is not None
        assert (again.msg_id, again.envelope.recipients) == (msg_id, ("carol@example.com",))
        again.close()


def test_concurrent_accepts_and_claims_lose_and_duplicate_nothing(spool_dir: str) -> None:
    n_producers, per_producer, n_workers = 16, 40, 4
    accepted: list[str] = []
    delivered: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    with Spool.open(spool_dir) as sp:

        def produce(p: int) -> None:
            for i in range(per_producer):
                msg_id = sp.accept("alice@example.org", [f"u{p}-{i}@example.net"], DATA)
                with lock:
                    accepted.append(msg_id)

        def work() -> None:
            while True:
                attempt = sp.claim(timeout=0.05)
                if attempt is None:
                    if done.is_set():
                        return
                    continue
                with attempt:
                    attempt.delivered(attempt.envelope.recipients, "250 ok")
                    with lock:
                        delivered.append(attempt.msg_id)

        producers = [threading.Thread(target=produce, args=(p,)) for p in range(n_producers)]
        workers = [threading.Thread(target=work) for _ in range(n_workers)]
        for t in producers + workers:
            t.start()
        for t in producers:
            t.join()
        done.set()
        for t in workers:
            t.join()
        assert drain(sp) == []
    assert len(accepted) == n_producers * per_producer
    assert sorted(delivered) == sorted(accepted)


def test_sixteen_concurrent_durable_accepts_share_fdatasyncs(spool_dir: str) -> None:
    fs = CountingFS(sync_delay=0.005)
    with Spool.open(spool_dir, fs=fs) as sp:
        before = fs.calls["fdatasync"]
        barrier = threading.Barrier(16)

        def produce() -> None:
            barrier.wait()
            for _ in range(10):
                sp.accept("alice@example.org", RCPTS, DATA)

        threads = [threading.Thread(target=produce) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        syncs = fs.calls["fdatasync"] - before
    assert syncs < 160 / 4, f"{syncs} fdatasyncs for 160 durable accepts"


def test_second_open_in_the_same_process_is_refused_with_our_pid(sp: Spool) -> None:
    before = tree_snapshot(sp.path)
    with pytest.raises(SpoolLocked) as info:
        Spool.open(sp.path)
    assert info.value.pid == os.getpid()
    assert str(os.getpid()) in str(info.value)
    assert tree_snapshot(sp.path) == before


def test_second_open_from_another_process_names_the_owner(spool_dir: str) -> None:
    code = (
        "import sys\nfrom spool import Spool, SpoolLocked\n"
        "try:\n    Spool.open(sys.argv[1])\nexcept SpoolLocked as e:\n"
        "    print(e.pid); sys.exit(3)\n"
    )
    with Spool.open(spool_dir):
        proc = subprocess.run(
            [sys.executable, "-c", code, spool_dir], capture_output=True, text=True, timeout=60
        )
    assert proc.returncode == 3, proc.stderr
    assert int(proc.stdout) == os.getpid()


@pytest.mark.parametrize(
    ("sender", "rcpts", "data", "error"),
    [
        ("bad sender", RCPTS, DATA, InvalidAddress),
        ("alice@example.org", ["bob@example.net\r\nRCPT TO:<x@y>"], DATA, InvalidAddress),
        ("alice@example.org", [""], DATA, InvalidAddress),
        ("alice@example.org", [], DATA, InvalidMessage),
        ("alice@example.org", "bob@example.net", DATA, InvalidMessage),
        ("alice@example.org", ["bob@example.net", "bob@example.net"], DATA, InvalidMessage),
        ("alice@example.org", RCPTS, "text, not bytes", InvalidMessage),
        ("alice@example.org", RCPTS, b"x" * 2001, MessageTooLarge),
        ("alice@example.org", [f"u{i}@example.org" for i in range(11)], DATA, MessageTooLarge),
    ],
)
def test_bad_input_raises_a_typed_error_and_writes_nothing(
    spool_dir: str, sender: str, rcpts: list[str], data: bytes, error: type[Exception]
) -> None:
    with Spool.open(spool_dir, max_message_size=2000, max_recipients=10) as sp:
        sp.sync()
        before = tree_snapshot(spool_dir)
        with pytest.raises(error):
            sp.accept(sender, rcpts, data)
        assert tree_snapshot(spool_dir) == before
        assert sp.statistics().accepted == 0


def test_disk_full_refuses_new_mail_but_deliveries_go_on(spool_dir: str) -> None:
    fs = FaultFS()
    with Spool.open(spool_dir, fs=fs, min_free_bytes=10**6) as sp:
        sp.accept("alice@example.org", RCPTS, DATA)
        fs.free = 10
        sp._opened.bodies.free_checked_at = -1.0  # do not wait for the free-space cache to expire
        before = tree_snapshot(spool_dir)
        with pytest.raises(DiskFull, match="452"):
            sp.accept("alice@example.org", RCPTS, DATA)
        assert tree_snapshot(spool_dir) == before
        assert len(drain(sp)) == 1


def test_closed_spool_and_closed_attempt_refuse_use(spool_dir: str) -> None:
    sp = Spool.open(spool_dir)
    sp.accept("alice@example.org", RCPTS, DATA)
    attempt = sp.claim()
    assert attempt is not None
    attempt.close()
    with pytest.raises(SpoolClosed):
        attempt.delivered(RCPTS, "250 ok")
    attempt.close()  # idempotent
    sp.close()
    with pytest.raises(SpoolClosed):
        sp.accept("alice@example.org", RCPTS, DATA)
    with pytest.raises(SpoolClosed):
        sp.claim()


def test_reporting_unknown_or_repeated_recipients_is_a_value_error(sp: Spool) -> None:
    sp.accept("alice@example.org", RCPTS, DATA)
    attempt = sp.claim()
    assert attempt is not None
    with attempt:
        with pytest.raises(ValueError, match="not pending"):
            attempt.delivered(["mallory@example.org"], "250 ok")
        attempt.delivered(["bob@example.net"], "250 ok")
        with pytest.raises(ValueError, match="already reported"):
            attempt.failed(["bob@example.net"], "550 no")
        attempt.failed(["carol@example.com"], "550 no such user")
    assert sp.claim() is None


def test_garbage_collected_attempt_counts_as_deferred(spool_dir: str, clock: FakeClock) -> None:
    with Spool.open(spool_dir, clock=clock, retry_intervals=[30]) as sp:
        msg_id = sp.accept("alice@example.org", RCPTS, DATA)
        attempt = sp.claim()
        assert attempt is not None
        del attempt
        gc.collect()
        assert sp.claim() is None  # processes the abandoned attempt
        assert sp.statistics().in_flight == 0
        sp.sync()
        clock.advance(31)
        again = sp.claim()
        assert again is not None and again.msg_id == msg_id
        again.close()


def test_a_failed_fsync_stops_the_spool_and_reopen_recovers(spool_dir: str) -> None:
    fs = FaultFS()
    sp = Spool.open(spool_dir, fs=fs)
    kept = sp.accept("alice@example.org", RCPTS, DATA)
    fs.fail("fdatasync", err=5)
    with pytest.raises(SpoolFailed):
        sp.accept("alice@example.org", RCPTS, DATA)
    with pytest.raises(SpoolFailed):
        sp.accept("alice@example.org", RCPTS, DATA)
    sp.close()
    with Spool.open(spool_dir) as again:
        ids = [s[0] for s in drain(again)]
    assert kept in ids


def test_flipped_byte_in_durable_log_is_reported_not_skipped(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        for _ in range(5):
            sp.accept("alice@example.org", RCPTS, DATA)
    seg = Path(spool_dir, fmt.LOG_DIR, fmt.segment_name(1))
    data = bytearray(seg.read_bytes())
    data[100] ^= 0x01
    seg.write_bytes(bytes(data))
    (Path(spool_dir) / fmt.POSITIONS_NAME).unlink()  # force a scan of everything
    with pytest.raises(CorruptSpool) as info:
        Spool.open(spool_dir)
    assert info.value.path.endswith(fmt.segment_name(1))


def test_path_that_is_a_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(BadSpoolDirectory, match="not a directory"):
        Spool.open(str(path))


def test_world_writable_spool_directory_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "open"
    path.mkdir(mode=0o777)
    path.chmod(0o777)
    with pytest.raises(BadSpoolDirectory, match="chmod 700"):
        Spool.open(str(path))


def test_new_spool_is_private(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        sp.accept("alice@example.org", RCPTS, DATA)
    assert os.stat(spool_dir).st_mode & 0o777 == 0o700
    for dirpath, _dirs, files in os.walk(spool_dir):
        for name in files:
            assert os.stat(os.path.join(dirpath, name)).st_mode & 0o777 == 0o600, name


def test_damaged_body_is_reported_when_read_not_handed_out_as_data(spool_dir: str) -> None:
    with Spool.open(spool_dir) as sp:
        sp.accept("alice@example.org", RCPTS, b"B" * 400)
    seg = Path(spool_dir, fmt.LOG_DIR, fmt.segment_name(1))
    data = bytearray(seg.read_bytes())
    data[data.index(b"B" * 400) + 100] ^= 0x02
    seg.write_bytes(bytes(data))
    with Spool.open(spool_dir) as sp:
        attempt = sp.claim()  # runners step over bodies without reading them
        assert attempt is not None
        with pytest.raises(CorruptSpool, match="checksum"):
            attempt.read_data()
        attempt.close()
