"""SMTP in from processes of its own (``spool serve --smtp-processes N``): the listeners
bound by the owner, N front-end processes on them handing each message to the owner over
the control socket; real SMTP sessions, real kills."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import smtplib
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import spool
from spool import Spool
from tests.serve.running import ROOT, child_env, owner, read
from tests.serve.sink import free_port

MESSAGE = b"Subject: through a front-end process\r\n\r\nhello\r\n"


def smtp_pids(owner_pid: int) -> list[int]:
    """The owner's SMTP front-end processes (its children running spool.smtp_process)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if ppid == owner_pid and b"spool.smtp_process" in cmdline:
            found.append(int(entry))
    return sorted(found)


def wait_for(what: str, check: object, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.1)


def send(port: int, i: int) -> str:
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("client.example.org")
        smtp.mail("a@example.org")
        smtp.rcpt(f"r{i}@example.net")
        code, text = smtp.data(MESSAGE)
        assert code == 250, text
        return text.decode().rsplit(" ", 1)[1]


def test_sessions_through_front_end_processes_are_queued_as_in_process(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--smtp-processes", "2", "--smtp-hostname", "mx.test"]
    with owner(d, *args) as proc:
        wait_for("two front-end processes", lambda: len(smtp_pids(proc.pid)) == 2)
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            ids = list(pool.map(lambda i: send(port, i), range(40)))
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
            smtp.ehlo()
            announced = int(smtp.esmtp_features["size"])
            assert smtp.rcpt("b@example.net")[0] == 503  # no MAIL yet: aiosmtpd's order
        with spool.connect(d) as client:
            assert client.status()["smtp_processes"] == smtp_pids(proc.pid)
        from tests.serve.test_cli_with_owner import spool_cmd

        status = spool_cmd("status", d)
        assert status.returncode == 0, status.stderr
        assert "smtp processes: 2 (pids " in status.stdout
    with Spool.open(d) as sp:
        assert sorted(e.msg_id for e in sp.list()) == sorted(ids)
        assert announced == sp.options.max_message_size - (512 + 255 + len("mx.test"))
        attempt = sp.claim()
        assert attempt is not None
        assert b"\tby mx.test (spool) with ESMTP\r\n" in attempt.read_data()
        attempt.close()


def test_a_killed_front_end_process_is_replaced_and_the_others_go_on(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    with owner(d, "--smtp", f"127.0.0.1:{port}", "--smtp-processes", "2") as proc:
        wait_for("two front-end processes", lambda: len(smtp_pids(proc.pid)) == 2)
        first = smtp_pids(proc.pid)
        os.kill(first[0], signal.SIGKILL)
        wait_for(
            "a replacement",
            lambda: len(pids := smtp_pids(proc.pid)) == 2 and first[0] not in pids,
        )
        ids = [send(port, i) for i in range(10)]
    with Spool.open(d) as sp:
        assert sorted(e.msg_id for e in sp.list()) == sorted(ids)


def test_a_stop_says_421_from_the_front_end_processes(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    with owner(d, "--smtp", f"127.0.0.1:{port}", "--smtp-processes", "2") as proc:
        wait_for("two front-end processes", lambda: len(smtp_pids(proc.pid)) == 2)
        children = smtp_pids(proc.pid)
        sessions = [smtplib.SMTP("127.0.0.1", port, timeout=30) for _ in range(4)]
        for smtp in sessions:
            assert smtp.ehlo()[0] == 250
        proc.send_signal(signal.SIGTERM)
        for smtp in sessions:
            code, text = smtp.getreply()
            assert (code, text[:5]) == (421, b"4.3.2"), (code, text)
            smtp.close()
        assert proc.wait(60) == 0
    assert not any(_alive(pid) for pid in children)  # none outlives its owner


def test_front_end_processes_leave_when_their_owner_is_killed(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    log = str(tmp_path / "owner.log")
    with owner(d, "--smtp", f"127.0.0.1:{port}", "--smtp-processes", "2", log=log) as proc:
        wait_for("two front-end processes", lambda: len(smtp_pids(proc.pid)) == 2)
        children = smtp_pids(proc.pid)
        idle = smtplib.SMTP("127.0.0.1", port, timeout=30)
        assert idle.ehlo()[0] == 250
        proc.kill()
        proc.wait()
        code, _text = idle.getreply()  # the session is told, not left hanging
        assert code == 421
        idle.close()
        wait_for("the front-end processes to exit", lambda: not any(_alive(p) for p in children))
    # The port is free again: nothing holds the listener.
    with socket.create_server(("127.0.0.1", port)):
        pass
    assert "the owner went away" in read(log)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_smtp_processes_need_smtp(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spool.cli", "serve", str(tmp_path / "s"), "--smtp-processes", "2"],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--smtp-processes needs --smtp" in done.stderr
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize("processes", ["-1", "65"])
def test_a_number_of_processes_out_of_range_is_refused(tmp_path: Path, processes: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "spool.cli", "serve", str(tmp_path / "s"),
         "--smtp", "127.0.0.1:0", "--smtp-processes", processes],
        capture_output=True, text=True, env=child_env(), cwd=ROOT, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "--smtp-processes" in done.stderr


def test_a_front_end_process_given_no_networks_trusts_nobody(tmp_path: Path) -> None:
    # Found by review: given no --mynetworks, the process trusted loopback, where the
    # owner (serve(mynetworks=[])) trusted nobody: an open relay to loopback clients.
    from spool.smtp_process import bind_listener

    d = str(tmp_path / "spool")
    listener = bind_listener("127.0.0.1", 0)
    port = listener.getsockname()[1]
    with owner(d):
        child = subprocess.Popen(
            [sys.executable, "-m", "spool.smtp_process", d, "--fd", str(listener.fileno()),
             "--hostname", "mx.test", "--max-recipients", "10", "--size-limit", "100000",
             "--relay-domain", "ours.example"],
            pass_fds=[listener.fileno()], env=child_env(), cwd=ROOT,
        )  # fmt: skip
        try:
            with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
                smtp.ehlo()
                smtp.mail("a@example.org")
                assert smtp.rcpt("b@elsewhere.example")[0] == 554  # relaying refused
                assert smtp.rcpt("b@ours.example")[0] == 250  # a relay domain is taken
        finally:
            child.terminate()
            assert child.wait(30) == 0
            listener.close()
