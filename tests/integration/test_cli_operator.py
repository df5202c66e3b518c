"""The command line as a mail operator uses it, next to postqueue, postsuper, qshape and
exiqgrep: selections, per-recipient replies, headers, no-ops, errors that name the
problem, Ctrl-C. Each through the installed ``spool`` command in a real process."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spool import Spool
from spool.directory import user_name
from tests.serve.running import owner, sigint_as_default

ROOT = Path(__file__).resolve().parents[2]
SPOOL_CMD = shutil.which("spool", path=os.path.dirname(sys.executable)) or "spool"


def spool(*args: str, stdin: str = "", **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SPOOL_CMD, *args], input=stdin, capture_output=True, text=True, timeout=120, **kwargs
    )  # type: ignore[call-overload, no-any-return]


@pytest.fixture
def queue(spool_dir: str) -> dict[str, str]:
    """A deferred message with two replies for three recipients, a bounce (null sender)
    held, and a fresh message an hour old."""
    with Spool.open(spool_dir) as sp:
        ids = {
            "deferred": sp.accept(
                "alice@example.org",
                ["carol@example.com", "dave@example.net", "erin@example.net"],
                b"Subject: two replies\r\nFrom: alice@example.org\r\n\r\nbody\r\n",
            ),
            "bounce": sp.accept("", ["postmaster@example.org"], b"Subject: bounce\r\n\r\nz\r\n"),
        }
        attempt = sp.claim()
        assert attempt is not None and attempt.msg_id == ids["deferred"]
        with attempt:
            attempt.deferred(["carol@example.com"], "421 4.4.2 connection timed out")
            attempt.deferred(["dave@example.net", "erin@example.net"], "451 4.7.1 greylisted")
        sp.hold(ids["bounce"])
    # Stamped an hour ago (a clock behind, across a restart: the stamps are as written).
    with Spool.open(spool_dir, clock=lambda: time.time() - 3600) as sp:
        ids["old"] = sp.accept("frank@example.com", ["gina@example.com"], b"Subject: old\r\n\r\n")
    return ids


def lines(done: subprocess.CompletedProcess[str]) -> list[str]:
    return done.stdout.splitlines()


def test_list_selects_as_exiqgrep_does(spool_dir: str, queue: dict[str, str]) -> None:
    def ids(*args: str) -> set[str]:
        done = spool("list", "-i", spool_dir, *args)
        assert done.returncode == 0 and done.stderr == "", done.stderr
        return set(lines(done))

    assert ids() == set(queue.values())
    assert ids("--sender", "") == {queue["bounce"]}  # the null sender, not every sender
    assert ids("--sender", "<>") == {queue["bounce"]}
    assert ids("--state", "deferred") == {queue["deferred"]}
    assert ids("--state", "held", "--state", "incoming") == {queue["bounce"], queue["old"]}
    assert ids("--younger-than", "30m") == {queue["deferred"], queue["bounce"]}
    assert ids("--older-than", "30m") == {queue["old"]}
    assert ids("--sender-regex", r"^(alice|frank)@") == {queue["deferred"], queue["old"]}
    assert ids("--recipient-regex", r"^d.*@example\.NET$") == {queue["deferred"]}
    assert ids("--domain", "example.com") == {queue["deferred"], queue["old"]}
    assert ids("--domain", "@EXAMPLE.net") == {queue["deferred"]}
    count = spool("list", "-c", spool_dir, "--domain", "example.com")
    assert count.returncode == 0 and count.stdout == "2\n"
    assert spool("list", "-c", "-i", spool_dir).returncode == 2
    bad = spool("list", spool_dir, "--sender-regex", "(")
    assert bad.returncode == 2 and "not a regular expression" in bad.stderr


def test_ids_from_list_feed_an_action(spool_dir: str, queue: dict[str, str]) -> None:
    listed = spool("list", "-i", spool_dir, "--recipient", "@example.net")
    done = spool("delete", spool_dir, "-", stdin=listed.stdout)
    assert done.returncode == 0 and done.stdout == "1 message deleted (no bounce)\n"
    assert set(lines(spool("list", "-i", spool_dir))) == {queue["bounce"], queue["old"]}


def test_each_pending_recipient_shows_its_own_last_reply(
    spool_dir: str, queue: dict[str, str]
) -> None:
    out = spool("list", spool_dir, "--state", "deferred").stdout
    # As mailq: each reply once, above the recipients that got it.
    assert out.splitlines()[2:7] == [
        f"{'':18}(421 4.4.2 connection timed out)",
        f"{'':18}carol@example.com",
        f"{'':18}(451 4.7.1 greylisted)",
        f"{'':18}dave@example.net",
        f"{'':18}erin@example.net",
    ]
    row = json.loads(spool("list", spool_dir, "--json", "--state", "deferred").stdout)
    assert row["queue_name"] == "deferred" and row["queue_id"] == queue["deferred"]
    assert row["recipients"] == [
        {"address": "carol@example.com", "delay_reason": "421 4.4.2 connection timed out"},
        {"address": "dave@example.net", "delay_reason": "451 4.7.1 greylisted"},
        {"address": "erin@example.net", "delay_reason": "451 4.7.1 greylisted"},
    ]
    assert row["retry_class"] == 1 and "klass" not in row
    assert {"arrival_time", "message_size", "sender", "attempts"} <= set(row)


def test_stats_by_sender_domain_with_held_mail_apart(spool_dir: str, queue: dict[str, str]) -> None:
    out = spool("stats", spool_dir).stdout
    assert "example.org" not in out.split("held (not in the table)")[0].split("TOTAL")[1]
    assert "held (not in the table): 1 message, 1 recipient" in out
    by_sender = spool("stats", spool_dir, "--senders").stdout
    rows = {line.split()[0]: int(line.split()[1]) for line in by_sender.splitlines()[6:8]}
    assert rows == {"example.org": 3, "example.com": 1}
    data = json.loads(spool("stats", spool_dir, "--json").stdout)
    assert data["held"] == {"messages": 1, "recipients": 1}
    assert sum(data["qshape"]["sender_domains"]["example.org"]) == 3


def test_show_headers_and_data(spool_dir: str, queue: dict[str, str]) -> None:
    done = subprocess.run(
        [SPOOL_CMD, "show", spool_dir, queue["deferred"].lower(), "--headers"],
        capture_output=True,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == f"queue_id: {queue['deferred']}".encode()
    assert b"sender: <alice@example.org>\n" in done.stdout
    assert b"recipient: dave@example.net\n" in done.stdout
    assert done.stdout.endswith(b"\n\nSubject: two replies\r\nFrom: alice@example.org\r\n")
    data = subprocess.run(
        [SPOOL_CMD, "show", spool_dir, queue["deferred"], "--data"], capture_output=True
    )
    assert data.stdout == b"Subject: two replies\r\nFrom: alice@example.org\r\n\r\nbody\r\n"


def test_no_ops_say_the_same_kind_of_thing_and_exit_0(
    spool_dir: str, queue: dict[str, str]
) -> None:
    held, fresh = queue["bounce"], queue["old"]
    cases = [
        ("hold", held, f"{held}: unchanged, already held\n0 messages held, "),
        ("release", fresh, f"{fresh}: unchanged, not held\n0 messages released (due now), "),
        ("retry", held, f"{held}: unchanged, not waiting for a retry"),
    ]
    for command, msg_id, start in cases:
        done = spool(command, spool_dir, msg_id)
        assert done.returncode == 0 and done.stderr == "", (command, done.stderr)
        assert done.stdout.startswith(start), done.stdout
        assert done.stdout.endswith("1 unchanged (nothing to do)\n")


def test_errors_name_the_problem(spool_dir: str, queue: dict[str, str], tmp_path: Path) -> None:
    missing = spool("list", str(tmp_path / "nowhere"))
    assert missing.returncode == 1 and missing.stderr.endswith("nowhere does not exist\n")
    plain = tmp_path / "plain"
    plain.mkdir()
    done = spool("list", str(plain))
    assert done.returncode == 1 and "is not a spool (no log/ directory)" in done.stderr
    done = spool("hold", spool_dir, "0123456789ABCDEF")
    assert done.returncode == 1
    assert done.stderr == "spool: no message 0123456789ABCDEF in the spool\n"
    done = spool("show", spool_dir, "0123456789abcdef")
    assert done.stderr == "spool: no message 0123456789ABCDEF in the spool\n"
    done = spool("hold", spool_dir, queue["old"].lower())  # ids in any case
    assert done.returncode == 0 and done.stdout == "1 message held\n"
    done = spool("dump", spool_dir, "--segment", "99")
    assert done.returncode == 1 and "no segment 99" in done.stderr
    assert "--older-than AGE" in spool("list", "--help").stdout
    done = spool("accept", spool_dir, "-f", "<ann@example.org>", "<bo@example.com>", stdin="x")
    assert done.returncode == 0, done.stderr
    row = json.loads(spool("list", spool_dir, "--json", "--sender", "ann@").stdout)
    assert row["sender"] == "ann@example.org"
    assert row["recipients"][0]["address"] == "bo@example.com"
    done = spool("accept", spool_dir, "-f", "<>", "bo@example.com", stdin="x")
    assert done.returncode == 0 and spool("list", "-c", spool_dir, "--sender", "").stdout == "2\n"


def test_a_spool_of_another_user_says_whose_it_is(spool_dir: str, queue: dict[str, str]) -> None:
    """Root facing the mail user's spool is told to run the command as that user; a user
    who cannot read a spool is told whose it is (not a usage error)."""
    if os.geteuid() == 0:
        nobody = 65534
        os.chown(spool_dir, nobody, nobody)
        done = spool("hold", spool_dir, "--all")
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert f"run the command as {user_name(nobody)}" in done.stderr
    else:
        os.chmod(os.path.join(spool_dir, "log"), 0)
        try:
            done = spool("list", spool_dir)
        finally:
            os.chmod(os.path.join(spool_dir, "log"), 0o700)
        assert done.returncode == 1 and "Traceback" not in done.stderr
        assert "permission denied" in done.stderr


def test_retry_for_a_site_is_delivered_at_once_by_a_running_owner(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    agent = "python:tests.serve.agents_for_tests:grey_once"
    with owner(d, "--agent", agent, "--workers", "1"):
        for rcpt in ("a@slow.example", "b@other.example"):
            assert spool("accept", d, "-f", "s@example.org", rcpt, stdin="x").returncode == 0
        deadline = time.monotonic() + 30
        while spool("list", "-c", d, "--state", "deferred").stdout != "2\n":
            assert time.monotonic() < deadline, "the first attempts did not defer"
            time.sleep(0.1)
        done = spool("retry", d, "--domain", "slow.example")
        assert done.returncode == 0 and done.stdout == "1 message due now\n"
        # Due in five minutes by its retry class; delivered now.
        while spool("list", "-c", d).stdout != "1\n":
            assert time.monotonic() < deadline, "the retried message was not delivered"
            time.sleep(0.1)
        assert spool("list", "-i", d, "--domain", "other.example").stdout.strip()


def test_ctrl_c_exits_130_without_a_traceback(spool_dir: str, queue: dict[str, str]) -> None:
    # A command waiting for its input (accept reads the message from standard input).
    proc = subprocess.Popen(
        [SPOOL_CMD, "accept", spool_dir, "-f", "a@example.org", "b@example.net"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_default,
    )
    time.sleep(1.0)  # it is started and reading (an early SIGINT ends it the same way)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "" and out == "", err
    assert spool("list", "-c", spool_dir).stdout == "3\n"  # nothing half-queued


def test_ctrl_c_of_a_repair_says_how_to_finish_it(tmp_path: Path) -> None:
    # A repair that holds thousands of messages (damage near the log's end: "records
    # possibly lost" for each) takes seconds: Ctrl-C once its flag is written leaves a
    # spool every open refuses until a repair finishes; the one line says so, and the
    # rerun finishes it.
    from spool import format as fmt
    from spool.testing import FakeClock

    d = tmp_path / "spool"
    with Spool.open(d, clock=FakeClock(), retry_intervals=(300.0,), checkpoint_interval=1e6) as sp:
        for i in range(3000):
            sp.accept("a@example.org", [f"r{i}@example.net"], b"x" * 200)
        while (attempt := sp.claim(timeout=0)) is not None:
            with attempt:
                attempt.deferred(list(attempt.envelope.recipients), "451 4.3.0 later")
    newest = max((d / fmt.LOG_DIR).iterdir())
    data = bytearray(newest.read_bytes())
    at = len(data) * 99 // 100
    data[at : at + 40] = b"\xa5" * 40
    newest.write_bytes(bytes(data))
    proc = subprocess.Popen(
        [SPOOL_CMD, "check", str(d), "--repair"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_default,
    )
    flag = d / fmt.REPAIRING_NAME
    while not flag.exists() and proc.poll() is None:
        time.sleep(0.005)
    if proc.poll() is not None:
        pytest.skip("the repair ended before its flag was seen (a very fast machine)")
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode == 1 and not flag.exists():
        pytest.skip("the repair ended before the SIGINT (a very fast machine)")
    assert proc.returncode == 130, err
    assert err.count("\n") == 1 and "run `spool check --repair" in err, err
    refused = spool("checkpoint", str(d))  # every open, until the repair is finished
    assert refused.returncode == 1 and "repair" in refused.stderr, refused.stderr
    again = spool("check", str(d), "--repair")
    assert again.returncode == 1 and "after repair: clean" in again.stdout, again.stderr
    assert spool("list", "-c", str(d)).stdout == "3000\n"


def documented_worker_loop() -> str:
    """The worker loop docs/api.md shows first, as a program."""
    text = (ROOT / "docs" / "api.md").read_text()
    found = re.search(r"```python\n(.*?)```", text, re.DOTALL)
    assert found is not None
    return found.group(1)


def test_ctrl_c_ends_the_documented_worker_loop_cleanly(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    program = tmp_path / "loop.py"
    program.write_text(documented_worker_loop().replace('"var/spool"', repr(d)))
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=sigint_as_default,
    )
    deadline = time.monotonic() + 30
    while '"type": "finish"' not in spool("dump", d, "--json").stdout:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stderr
        time.sleep(0.1)  # accepted and delivered: then the loop waits for the next attempt
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode == 130 and err == "", err
    with Spool.open(d) as sp:
        assert sp.recovery.working_found == 0 and list(sp.list()) == []


def test_help_command_and_completion(spool_dir: str) -> None:
    done = spool("help", "retry")
    assert done.returncode == 0 and done.stdout == spool("retry", "--help").stdout
    assert "--domain DOMAIN" in done.stdout
    assert spool("help", "nope").returncode == 2
    env = {**os.environ, "_SPOOL_COMPLETE": "bash_source"}
    script = subprocess.run([SPOOL_CMD], env=env, capture_output=True, text=True, timeout=60)
    assert script.returncode == 0 and "_spool_completion" in script.stdout


def stderr_on_a_terminal(*args: str) -> tuple[int, str, str]:
    """Run the command with standard error on a pseudo-terminal; (status, out, the tty's)."""
    import pty

    master, slave = pty.openpty()
    proc = subprocess.Popen(
        [SPOOL_CMD, *args], stdout=subprocess.PIPE, stderr=slave, stdin=subprocess.DEVNULL
    )
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:  # the terminal's other end closed: the command is done
            break
        if not chunk:
            break
        seen += chunk
    out, _ = proc.communicate(timeout=60)
    os.close(master)
    return proc.returncode, out.decode(), seen.decode(errors="replace")


def test_long_walks_show_progress_on_a_terminal_and_nothing_when_piped(
    spool_dir: str, queue: dict[str, str]
) -> None:
    for command in ("list", "stats"):
        code, out, tty = stderr_on_a_terminal(command, spool_dir)
        assert code == 0 and "reading the log" in tty and "reading the log" not in out
        piped = spool(command, spool_dir)
        assert piped.returncode == 0 and piped.stderr == ""
    code, out, tty = stderr_on_a_terminal("hold", spool_dir, "--all")
    assert code == 0 and out == "2 messages held, 1 unchanged (nothing to do)\n"
    assert spool("release", spool_dir, "--all").stderr == ""
