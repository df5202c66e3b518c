"""SMTP in (``spool serve --smtp``): real SMTP sessions (smtplib) against a real owner, or
against the front end in process where a test needs a spool option the command has not."""

from __future__ import annotations

import concurrent.futures
import signal
import smtplib
import socket as socket_module
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from spool import AsyncSpool, Spool
from spool.client import connect
from spool.options import DEFAULT_MAX_MESSAGE_SIZE
from spool.smtp_in import SmtpFrontEnd, received_room
from tests.serve.running import owner, read
from tests.serve.sink import free_port, self_signed, start_sink

MESSAGE = b"Subject: hello\r\nFrom: a@example.org\r\n\r\nhello there\r\n"


def session(port: int) -> smtplib.SMTP:
    smtp = smtplib.SMTP("127.0.0.1", port, timeout=30)
    smtp.ehlo("client.example.org")
    return smtp


def test_a_relay_takes_mail_in_over_smtp_and_sends_it_on_over_smtp(tmp_path: Path) -> None:
    # The whole relay: SMTP in, 250 once durable, a worker's smtp agent to the next hop
    # (--relay, Postfix's relayhost: the smtp agent).
    controller, sink, sink_port = start_sink()
    d, port = str(tmp_path / "spool"), free_port()
    try:
        args = ["--smtp", f"127.0.0.1:{port}", "--relay", f"127.0.0.1:{sink_port}"]
        with owner(d, *args, "--workers", "1", "--smtp-hostname", "relay.example.org"):

            def send(i: int) -> str:
                with session(port) as smtp:
                    smtp.mail("a@example.org")
                    smtp.rcpt(f"ok{i}@example.net")
                    code, text = smtp.data(MESSAGE + b"X-Token: %d\r\n" % i)
                    assert code == 250 and text.startswith(b"2.0.0 Ok: queued as "), text
                    return text.decode().rsplit(" ", 1)[1]

            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                ids = list(pool.map(send, range(40)))
            deadline = time.monotonic() + 60
            while len(sink.received) < 40 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        controller.stop()
    assert len(set(ids)) == 40 and len(sink.received) == 40
    for sender, rcpts, content in sink.received:
        assert sender == "a@example.org" and len(rcpts) == 1
        received, _, rest = content.partition(b"\r\n\t")
        assert received.startswith(b"Received: from client.example.org ([127.0.0.1])")
        assert rest.startswith(b"by relay.example.org (spool) with ESMTP")
        assert MESSAGE in content
    assert f"smtp 127.0.0.1:{port}" in read(d + ".log")


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[str, int]]:
    d, port = str(tmp_path / "spool"), free_port()
    with owner(d, "--smtp", f"127.0.0.1:{port}"):
        yield d, port


def test_limits_and_addresses_get_the_replies_an_mta_gives(served: tuple[str, int]) -> None:
    d, port = served
    with session(port) as smtp:
        size = smtp.esmtp_features["size"]
        assert "pipelining" in smtp.esmtp_features and "smtputf8" in smtp.esmtp_features
        assert int(size) == DEFAULT_MAX_MESSAGE_SIZE - received_room(socket_module.getfqdn())
        code, text = smtp.mail("a@example.org", [f"SIZE={int(size) + 1}"])
        assert (code, text[:5]) == (552, b"5.3.4")
        assert smtp.mail("not an address")[0] == 501
        code, text = smtp.mail("bad@@example.org")  # refused by aiosmtpd's parser
        assert (code, text[:5]) == (553, b"5.1.3")
        code, text = smtp.mail("a..b@example.org")  # parsed, refused by the spool's rules
        assert (code, text[:5]) == (501, b"5.1.7")
        assert smtp.mail("<>")[0] == 250  # the null sender: bounces come from it
        code, text = smtp.rcpt("nobody")
        assert (code, text[:5]) == (501, b"5.1.3")
        assert smtp.rcpt("b@example.net")[0] == 250
        assert smtp.rcpt("b@EXAMPLE.net")[0] == 250  # the same mailbox: taken once
        code, text = smtp.data((b"x" * 62 + b"\r\n") * (int(size) // 64 + 2))
        assert (code, text[:5]) == (552, b"5.3.4")
        smtp.rset()
        smtp.mail("<>")
        smtp.rcpt("b@example.net")
        assert smtp.data(MESSAGE)[0] == 250
    with connect(d) as client:
        (entry,) = client.list()
    assert entry.sender == "" and entry.recipients == ("b@example.net",)


def test_a_client_outside_mynetworks_may_only_send_to_relay_domains(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--mynetworks", "192.0.2.0/24"]
    with owner(d, *args, "--relay-domain", "example.net"), session(port) as smtp:
        smtp.mail("a@example.org")
        code, text = smtp.rcpt("b@elsewhere.example")
        assert code == 554 and text == b"5.7.1 <b@elsewhere.example>: Relay access denied"
        assert smtp.rcpt("b@example.net")[0] == 250  # a relay domain
        assert smtp.data(MESSAGE)[0] == 250


def test_bad_smtp_options_are_usage_errors(tmp_path: Path) -> None:
    from tests.serve.test_cli_with_owner import spool_cmd

    d = str(tmp_path / "spool")
    done = spool_cmd("serve", d, "--smtp", "2525")
    assert done.returncode == 2 and "HOST:PORT" in done.stderr
    done = spool_cmd("serve", d, "--smtp", "127.0.0.1:2525", "--mynetworks", "not-a-net")
    assert done.returncode == 2 and "not a network" in done.stderr
    done = spool_cmd("serve", d, "--mynetworks", "10.0.0.0/8")
    assert done.returncode == 2 and "--smtp" in done.stderr
    assert not (tmp_path / "spool").exists()


def test_a_listener_that_cannot_bind_stops_the_owner_with_an_error(tmp_path: Path) -> None:
    import socket

    from tests.serve.test_cli_with_owner import spool_cmd

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = spool_cmd("serve", str(tmp_path / "spool"), "--smtp", f"127.0.0.1:{port}")
    assert done.returncode == 1 and "spool:" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    assert not (tmp_path / "spool" / "control.sock").exists()


def _front(sp: Spool) -> tuple[SmtpFrontEnd, int]:
    port = free_port()
    front = SmtpFrontEnd(AsyncSpool(sp), [("127.0.0.1", port)], hostname="mx.test")
    front.start()
    return front, port


def test_a_full_disk_is_452_and_too_many_recipients_452_4_5_3(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path / "spool", max_recipients=3, min_free_bytes=1 << 40)
    front, port = _front(sp)
    try:
        with session(port) as smtp:
            smtp.mail("a@example.org")
            for i in range(3):
                assert smtp.rcpt(f"r{i}@example.net")[0] == 250
            code, text = smtp.rcpt("r3@example.net")
            assert (code, text[:5]) == (452, b"4.5.3")
            code, text = smtp.data(MESSAGE)
            assert (code, text[:5]) == (452, b"4.3.1")  # under min_free_bytes: try later
        assert list(sp.list()) == []
    finally:
        front.stop()
        sp.close()


def test_the_announced_size_leaves_room_for_the_received_header(tmp_path: Path) -> None:
    sp = Spool.open(tmp_path / "spool", max_message_size=4096)
    front, port = _front(sp)
    try:
        with session(port) as smtp:
            assert int(smtp.esmtp_features["size"]) == 4096 - received_room("mx.test")
            smtp.mail("a@example.org")
            smtp.rcpt("b@example.net")
            line = b"x" * 62 + b"\r\n"
            room = 4096 - received_room("mx.test")
            body = line * (room // 64) + b"y" * (room % 64 - 2)  # the most SIZE allows
            code, text = smtp.data(body)
            assert code == 250, text
        (entry,) = sp.list()
        assert entry.body_size <= 4096
    finally:
        front.stop()
        sp.close()


def test_a_relay_bounces_failed_recipients_to_their_sender_but_never_a_bounce(
    tmp_path: Path,
) -> None:
    # SMTP in, a 550 from the next hop, and the RFC 3464 notice relayed back to the sender
    # through the same next hop; a message from <> that fails is dropped, not bounced.
    # The next hop is a transport map's (--transport-map: the routes agent).
    import email
    import email.policy

    controller, sink, sink_port = start_sink()
    d, port = str(tmp_path / "spool"), free_port()
    (tmp_path / "transport").write_text(f"*  smtp:127.0.0.1:{sink_port}\n")
    try:
        args = ["--smtp", f"127.0.0.1:{port}", "--transport-map", str(tmp_path / "transport")]
        with owner(d, *args, "--bounces", "--smtp-hostname", "relay.example.org"):
            with session(port) as smtp:
                smtp.sendmail("a@example.org", ["nouser1@example.net", "ok@example.net"], MESSAGE)
                smtp.sendmail("<>", ["nouser2@example.net"], MESSAGE)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not (
                len(sink.received) >= 2 and "dropped, never bounced" in read(d + ".log")
            ):
                time.sleep(0.05)
            time.sleep(1)  # time enough for a bounce of the bounce, which must not come
            with connect(d) as client:
                left = list(client.list())
    finally:
        controller.stop()
    assert left == []
    assert [(s, r) for s, r, _ in sink.received] == [
        ("a@example.org", ("ok@example.net",)),
        ("<>", ("a@example.org",)),
    ]
    notice = email.message_from_bytes(sink.received[1][2], policy=email.policy.default)
    assert notice.get_content_type() == "multipart/report"
    (_, block) = list(notice.iter_parts())[1].get_payload()
    assert block["Final-Recipient"] == "rfc822; nouser1@example.net"
    assert block["Status"] == "5.1.1" and "no such user" in block["Diagnostic-Code"]
    assert "MAILER-DAEMON@relay.example.org" in notice["From"]
    log = read(d + ".log")
    assert "sender non-delivery notification" in log and "dropped, never bounced" in log


def test_a_client_gone_after_the_dot_never_wedges_the_owner(served: tuple[str, int]) -> None:
    # Found by an adversarial review: a client that closed right after the final dot got
    # its session's awaited accept cancelled, which killed the log writer's flusher; the
    # next transaction then waited for ever.
    import socket

    _d, port = served
    for i in range(3):
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            raw.recv(1024)
            raw.sendall(
                b"EHLO gone.example\r\nMAIL FROM:<a@example.org>\r\n"
                b"RCPT TO:<b%d@example.net>\r\nDATA\r\n" % i
            )
            time.sleep(0.2)
            raw.sendall(MESSAGE + b".\r\n")  # and gone, without the reply
    with session(port) as smtp:
        smtp.timeout = 20
        assert smtp.sendmail("a@example.org", ["c@example.net"], MESSAGE) == {}


def test_relay_domains_match_in_either_form_and_long_lines_get_an_enhanced_code(
    tmp_path: Path,
) -> None:
    # Found by an adversarial review: a --relay-domain given in Unicode never matched (it
    # was compared with A-labels); aiosmtpd's long-line reply had no enhanced code.
    sp = Spool.open(tmp_path / "spool")
    port = free_port()
    front = SmtpFrontEnd(
        AsyncSpool(sp),
        [("127.0.0.1", port)],
        hostname="mx.test",
        mynetworks=["192.0.2.0/24"],  # the test's client is outside: relay control applies
        relay_domains=["bücher.example"],
    )
    front.start()
    try:
        with session(port) as smtp:
            smtp.mail("a@example.org", ["SMTPUTF8"])
            assert smtp.rcpt("user@bücher.example")[0] == 250
            assert smtp.rcpt("other@xn--bcher-kva.example")[0] == 250
            assert smtp.rcpt("user@elsewhere.example")[0] == 554
            code, text = smtp.data(b"Subject: x\r\n\r\n" + b"y" * 1200 + b"\r\n")
            assert (code, text[:5]) == (500, b"5.6.0")
    finally:
        front.stop()
        sp.close()


def test_a_message_of_the_announced_size_fits_whatever_the_names(tmp_path: Path) -> None:
    # Found by an adversarial review: a long --smtp-hostname, EHLO name and recipient made
    # the Received: header outgrow the room kept for it: a message of exactly the
    # announced SIZE got 552.
    sp = Spool.open(tmp_path / "spool", max_message_size=20000)
    port = free_port()
    hostname = "h" * 60 + "." + "i" * 60 + "." + "j" * 60 + ".example"
    front = SmtpFrontEnd(AsyncSpool(sp), [("127.0.0.1", port)], hostname=hostname)
    front.start()
    try:
        with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
            smtp.ehlo("e" * 500)
            size = int(smtp.esmtp_features["size"])
            assert size == front.size_limit
            line = b"x" * 62 + b"\r\n"
            body = line * (size // 64) + b"y" * (size % 64 - 2)
            rcpt = "r" * 64 + "@" + "d" * 60 + "." + "e" * 60 + "." + "f" * 60 + ".example"
            smtp.mail("a@example.org")
            assert smtp.rcpt(rcpt)[0] == 250
            code, text = smtp.data(body)
            assert code == 250, text
    finally:
        front.stop()
        sp.close()


def test_starttls_is_offered_with_a_certificate_and_marked_in_received(tmp_path: Path) -> None:
    import ssl

    cert, key = self_signed(tmp_path)
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--tls-cert", cert, "--tls-key", key]
    with owner(d, *args, "--smtp-hostname", "mx.test"):
        with session(port) as smtp:
            assert "starttls" in smtp.esmtp_features
            client = ssl.create_default_context(cafile=cert)
            client.check_hostname = False  # the certificate names mx.test, not 127.0.0.1
            smtp.starttls(context=client)
            smtp.ehlo("client.example.org")
            assert smtp.sendmail("a@example.org", ["b@example.net"], MESSAGE) == {}
        with session(port) as smtp:  # STARTTLS offered, never required
            assert smtp.sendmail("a@example.org", ["c@example.net"], MESSAGE) == {}
    received = {}
    with Spool.open(d) as sp:
        while (attempt := sp.claim()) is not None:
            with attempt:
                received[attempt.envelope.recipients[0]] = attempt.read_data().split(b";")[0]
                attempt.delivered(attempt.envelope.recipients, "250 ok")
    assert b"by mx.test (spool) with ESMTPS\r\n" in received["b@example.net"]  # RFC 3848
    assert b"by mx.test (spool) with ESMTP\r\n" in received["c@example.net"]


def test_tls_options_are_checked_before_anything_starts(tmp_path: Path) -> None:
    from tests.serve.test_cli_with_owner import spool_cmd

    cert, key = self_signed(tmp_path)
    d = str(tmp_path / "spool")
    smtp = ["--smtp", "127.0.0.1:2525"]
    done = spool_cmd("serve", d, *smtp, "--tls-cert", cert)
    assert done.returncode == 2 and "both --tls-cert and --tls-key" in done.stderr
    done = spool_cmd("serve", d, "--tls-cert", cert, "--tls-key", key)
    assert done.returncode == 2 and "give --smtp" in done.stderr
    done = spool_cmd("serve", d, *smtp, "--tls-cert", key, "--tls-key", key)
    assert done.returncode == 2 and "cannot use them" in done.stderr
    done = spool_cmd("serve", d, *smtp, "--relay-domain", "bad..domain")
    assert done.returncode == 2 and "--relay-domain" in done.stderr
    assert not (tmp_path / "spool").exists()


def test_a_stop_says_421_to_every_session(tmp_path: Path) -> None:
    # Before: a stop dropped the sessions without a word (RFC 5321 3.8 wants a 421), and
    # one whose message was being stored lost its 250 (sent again by its client).
    d, port = str(tmp_path / "spool"), free_port()
    with owner(d, "--smtp", f"127.0.0.1:{port}") as proc:
        idle, mid, data = (socket_module.create_connection(("127.0.0.1", port), 30) for _ in "abc")
        readers = {sock: sock.makefile("rb") for sock in (idle, mid, data)}

        def say(sock: socket_module.socket, command: bytes, code: bytes) -> None:
            sock.sendall(command + b"\r\n")
            while (line := readers[sock].readline())[3:4] == b"-":
                pass
            assert line.startswith(code + b" "), line

        for sock in (idle, mid, data):
            assert readers[sock].readline().startswith(b"220 ")
            say(sock, b"EHLO client.example.org", b"250")
        for sock in (mid, data):
            say(sock, b"MAIL FROM:<a@example.org>", b"250")
            say(sock, b"RCPT TO:<b@example.net>", b"250")
        say(data, b"DATA", b"354")
        data.sendall(MESSAGE)  # the message, not yet its end
        proc.send_signal(signal.SIGTERM)
        for sock in (idle, mid):
            said = readers[sock].readline()
            assert said.startswith(b"421 4.3.2 "), said
        say(data, b".", b"250")  # the stop waited for it: stored and answered
        assert readers[data].readline().startswith(b"421 4.3.2 ")
        for sock in (idle, mid, data):
            assert readers[sock].read(1) == b""  # then closed
            readers[sock].close()
            sock.close()
        assert proc.wait(60) == 0
    with Spool.open(d) as sp:
        assert [e.recipients for e in sp.list()] == [("b@example.net",)]


def test_a_stop_says_421_inside_a_starttls_session_too(tmp_path: Path) -> None:
    # The 421 must go through the TLS layer the session switched to, not under it.
    import ssl

    cert, key = self_signed(tmp_path)
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--tls-cert", cert, "--tls-key", key]
    with owner(d, *args) as proc, session(port) as smtp:
        smtp.starttls(context=ssl.create_default_context(cafile=cert))
        smtp.ehlo("client.example.org")
        assert smtp.mail("a@example.org")[0] == 250
        proc.send_signal(signal.SIGTERM)
        code, text = smtp.getreply()
        assert (code, text[:5]) == (421, b"4.3.2"), (code, text)
        assert proc.wait(60) == 0


def test_an_untrusted_client_cannot_route_through_a_relay_domain(tmp_path: Path) -> None:
    # Found by review: u%evil.test@ours and evil.test!u@ours were taken from a client
    # outside mynetworks; a next hop honouring that old syntax relays on (an open relay).
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--mynetworks", "192.0.2.0/24"]
    with owner(d, *args, "--relay-domain", "example.net"), session(port) as smtp:
        smtp.mail("a@example.org")
        for routed in ("u%evil.test@example.net", "evil.test!u@example.net"):
            code, text = smtp.rcpt(routed)
            assert (code, text) == (554, f"5.7.1 <{routed}>: Relay access denied".encode())
        assert smtp.rcpt("u@example.net")[0] == 250


def test_a_message_past_the_hop_limit_is_refused_as_a_loop(tmp_path: Path) -> None:
    # Found by review: a relay sending to itself accepted the message 642 times in 6 s,
    # one Received: more each time, with no end but the size limit.
    d, port = str(tmp_path / "spool"), free_port()
    args = ["--smtp", f"127.0.0.1:{port}", "--agent", f"smtp:127.0.0.1:{port}", "--workers", "1"]
    with owner(d, *args), connect(d) as client:
        with session(port) as smtp:
            many = b"".join(b"Received: from hop%d\r\n" % i for i in range(49)) + MESSAGE
            assert smtp.sendmail("a@example.org", ["b@example.net"], many) == {}
            too_many = b"Received: from hop49\r\n" + many
            with pytest.raises(smtplib.SMTPDataError) as refused:
                smtp.sendmail("a@example.org", ["b@example.net"], too_many)
            assert refused.value.smtp_code == 554 and b"5.4.6" in refused.value.smtp_error
        # The one taken (its 50th Received: ours) is sent to ourselves once and refused:
        # it fails instead of going round for ever.
        deadline = time.monotonic() + 60
        while client.statistics().failed < 1 and time.monotonic() < deadline:
            time.sleep(0.1)
        stats = client.statistics()
    assert (stats.accepted, stats.failed) == (1, 1)


def test_bare_line_feeds_are_stored_as_crlf(tmp_path: Path) -> None:
    d, port = str(tmp_path / "spool"), free_port()
    with owner(d, "--smtp", f"127.0.0.1:{port}"), session(port) as smtp:
        smtp.mail("a@example.org")
        smtp.rcpt("b@example.net")
        smtp.send(b"DATA\r\n")
        assert smtp.getreply()[0] == 354
        smtp.send(b"Subject: x\nX-Test: y\n\nline1\nline2\r\n.\r\n")
        assert smtp.getreply()[0] == 250
    with Spool.open(d) as sp:
        attempt = sp.claim()
        assert attempt is not None
        data = attempt.read_data()
        attempt.close()
    assert data.endswith(b"Subject: x\r\nX-Test: y\r\n\r\nline1\r\nline2\r\n")
    assert b"\n" not in data.replace(b"\r\n", b"")


@pytest.mark.slow
def test_an_owner_killed_under_smtp_load_relays_every_250_and_nothing_refused(
    tmp_path: Path,
) -> None:
    # SIGKILL the owner (and with it its SMTP listener) while sessions send, twice; then
    # restart and drain into the sink. Every message that got its 250 reaches the sink;
    # none that got a refusal (a 554 after DATA: one in four carries a Received: header
    # too many, a loop) ever does. A session cut by the kill got no reply: its message may
    # or may not have been taken, and either is right.
    controller, sink, sink_port = start_sink()
    d, port = str(tmp_path / "spool"), free_port()
    # An attempt the kill cut short is retried after the first interval: short here.
    Spool.open(d, retry_intervals=[0.5, 1.0]).close()
    args = ["--smtp", f"127.0.0.1:{port}", "--agent", f"smtp:127.0.0.1:{sink_port}"]
    hops = b"".join(b"Received: from hop%d\r\n" % i for i in range(50))
    taken: set[str] = set()
    refused: set[str] = set()

    def send(client: int) -> None:
        for i in range(10**6):
            token = f"c{client}.{i}.{time.monotonic_ns()}"
            loop = i % 4 == 3
            data = (hops if loop else b"") + MESSAGE + f"X-Token: {token}\r\n".encode()
            try:
                with session(port) as smtp:
                    smtp.sendmail("a@example.org", [f"u{i % 3}@example.net"], data)
            except smtplib.SMTPDataError as exc:
                assert loop and exc.smtp_code == 554, exc
                refused.add(token)
                continue
            except (OSError, smtplib.SMTPException):
                return  # the kill: no reply, so neither taken nor refused
            assert not loop, token
            taken.add(token)

    try:
        for _round in range(2):
            with (
                owner(d, *args, "--workers", "2") as proc,
                concurrent.futures.ThreadPoolExecutor(4) as pool,
            ):
                sessions = [pool.submit(send, c) for c in range(4)]
                time.sleep(1.5)
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                for s in sessions:
                    s.result(timeout=60)
        with owner(d, *args, "--workers", "2"):
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                with sink.lock:
                    relayed = {_token(content) for _s, _r, content in sink.received}
                if taken <= relayed:
                    break
                time.sleep(0.2)
    finally:
        controller.stop()
    assert taken and refused, "the sessions sent nothing before the kills"
    assert taken <= relayed, f"lost after a 250: {sorted(taken - relayed)[:5]}"
    assert not refused & relayed, f"relayed after a refusal: {sorted(refused & relayed)[:5]}"


def _token(content: bytes) -> str:
    return content.split(b"X-Token: ")[1].split(b"\r\n")[0].decode()


def test_two_listeners_a_pipelined_session_and_a_greylisted_recipient_retried(
    tmp_path: Path,
) -> None:
    # Two --smtp listeners; on the second, a client that pipelines (RFC 2920: the whole
    # envelope and DATA in one write, the message and QUIT in another) gets each reply in
    # order. The next hop greylists one recipient once: it is deferred, retried after the
    # spool's interval and delivered; the other recipient is delivered by the first try.
    controller, sink, sink_port = start_sink()
    d, port1, port2 = str(tmp_path / "spool"), free_port(), free_port()
    Spool.open(d, retry_intervals=[0.5, 1.0]).close()
    args = ["--smtp", f"127.0.0.1:{port1}", "--smtp", f"127.0.0.1:{port2}"]
    try:
        with owner(d, *args, "--agent", f"smtp:127.0.0.1:{sink_port}", "--workers", "1"):
            with socket_module.create_connection(("127.0.0.1", port2), timeout=30) as raw:
                replies = raw.makefile("rb")

                def reply() -> bytes:
                    lines = [replies.readline()]
                    while lines[-1][3:4] == b"-":
                        lines.append(replies.readline())
                    return b"".join(lines)

                assert reply().startswith(b"220 ")
                raw.sendall(b"EHLO client.example.org\r\n")
                assert b"250-PIPELINING" in reply()
                raw.sendall(
                    b"MAIL FROM:<a@example.org>\r\nRCPT TO:<ok@example.net>\r\n"
                    b"RCPT TO:<greyonce@example.net>\r\nDATA\r\n"
                )
                assert [reply()[:3] for _ in range(4)] == [b"250", b"250", b"250", b"354"]
                raw.sendall(MESSAGE + b"X-Token: piped\r\n.\r\nQUIT\r\n")
                queued, bye = reply(), reply()
                assert queued.startswith(b"250 2.0.0 Ok: queued as "), queued
                assert bye.startswith(b"221"), bye
            with session(port1) as smtp:
                assert smtp.sendmail("b@example.org", ["ok2@example.net"], MESSAGE) == {}
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and len(sink.received) < 3:
                time.sleep(0.05)
            with connect(d) as client:
                # The sink has the retry before the worker's report reaches the owner.
                while (left := list(client.list())) and time.monotonic() < deadline:
                    time.sleep(0.05)
                stats = client.statistics()
    finally:
        controller.stop()
    got = sorted((s, r) for s, r, _ in sink.received)
    assert got == [
        ("a@example.org", ("greyonce@example.net",)),
        ("a@example.org", ("ok@example.net",)),
        ("b@example.org", ("ok2@example.net",)),
    ]
    assert sink.greylisted == {"greyonce@example.net"}
    assert left == [] and stats.deferred >= 1 and stats.delivered == 3
    assert all(b"X-Token: piped" in c for s, _, c in sink.received if s == "a@example.org")
