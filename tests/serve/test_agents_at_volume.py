"""A few thousand messages through each built-in agent, under a real owner with two
worker processes (``--max-use`` a quarter of the messages: each worker is replaced along
the way): every recipient's outcome is the one its agent gives it, and every delivered
recipient got exactly one copy. ``SPOOL_SERVE_MANY`` sets the number of messages (2,000)."""

from __future__ import annotations

import collections
import concurrent.futures
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from spool.client import connect
from tests.serve.running import owner
from tests.serve.sink import start_lmtp_sink, start_sink
from tests.serve.test_workers import body, make_spool, wait_for

MANY = int(os.environ.get("SPOOL_SERVE_MANY", "2000"))
PRODUCERS = 8

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def recipients(i: int) -> list[str]:
    """One that each agent delivers, one that each (but maildir) refuses for good."""
    return [f"ok{i}@a.example", f"nouser{i % 3}@b.example"]


def accept_all(d: str) -> None:
    """``MANY`` messages, from ``PRODUCERS`` clients at once."""

    def produce(first: int) -> None:
        with connect(d) as client:
            for i in range(first, MANY, PRODUCERS):
                client.accept("s@example.org", recipients(i), body(i))

    with concurrent.futures.ThreadPoolExecutor(PRODUCERS) as pool:
        list(pool.map(produce, range(PRODUCERS)))


def token(content: bytes) -> str:
    return content.split(b"X-Token: ")[1].split(b"\r\n")[0].decode()


def copies_at_sinks(*recorders: Any) -> Callable[[], dict[str, list[str]]]:
    """Each recipient's tokens, as the sinks received them."""

    def seen() -> dict[str, list[str]]:
        got: dict[str, list[str]] = collections.defaultdict(list)
        for recorder in recorders:
            for _, rcpts, content in recorder.received:
                for rcpt in rcpts:
                    got[rcpt].append(token(content))
        return got

    return seen


def copies_in_files(out: Path) -> Callable[[], dict[str, list[str]]]:
    """Each recipient's tokens, from files named by recipient (maildir or pipe)."""

    def seen() -> dict[str, list[str]]:
        got: dict[str, list[str]] = collections.defaultdict(list)
        for path in out.rglob("*"):
            if path.is_file():
                rcpt = path.parent.parent.name if path.parent.name == "new" else path.name
                for part in path.read_bytes().split(b"X-Token: ")[1:]:
                    got[rcpt].append(part.split(b"\r\n")[0].decode())
        return got

    return seen


@pytest.mark.parametrize("agent", ["maildir", "smtp", "routes", "lmtp", "pipe", "python"])
def test_a_few_thousand_messages_through_each_agent(tmp_path: Path, agent: str) -> None:
    d, out = make_spool(str(tmp_path / "spool")), tmp_path / "out"
    out.mkdir()
    stop: list[Callable[[], object]] = []
    seen: Callable[[], dict[str, list[str]]] | None = None
    refuses = agent != "maildir"
    if agent == "maildir":
        spec, seen = f"maildir:{out}", copies_in_files(out)
    elif agent in ("smtp", "lmtp"):
        controller, recorder, port = (start_sink if agent == "smtp" else start_lmtp_sink)()
        stop.append(controller.stop)
        spec, seen = f"{agent}:127.0.0.1:{port}", copies_at_sinks(recorder)
    elif agent == "routes":
        (one, first, port_a), (two, second, port_b) = start_sink(), start_sink()
        stop += [one.stop, two.stop]
        (tmp_path / "transport").write_text(
            f"a.example smtp:127.0.0.1:{port_a}\nb.example smtp:127.0.0.1:{port_b}\n"
        )
        spec, seen = f"routes:{tmp_path / 'transport'}", copies_at_sinks(first, second)
    elif agent == "pipe":
        script = 'case "$1" in nouser*) echo "no such user $1" >&2; exit 67;; esac; cat >> "$0/$1"'
        spec, seen = f"pipe:/bin/sh -c '{script}' {out} {{recipient}}", copies_in_files(out)
    else:
        spec = "python:tests.serve.agents_for_tests:by_local_part"
    try:
        with owner(d, "--agent", spec, "--workers", "2", "--max-use", str(max(50, MANY // 4))):
            accept_all(d)
            with connect(d) as client:
                wait_for(
                    lambda: client.statistics().delivered + client.statistics().failed >= 2 * MANY,
                    timeout=900,
                    what=f"{agent} to settle every recipient",
                )
                wait_for(lambda: not list(client.list()), what="the spool to empty")
                stats, status = client.statistics(), client.status()
    finally:
        for step in stop:
            step()
    assert (stats.delivered, stats.failed) == ((MANY, MANY) if refuses else (2 * MANY, 0))
    assert stats.deferred == 0
    assert status["worker_restarts"] >= 1  # replaced after --max-use
    if seen is None:
        return  # the python agent keeps nothing to look at: its counts are the check
    copies = seen()
    for i in range(MANY):
        assert copies.get(f"ok{i}@a.example") == [f"t{i}"], f"message {i}"
    refused = [rcpt for rcpt in copies if rcpt.startswith("nouser")]
    if refuses:
        assert refused == []
    else:
        assert sorted(t for r in refused for t in copies[r]) == sorted(f"t{i}" for i in range(MANY))
