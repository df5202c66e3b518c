"""The SMTP front end's figures (``smtp_tally.py``): counted in each process serving SMTP,
summed by the owner, shown by ``spool status`` and ``--metrics``; real sessions, real
scrapes, in the owner's process and in front-end processes of their own."""

from __future__ import annotations

import smtplib
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import spool
from spool.errors import ProtocolError
from spool.smtp_tally import KEYS, SmtpTallies, SmtpTally
from tests.serve.running import ROOT, child_env, owner
from tests.serve.sink import free_port

MESSAGE = b"Subject: counted\r\n\r\nhello\r\n"


def test_tallies_sum_each_process_by_its_last_report() -> None:
    own = SmtpTally()
    own.connection()
    own.reply("mail", "250 2.1.0 Ok")
    own.reply("rcpt", "554 5.7.1 Relay access denied")
    own.accepted(100)
    tallies = SmtpTallies(own)
    tallies.record(7, {"connections": 2, "data_2xx": 1})
    tallies.record(7, {"connections": 3, "data_2xx": 2})  # a later report replaces it
    tallies.record(8, {"connections": 1})
    total = tallies.total()
    assert set(total) == set(KEYS)
    assert (total["connections"], total["data_2xx"], total["mail_2xx"]) == (5, 2, 1)
    assert (total["rcpt_5xx"], total["accepted_bytes"]) == (1, 100)


def session(port: int) -> None:
    """Two messages accepted, a bad sender and a relay refused: from an untrusted client."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("client.example.org")
        for i in range(2):
            smtp.mail("a@example.org")
            assert smtp.rcpt(f"r{i}@relay.test")[0] == 250
            assert smtp.data(MESSAGE)[0] == 250
        assert smtp.mail("not an address")[0] == 501
        smtp.mail("a@example.org")
        assert smtp.rcpt("x@elsewhere.test")[0] == 554
        smtp.rset()


def scrape(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("spool_smtp_")
    }


@pytest.mark.parametrize("processes", [0, 1])
def test_metrics_and_status_count_what_the_front_end_did(tmp_path: Path, processes: int) -> None:
    d = str(tmp_path / "spool")
    smtp_port, metrics_port = free_port(), free_port()
    args = [
        "--smtp", f"127.0.0.1:{smtp_port}", "--metrics", f"127.0.0.1:{metrics_port}",
        "--mynetworks", "192.0.2.0/24", "--relay-domain", "relay.test",
    ]  # fmt: skip
    if processes:
        args += ["--smtp-processes", str(processes)]
    with owner(d, *args):
        session(smtp_port)
        deadline = time.monotonic() + 30  # a front-end process reports every 2 s
        while True:
            figures = scrape(metrics_port)
            if (
                figures.get("spool_smtp_connections_total") == 1
                and figures.get('spool_smtp_replies_total{class="2xx",command="DATA"}') == 2
            ):
                break
            assert time.monotonic() < deadline, figures
            time.sleep(0.2)
        status = subprocess.run(
            [sys.executable, "-m", "spool.cli", "status", d],
            capture_output=True, text=True, env=child_env(), cwd=ROOT, check=True,
        )  # fmt: skip
    assert figures['spool_smtp_replies_total{class="2xx",command="MAIL"}'] == 3
    assert figures['spool_smtp_replies_total{class="5xx",command="MAIL"}'] == 1
    assert figures['spool_smtp_replies_total{class="2xx",command="RCPT"}'] == 2
    assert figures['spool_smtp_replies_total{class="5xx",command="RCPT"}'] == 1
    assert figures['spool_smtp_replies_total{class="4xx",command="DATA"}'] == 0
    assert figures["spool_smtp_accepted_bytes_total"] > 2 * len(MESSAGE)  # with Received:
    assert "smtp since start: 1 connection, 2 messages accepted" in status.stdout
    assert "2 commands refused" in status.stdout


def test_figures_that_are_not_the_tallys_are_refused(tmp_path: Path) -> None:
    d = str(tmp_path / "spool")
    with owner(d), spool.connect(d) as client:
        for counts in ({"bogus": 1}, {"connections": -1}, {"connections": True}, {"data_2xx": "1"}):
            with pytest.raises(ProtocolError, match="counts must map"):
                client._call("smtp_tally", counts=counts)
        client._call("smtp_tally", counts={"connections": 4})  # taken (a front-end process)
        assert client.status()["smtp"] is None  # this owner serves no SMTP: not shown
