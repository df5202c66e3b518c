"""The built-in delivery agents called directly, on real files and real commands: what
each gives back for the addresses and the file-system errors the worker tests do not
reach."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from spool.agents import load_agent
from spool.agents import maildir as maildir_module
from spool.attempts import MessageEnvelope


def envelope(sender: str, *recipients: str) -> MessageEnvelope:
    return MessageEnvelope("6B06814FD9D372D3", sender, recipients, 0, 0.0, 5)


def test_the_pipe_agent_substitutes_each_address_once(tmp_path: Path) -> None:
    # Before: {sender} was replaced first, so a sender holding the text "{recipient}"
    # (braces are atext, RFC 5321) was given the recipient's address.
    out = tmp_path / "argv"
    script = tmp_path / "record.py"
    script.write_text(f"import sys\nopen({str(out)!r}, 'w').write('\\n'.join(sys.argv[1:]))\n")
    agent = load_agent(f"pipe:{sys.executable} {script} {{sender}} {{recipient}}")
    replies = agent.deliver(envelope("{recipient}@example.org", "b@example.net"), b"x")
    assert replies == {"b@example.net": "250 2.0.0 delivered via command"}
    assert out.read_text().splitlines() == ["{recipient}@example.org", "b@example.net"]


def test_the_pipe_agent_never_gives_a_command_an_address_as_an_option(tmp_path: Path) -> None:
    # Before: a recipient "-oQ/tmp@example.net" reached the command as an option (the
    # reason for Postfix's allow_min_user = no).
    ran = tmp_path / "ran"
    script = tmp_path / "touch.py"
    script.write_text(f"open({str(ran)!r}, 'a').write('ran\\n')\n")
    agent = load_agent(f"pipe:{sys.executable} {script} -f{{sender}} {{recipient}}")
    replies = agent.deliver(
        envelope("-s@example.org", "-oQ/tmp@example.net", "ok@example.net"), b"x"
    )
    assert replies["-oQ/tmp@example.net"].startswith("550 5.1.3 ")
    assert replies["ok@example.net"] == "250 2.0.0 delivered via command"  # -f-s@...: its own
    assert ran.read_text() == "ran\n"


def test_a_mailbox_name_too_long_for_a_directory_fails_at_once(tmp_path: Path) -> None:
    # Before: ENAMETOOLONG was an error "the operator fixes": deferred until it expired.
    agent = load_agent(f"maildir:{tmp_path / 'mail'}")
    long_name = "x" * 64 + "@" + ".".join(["d" * 63] * 3) + ".example"
    replies = agent.deliver(envelope("a@example.org", long_name, "b@example.net"), b"x")
    assert replies[long_name].startswith("550 5.1.3 ")
    assert replies["b@example.net"] == maildir_module.DELIVERED


def test_a_first_delivery_makes_its_new_mailbox_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before: new/ was fsynced, but not the directory entries of a mailbox created for
    # the first delivery: a power cut could take the mailbox, and the delivered message.
    synced: list[str] = []
    real_fsync = os.fsync

    def recording_fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(maildir_module.os, "fsync", recording_fsync)
    root = tmp_path / "mail"
    agent = load_agent(f"maildir:{root}")
    agent.deliver(envelope("a@example.org", "b@example.net"), b"x")
    box = root / "b@example.net"
    for directory in (root, box, box / "new"):
        assert str(directory) in synced, f"{directory} not fsynced: {synced}"
    synced.clear()
    agent.deliver(envelope("a@example.org", "b@example.net"), b"y")
    assert str(box) not in synced  # once per mailbox and process
    assert sorted(p.read_bytes()[-1:] for p in (box / "new").iterdir()) == [b"x", b"y"]


@pytest.mark.parametrize("words", ["{recipient}", "--to={recipient}"])
def test_pipe_words_that_begin_with_a_dash_themselves_are_the_commands(
    tmp_path: Path, words: str
) -> None:
    script = tmp_path / "ok.py"
    script.write_text(textwrap.dedent("import sys\n"))
    agent = load_agent(f"pipe:{sys.executable} {script} {words}")
    assert agent.deliver(envelope("a@example.org", "b@example.net"), b"x") == {
        "b@example.net": "250 2.0.0 delivered via command"
    }
