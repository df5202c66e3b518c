"""The owner's event loop: uvloop's where it is installed, asyncio's otherwise, and the
same to its clients either way."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from spool import Spool, connect
from spool.client import Client
from spool.errors import OwnerUnreachable
from spool.owner import new_event_loop
from tests.serve.running import owner

BODY = b"Subject: which loop\r\n\r\nhello\r\n"


def test_the_owner_runs_uvloops_loop_where_it_is_installed() -> None:
    uvloop = pytest.importorskip("uvloop")
    loop = new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_an_owner_without_uvloop_serves_and_stops_alike(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where uvloop is not installed (here a package of its name that cannot be imported,
    ahead of it on the owner's path) the owner serves on asyncio's loop: an accept, a
    claim, a report, a dropped connection's attempt closed, and a stop with a client
    waiting in a claim, whose connection the stop shuts."""
    shadow = tmp_path / "shadow" / "uvloop"
    shadow.mkdir(parents=True)
    tried = tmp_path / "uvloop-tried"
    (shadow / "__init__.py").write_text(
        f"open({str(tried)!r}, 'w').close()\nraise ImportError('uvloop is not installed here')\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    d = str(tmp_path / "spool")
    Spool.open(d, retry_intervals=[0.2]).close()
    with owner(d) as proc:
        with connect(d) as client:
            msg_id = client.accept("a@example.org", ["b@example.net", "c@example.net"], BODY)
            attempt = client.claim(timeout=5)
            assert attempt is not None and attempt.read_data() == BODY
            attempt.delivered(["b@example.net"], "250 2.0.0 ok")
        # The connection dropped with the attempt open: c deferred, b delivered.
        with connect(d) as client:
            client.retry_now(msg_id)
            again = client.claim(timeout=5)
            assert again is not None and again.envelope.recipients == ("c@example.net",)
            with again:
                again.delivered(["c@example.net"], "250 2.0.0 ok")
        waiting = connect(d)
        outcome: list[object] = []
        waiter = threading.Thread(target=lambda: outcome.append(_claim(waiting)))
        waiter.start()
        time.sleep(0.5)  # the claim reaches the owner and waits there
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        waiter.join(10)
        waiting.close()
    assert os.path.exists(tried), "the owner did not look for uvloop"
    assert not waiter.is_alive() and len(outcome) == 1
    assert outcome[0] is None or isinstance(outcome[0], OwnerUnreachable), outcome
    with Spool.open(d) as sp:
        assert list(sp.list()) == []  # both recipients delivered, nothing queued
        assert sp.recovery.working_found == 0  # the stop closed everything


def _claim(client: Client) -> object:
    try:
        return client.claim(timeout=30)
    except OwnerUnreachable as e:  # the owner went while the claim waited
        return e
