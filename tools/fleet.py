"""A fleet simulator: days of mail through real spools, with the truth kept aside.

``python -m tools.fleet OUT [--servers 3] [--hours 24] [--per-hour 60] [--seed 1]`` makes
one spool per server under ``OUT`` (``OUT/mx1``, ...; each archiving its retired segments
in ``OUT/mx1-archive``) and drives it through the public API with a fake clock: messages
accepted every simulated minute, everything due claimed and delivered by the behaviour of
its recipient's domain, a checkpoint every simulated hour. ``OUT/truth.json`` holds what
the simulator did and saw, one row per message and recipient, for the analytics' tests to
compare every report figure with.

The domains behave as mail operators meet them:

- ``fast.example``: delivered at the first attempt;
- ``greylist.example``: deferred once (451 4.7.1), delivered at the next attempt;
- ``slow.example``: half the attempts time out (421 4.4.2), the others deliver;
- ``strict.example``: unknown users (local part ``nobody*``) fail with 550 5.1.1;
- ``spamcheck.example``: one message in ten is refused as spam (550 5.7.1);
- ``blackhole.example``: never answers (451 4.4.1): its mail expires after the lifetime.

A few messages are held by the operator and released an hour later, and a few deleted.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import sys
from typing import Any

import attrs

from spool import Spool
from spool.testing import FakeClock

START = 1_793_491_200.0  # 2026-11-01 00:00:00 UTC
RETRY_INTERVALS = (300.0, 1800.0, 3600.0)
MAX_LIFETIME = 6 * 3600.0
SEGMENT_SIZE = 256 * 1024
INLINE_BODY_MAX = 8 * 1024

DOMAINS = (
    "fast.example",
    "greylist.example",
    "slow.example",
    "strict.example",
    "spamcheck.example",
    "blackhole.example",
)
DOMAIN_WEIGHTS = (40, 15, 15, 15, 10, 5)
SENDER_DOMAINS = ("shop.example", "news.example", "corp.example", "bank.example")

DELIVERED = "250 2.0.0 Ok: queued as {n}"
GREYLISTED = "451 4.7.1 <{rcpt}>: Recipient address rejected: greylisted, try again in 300s"
TIMED_OUT = "421 4.4.2 {domain}: connection timed out after 30s"
UNKNOWN_USER = "550 5.1.1 <{rcpt}>: Recipient address rejected: User unknown"
SPAM = "550 5.7.1 Message {n} rejected as spam"
NO_ANSWER = "451 4.4.1 {domain}: no answer from host"


@attrs.define
class Recipient:
    """The truth of one recipient: what the simulator did and saw."""

    server: str
    msg_id: str
    recipient: str
    domain: str
    sender: str
    size: int
    accepted_at: float
    status: str = "queued"  # delivered, failed, expired, deleted or queued
    attempts: int = 0
    final_at: float | None = None  # an expiry's: the minute the spool was seen to end it
    last_reply: str | None = None
    first_attempt_at: float | None = None
    held: bool = False  # its message was held by the operator (and released an hour later)


class Server:
    """One simulated relay: a spool, its clock and its recipients' truth."""

    def __init__(self, name: str, root: str, rng: random.Random, archive: bool) -> None:
        self.name = name
        self.clock = FakeClock(START)
        self.rng = rng
        self.truth: dict[tuple[str, str], Recipient] = {}
        self.greylisted: set[tuple[str, str]] = set()
        self.held: dict[str, float] = {}
        self.accepted: collections.deque[tuple[float, str]] = collections.deque()
        self.aging: set[str] = set()  # past their lifetime: expired when they leave the queue
        self.recipients_of: dict[str, list[Recipient]] = {}
        self.spool = Spool.open(
            os.path.join(root, name),
            clock=self.clock,
            retry_intervals=RETRY_INTERVALS,
            max_lifetime=MAX_LIFETIME,
            segment_size=SEGMENT_SIZE,
            inline_body_max=INLINE_BODY_MAX,
            archive_dir=f"../{name}-archive" if archive else None,
            min_free_bytes=0,
        )
        self.serial = 0

    def accept_some(self, count: int) -> None:
        for _ in range(count):
            self.serial += 1
            sender = (
                f"{self.rng.choice(['orders', 'info', 'alerts'])}@{self.rng.choice(SENDER_DOMAINS)}"
            )
            rcpts = []
            for _ in range(self.rng.choice((1, 1, 1, 2, 3))):
                domain = self.rng.choices(DOMAINS, DOMAIN_WEIGHTS)[0]
                user = (
                    "nobody" if domain == "strict.example" and self.rng.random() < 0.4 else "user"
                )
                rcpts.append(f"{user}{self.rng.randrange(500)}@{domain}")
            rcpts = list(dict.fromkeys(rcpts))
            size = int(self.rng.lognormvariate(8.5, 1.2)) + 200
            data = f"Subject: message {self.serial}\r\n\r\n".encode() + b"x" * size
            msg_id = self.spool.accept(sender, rcpts, data)
            self.accepted.append((self.clock.wall(), msg_id))
            for r in rcpts:
                self.truth[(msg_id, r)] = Recipient(
                    self.name, msg_id, r, r.split("@")[1], sender, len(data), self.clock.wall()
                )
            self.recipients_of[msg_id] = [self.truth[(msg_id, r)] for r in rcpts]
            if self.rng.random() < 0.01:
                self.spool.hold(msg_id, "held for review")
                self.held[msg_id] = self.clock.wall() + 3600
                for r in rcpts:
                    self.truth[(msg_id, r)].held = True
            elif self.rng.random() < 0.005:
                self.spool.delete(msg_id)
                self._end(msg_id, "deleted", None)

    def release_due(self) -> None:
        now = self.clock.wall()
        for msg_id, at in list(self.held.items()):
            if at <= now:
                self.spool.release(msg_id)
                del self.held[msg_id]

    def deliver_due(self) -> None:
        while (attempt := self.spool.claim()) is not None:
            with attempt:
                for r in attempt.envelope.recipients:
                    status, reply = self._answer(attempt.msg_id, r)
                    t = self.truth[(attempt.msg_id, r)]
                    t.attempts += 1
                    if t.first_attempt_at is None:
                        t.first_attempt_at = self.clock.wall()
                    t.last_reply = reply
                    if status == "delivered":
                        attempt.delivered([r], reply)
                    elif status == "failed":
                        attempt.failed([r], reply)
                    else:
                        attempt.deferred([r], reply)
                        continue
                    t.status, t.final_at = status, self.clock.wall()

    def note_expiries(self) -> None:
        """Messages past their lifetime that the spool ended unasked (at a claim) expired
        now: looked for once a minute, after the claims, as the spool ends them then."""
        now = self.clock.wall()
        while self.accepted and self.accepted[0][0] + MAX_LIFETIME <= now:
            msg_id = self.accepted.popleft()[1]
            if any(t.status == "queued" for t in self.recipients_of[msg_id]):
                self.aging.add(msg_id)
        if not self.aging:
            return
        live = {e.msg_id for e in self.spool.list()}
        for msg_id in [m for m in self.aging if m not in live]:
            self.aging.discard(msg_id)
            self._end(msg_id, "expired", None)

    def _answer(self, msg_id: str, rcpt: str) -> tuple[str, str]:
        domain = rcpt.split("@")[1]
        n = self.rng.randrange(10**6)
        if domain == "greylist.example" and (msg_id, rcpt) not in self.greylisted:
            self.greylisted.add((msg_id, rcpt))
            return "deferred", GREYLISTED.format(rcpt=rcpt)
        if domain == "slow.example" and self.rng.random() < 0.5:
            return "deferred", TIMED_OUT.format(domain=domain)
        if domain == "strict.example" and rcpt.startswith("nobody"):
            return "failed", UNKNOWN_USER.format(rcpt=rcpt)
        if domain == "spamcheck.example" and self.rng.random() < 0.1:
            return "failed", SPAM.format(n=n)
        if domain == "blackhole.example":
            return "deferred", NO_ANSWER.format(domain=domain)
        return "delivered", DELIVERED.format(n=f"{n:06X}")

    def _end(self, msg_id: str, status: str, reply: str | None) -> None:
        for t in self.recipients_of[msg_id]:
            if t.status == "queued":
                t.status, t.final_at = status, self.clock.wall()
                t.last_reply = reply or t.last_reply  # an expiry keeps the last deferral's

    def finish(self) -> None:
        """Close the spool; what it still lists is queued, what it ended unasked expired."""
        queued = {(e.msg_id, r) for e in self.spool.list() for r in e.recipients}
        for key, t in self.truth.items():
            if t.status == "queued" and key not in queued:
                t.status = "expired"
        self.spool.close()


def simulate(
    out: str,
    *,
    servers: int = 3,
    hours: int = 24,
    per_hour: int = 60,
    seed: int = 1,
    archive: bool = True,
    progress: bool = False,
) -> list[dict[str, Any]]:
    """Run the fleet; write and return the truth (one dict per message and recipient)."""
    os.makedirs(out, exist_ok=True)
    rng = random.Random(seed)
    fleet = [
        Server(f"mx{i + 1}", out, random.Random(rng.random()), archive) for i in range(servers)
    ]
    for minute in range(hours * 60):
        for server in fleet:
            hour_of_day = (minute // 60) % 24
            rate = per_hour * (1.5 if 8 <= hour_of_day < 18 else 0.5) / 60
            server.accept_some(_poisson(server.rng, rate))
            server.release_due()
            server.deliver_due()
            server.note_expiries()
            if minute % 60 == 59:
                server.spool.checkpoint()
            server.clock.advance(60)
        if progress and minute % 60 == 59:
            print(f"fleet: hour {minute // 60 + 1} of {hours}", file=sys.stderr, flush=True)
    rows: list[dict[str, Any]] = []
    for server in fleet:
        server.finish()
        rows.extend(attrs.asdict(t) for t in server.truth.values())
    with open(os.path.join(out, "truth.json"), "w") as f:
        json.dump(rows, f)
    return rows


def _poisson(rng: random.Random, mean: float) -> int:
    """A Poisson-distributed count (Knuth's method; the means here are small)."""
    limit, k, p = pow(2.718281828459045, -mean), 0, 1.0
    while True:
        p *= rng.random()
        if p <= limit:
            return k
        k += 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out")
    parser.add_argument("--servers", type=int, default=3)
    parser.add_argument("--hours", type=int, default=24)
    parser.add_argument("--per-hour", type=int, default=60)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--no-archive", action="store_true")
    args = parser.parse_args(argv)
    rows = simulate(
        args.out,
        servers=args.servers,
        hours=args.hours,
        per_hour=args.per_hour,
        seed=args.seed,
        archive=not args.no_archive,
        progress=True,
    )
    messages = len({(r["server"], r["msg_id"]) for r in rows})
    print(f"fleet: {messages} messages, {len(rows)} recipients in {args.out} (truth.json)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
