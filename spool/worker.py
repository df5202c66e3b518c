"""A delivery worker process: claim over the control socket, deliver, report, close.

``spool serve --workers N --agent SPEC`` starts N of these (``supervisor.py``); one can
also be run by hand against a running owner: ``python -m spool.worker DIR --agent SPEC``.
The loop claims an attempt (one at a time: its lease runs from the claim) with its body,
hands it to the agent (``spool.agents``), then reports each recipient by its reply and
closes the attempt in one round trip (``settle``: delivered and failed durable first).
A worker runs ``--concurrency`` such loops (threads, each with its own agent, as each
Postfix smtp(8) process has its own connection), so their durable reports share the
owner's fsyncs. It exits after ``--max-use`` attempts (the owner starts a fresh one, as
Postfix's ``max_use``), when the owner goes away (at once, even with an agent stuck in a
delivery: ``ABANDON_AFTER``), or on SIGTERM once the message in hand is settled. SIGINT
is left to the owner (a Ctrl-C at a terminal reaches the whole process group; the owner
then stops its workers with SIGTERM).

Crash safety: a worker writes nothing itself. If it dies, the owner sees its connection
drop and closes its attempts: recipients it reported keep their outcome, the others are
deferred (docs/serve.md).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, Final

import click

from spool.agents import Agent, load_agent, status_of
from spool.arguments import check_text
from spool.client import Client, RemoteAttempt, connect
from spool.errors import OwnerUnreachable, SpoolError, SpoolMisuse
from spool.logs import setup_logging
from spool.options import TEXT_MAX
from spool.stop_signals import StopSignals

# Attempts claimed per round trip. One: a lease runs from the claim, and a loop delivers
# its attempts one after another, so a batch's last attempt would spend its lease waiting.
BATCH: Final = 1
CONCURRENCY: Final = 4  # delivery loops (threads) per worker process
POLL: Final = 0.2  # seconds between the main thread's looks at its loops
CLAIM_WAIT: Final = 1.0  # seconds a claim waits for work before the loop looks around
ABANDON_AFTER: Final = 2.0  # seconds a loop stuck in its agent outlives its owner

log = logging.getLogger("spool.worker")


def deliver_one(agent: Agent, attempt: RemoteAttempt) -> None:
    """One attempt through the agent, reported recipient by recipient, then closed.

    An agent that sends a message in groups (one per domain or next hop: ``mx``,
    ``routes``; ``reports_groups``) hands each group's replies over as it finishes it,
    and its delivered and failed recipients are reported (durable) before the next group
    is sent: a worker killed later (its lease, a crash) leaves them settled, so that no
    retry sends them again."""
    with attempt:
        envelope = attempt.envelope
        settled: set[str] = set()

        def report_early(group: Mapping[str, str]) -> None:
            final = {
                r: reply
                for r, reply in ((r, _recordable(reply)) for r, reply in group.items())
                if r in envelope.recipients
                and r not in settled
                and _well_formed(reply)
                and status_of(reply) != "deferred"
            }
            for (status, reply), rcpts in _grouped(envelope.recipients, final, attempt):
                getattr(attempt, status)(rcpts, reply)  # durable on return
                settled.update(rcpts)  # each call's own, should a later one raise

        try:
            if getattr(agent, "reports_groups", False):
                sent = agent.deliver(envelope, attempt.read_data(), report_early)  # type: ignore[call-arg]
            else:
                sent = agent.deliver(envelope, attempt.read_data())
            replies = {r: reply for r, reply in sent.items() if r not in settled}
        except SpoolError:
            raise
        except Exception as e:  # the agent's own failure defers, never loses, the mail
            log.warning("%s: agent raised %r; recipients deferred", attempt.msg_id, e)
            replies = {
                r: f"451 4.3.0 delivery agent error: {e!r}"[:900]
                for r in envelope.recipients
                if r not in settled
            }
        # Durable outcomes first, then the deferrals, and the close, in one round trip;
        # recipients the agent left out are deferred by the close.
        groups = _grouped(envelope.recipients, replies, attempt)
        order = sorted(groups, key=lambda g: g[0][0] == "deferred")
        attempt.settle((status, rcpts, reply) for (status, reply), rcpts in order)


def _grouped(
    recipients: Sequence[str], replies: Mapping[str, str], attempt: RemoteAttempt
) -> list[tuple[tuple[str, str], list[str]]]:
    """``replies`` as ((status, reply), recipients) in the envelope's order; a reply that
    is no SMTP reply line defers (an agent bug must not be taken for a delivery)."""
    groups: dict[tuple[str, str], list[str]] = {}
    for rcpt in recipients:
        reply = _recordable(replies.get(rcpt))
        if reply is None:
            continue
        if not _well_formed(reply):
            log.warning("%s: agent gave %r for %s; deferred", attempt.msg_id, reply, rcpt)
            reply = BAD_REPLY
        groups.setdefault((status_of(reply), reply), []).append(rcpt)
    return list(groups.items())


class Budget:
    """The attempts a worker may still make (``--max-use``), shared by its threads."""

    def __init__(self, attempts: int) -> None:
        self._left = attempts
        self._lock = threading.Lock()

    def take(self, most: int) -> int:
        with self._lock:
            granted = min(most, self._left)
            self._left -= granted
            return granted

    def give_back(self, unused: int) -> None:
        with self._lock:
            self._left += unused


BAD_REPLY: Final = "451 4.3.0 delivery agent gave no valid reply"


def _recordable(reply: Any) -> Any:
    """A text reply as the spool can record it: a NUL made U+FFFD, a lone surrogate "?",
    cut to ``TEXT_MAX`` bytes. What a next hop said is kept as near as it can be:
    a 250 with a stray byte in its text is still a delivery (taking it for no reply would
    defer the recipient and deliver it again on every retry). Anything else as it is."""
    if not isinstance(reply, str):
        return reply
    text = reply.replace("\x00", "\ufffd").encode("utf-8", "replace")
    return text[:TEXT_MAX].decode("utf-8", "ignore")


def _well_formed(reply: object) -> bool:
    """A reply the spool records (``check_text``: text, at most ``TEXT_MAX`` bytes, no
    NUL) that begins with its code's digit."""
    try:
        check_text(reply, "reply")
    except SpoolMisuse:
        return False
    return isinstance(reply, str) and reply[:1].isdigit()


def run_worker(
    client: Client, agent: Agent, budget: Budget, stop: threading.Event, batch: int = BATCH
) -> None:
    """One delivery loop: until the budget is spent, ``stop`` is set or the owner goes."""
    try:
        while not stop.is_set():
            granted = budget.take(batch)
            if not granted:
                return
            attempts = client.claim_many(granted, CLAIM_WAIT, with_data=True)
            budget.give_back(granted - len(attempts))
            for attempt in attempts:
                if stop.is_set():
                    attempt.close()  # not started: deferred with nothing reported
                    continue
                try:
                    deliver_one(agent, attempt)
                except OwnerUnreachable:
                    raise
                except Exception as e:  # a refused report: the attempt is closed, go on
                    log.error("%s: %r; unreported recipients deferred", attempt.msg_id, e)
    except OwnerUnreachable:
        log.info("the owner went away; worker exits")
        stop.set()


def run_workers(
    client: Client,
    agent_spec: str,
    max_use: int,
    concurrency: int,
    stop: threading.Event,
    term: StopSignals,
) -> None:
    """``concurrency`` delivery loops, each with its own agent (an smtp agent's connection
    is its own), sharing the connection and the ``max_use`` budget. The calling (main)
    thread polls, so that it runs the SIGTERM handler whichever thread the signal hits,
    and passes a received ``term`` on to ``stop``."""
    budget = Budget(max_use)
    agents = [load_agent(agent_spec) for _ in range(concurrency)]
    loops = [
        threading.Thread(target=run_worker, args=(client, agent, budget, stop), daemon=True)
        for agent in agents
    ]
    abandoned: list[threading.Thread] = []
    try:
        for loop in loops:
            loop.start()
        abandoned = _wait_for_loops(client, loops, stop, term)
    finally:
        for loop, agent in zip(loops, agents, strict=True):
            if loop not in abandoned:  # an agent stuck in a delivery may hang its close too
                agent.close()


def _wait_for_loops(
    client: Client,
    loops: list[threading.Thread],
    stop: threading.Event,
    term: StopSignals,
) -> list[threading.Thread]:
    """Wait until every loop has ended; returns the loops given up on.

    When the owner goes away (killed, or its connection lost), a loop whose agent is
    stuck in a delivery would keep this process alive for as long as the agent hangs,
    unseen by any owner. So the loops are told to stop, and those still in their agents
    ``ABANDON_AFTER`` seconds later are left to die with the process: their attempts
    were closed with the connection (the recipients are retried from the spool)."""
    gone_since: float | None = None
    while alive := [loop for loop in loops if loop.is_alive()]:
        alive[0].join(POLL)
        if term.stopped and not stop.is_set():
            stop.set()  # here, not in the handler: see stop_signals.py
        if not client.closed:
            continue
        now = time.monotonic()
        if gone_since is None:
            gone_since = now
            stop.set()
        elif now - gone_since >= ABANDON_AFTER:
            log.warning(
                "the owner went away; %d delivery loop(s) still in their agent abandoned",
                len(alive),
            )
            return alive
    return []


@click.command()
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--agent", "agent_spec", default="demo", show_default=True, help="Delivery agent.")
@click.option("--max-use", default=1000, show_default=True, help="Attempts before exiting.")
@click.option("--concurrency", default=CONCURRENCY, show_default=True, help="Deliveries at once.")
def main(directory: str, agent_spec: str, max_use: int, concurrency: int) -> None:
    """Deliver from the spool DIRECTORY's running owner through AGENT."""
    setup_logging(
        os.environ.get("SPOOL_LOG_FORMAT", "text"),
        "spool-worker",
        os.environ.get("SPOOL_LOG_FILE") or None,
    )
    stop = threading.Event()
    term = StopSignals()  # not stop.set() in the handler: see stop_signals.py
    term.install([signal.SIGTERM])
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        load_agent(agent_spec).close()
        client = connect(directory)
    except SpoolError as e:
        click.echo(f"spool-worker: {e}", err=True)
        sys.exit(1)
    try:
        run_workers(client, agent_spec, max_use, concurrency, stop, term)
    finally:
        client.close()


if __name__ == "__main__":
    main()
