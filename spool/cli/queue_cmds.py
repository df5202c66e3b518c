"""``spool list`` and ``spool stats``: the queue as ``mailq``, ``exiqgrep`` and ``qshape``
show it, read from the log on disk (no lock, nothing written)."""

from __future__ import annotations

import collections
import os
import stat
import time
from typing import Any

import click

from spool import format as fmt
from spool.cli.common import (
    DIR,
    DISK,
    JSON,
    emit_json,
    handle_errors,
    human_age,
    human_size,
    human_time,
    plural,
    recorded_options,
    require_spool,
    segment_count,
    segment_progress,
)
from spool.cli.selection import selection_from, selection_options
from spool.positions import load_positions
from spool.queue_view import HELD, QueueEntry, live_messages

AGE_BUCKETS = (5, 10, 20, 40, 80, 160, 320, 640, 1280)  # minutes, as qshape's


def queue(directory: str, label: str, quiet: bool) -> list[QueueEntry]:
    """The live messages, oldest first (a progress bar on a terminal unless ``quiet``)."""
    require_spool(directory)
    intervals = recorded_options(directory).class_intervals()
    with segment_progress(directory, label, quiet) as progress:
        found = live_messages(DISK, directory, intervals, progress)
    return sorted(found.values(), key=lambda e: (e.accepted_at, e.msg_id))


def entry_json(e: QueueEntry) -> dict[str, Any]:
    """One message as ``list --json`` prints it: ``postqueue -j``'s fields where they fit
    (queue_name, queue_id, arrival_time, message_size, sender, recipients with address and
    delay_reason), then the spool's own."""
    return {
        "queue_name": e.state,
        "queue_id": e.msg_id,
        "arrival_time": e.accepted_at,
        "message_size": e.body_size,
        "sender": e.sender,
        "recipients": [{"address": r, "delay_reason": reply} for r, reply in zip_replies(e)],
        "attempts": e.attempts,
        "retry_class": e.klass,
        "next_attempt_at": e.next_attempt_at,
        "held_reason": e.held,
        "last_reply": e.last_reply,
        "body_kind": e.body_kind,
        "envelope_at": str(e.envelope_at),
    }


def zip_replies(e: QueueEntry) -> list[tuple[str, str | None]]:
    """Each pending recipient with its own last reply (None: not attempted yet)."""
    replies = e.replies or (e.last_reply,) * len(e.recipients)
    return list(zip(e.recipients, replies, strict=True))


@click.command(name="list")
@DIR
@selection_options
@click.option("-i", "--ids-only", is_flag=True, help="Only the ids, one a line (exiqgrep -i).")
@click.option("-c", "--count", is_flag=True, help="Only the number of messages (exim -bpc).")
@JSON
@handle_errors
def list_cmd(directory: str, ids_only: bool, count: bool, as_json: bool, **filters: Any) -> None:
    """The queue, like mailq: one message per entry, each pending recipient under the
    last reply it got, then a summary line.

    \b
    Examples:
      spool list var/spool --recipient @example.net --older-than 1h
      spool list var/spool --state deferred --sender ''
      spool list -i var/spool --domain example.com | spool delete var/spool -
    """
    if sum((ids_only, count, as_json)) > 1:
        raise click.UsageError("give one of -i, -c and --json")
    select = selection_from(filters)
    shown = [e for e in queue(directory, "reading the log", ids_only or count) if select(e)]
    if count:
        click.echo(len(shown))
    elif ids_only:
        for e in shown:
            click.echo(e.msg_id)
    elif as_json:
        for e in shown:
            emit_json(entry_json(e))
    else:
        print_queue(shown, time.time())


def print_queue(shown: list[QueueEntry], now: float) -> None:
    if shown:
        click.echo(
            f"{'ID':<16}  {'AGE':>6}  {'SIZE':>9}  {'CLS':>3}  {'ATT':>3}  "
            f"{'NEXT':>6}  {'STATE':<8}  SENDER"
        )
    for e in shown:
        if e.held:
            nxt = "held"
        else:
            nxt = "now" if e.next_attempt_at <= now else human_age(e.next_attempt_at - now)
        click.echo(
            f"{e.msg_id:<16}  {human_age(now - e.accepted_at):>6}  "
            f"{human_size(e.body_size):>9}  {e.klass:>3}  {e.attempts:>3}  {nxt:>6}  "
            f"{e.state:<8}  <{e.sender}>"
        )
        if e.held:
            click.echo(f"{'':18}(held: {e.held})")
        # As mailq: each reply once, in parentheses, above the recipients that got it.
        by_reply: dict[str | None, list[str]] = {}
        for rcpt, reply in zip_replies(e):
            by_reply.setdefault(reply, []).append(rcpt)
        for reply, rcpts in sorted(by_reply.items(), key=lambda kv: kv[0] is not None):
            if reply is not None:
                click.echo(f"{'':18}({reply})")
            for rcpt in rcpts:
                click.echo(f"{'':18}{rcpt}")
    rcpts_total = sum(len(e.recipients) for e in shown)
    size = sum(e.body_size for e in shown)
    click.echo(
        f"-- {plural(len(shown), 'message')}, {plural(rcpts_total, 'recipient')}, "
        f"{human_size(size)}"
    )


def shape_of(entries: list[QueueEntry], now: float, by_sender: bool) -> dict[str, list[int]]:
    """qshape's table: pending recipients by domain (the recipients', or with
    ``by_sender`` the senders', as ``qshape -s``) and age bucket."""
    shape: dict[str, list[int]] = collections.defaultdict(lambda: [0] * (len(AGE_BUCKETS) + 1))
    for e in entries:
        minutes = (now - e.accepted_at) / 60
        bucket = next((i for i, b in enumerate(AGE_BUCKETS) if minutes < b), len(AGE_BUCKETS))
        if by_sender:
            shape[e.sender.rpartition("@")[2].lower() or "<>"][bucket] += len(e.recipients)
        else:
            for r in e.recipients:
                shape[r.rpartition("@")[2].lower()][bucket] += 1
    return dict(shape)


@click.command()
@DIR
@click.option("-s", "--senders", is_flag=True, help="The table by sender domain (qshape -s).")
@JSON
@handle_errors
def stats(directory: str, senders: bool, as_json: bool) -> None:
    """Counts by class and state, a qshape table, disk use, and the log positions.

    The age table counts the pending recipients of mail waiting for delivery; held mail
    waits for the operator, not for the age, so it is counted apart.

    \b
    Examples:
      spool stats var/spool
      spool stats var/spool --senders
    """
    entries = queue(directory, "reading the log", as_json)
    now = time.time()
    waiting = [e for e in entries if e.state != HELD]
    held = [e for e in entries if e.state == HELD]
    by_state = collections.Counter(e.state for e in entries)
    by_class = collections.Counter(e.klass for e in entries)
    disk = disk_use(directory)
    positions = load_positions(DISK, directory)
    segments = segment_count(directory)
    if as_json:
        emit_json(
            {
                "messages": len(entries),
                "recipients": sum(len(e.recipients) for e in entries),
                "by_state": dict(by_state),
                "by_class": {str(k): v for k, v in sorted(by_class.items())},
                "qshape": {
                    "buckets_minutes": list(AGE_BUCKETS),
                    "domains": shape_of(waiting, now, by_sender=False),
                    "sender_domains": shape_of(waiting, now, by_sender=True),
                },
                "held": {
                    "messages": len(held),
                    "recipients": sum(len(e.recipients) for e in held),
                },
                "disk_bytes": disk,
                "segments": segments,
                "positions": None
                if positions is None
                else {
                    "consistent": str(positions.consistent),
                    "working_start": str(positions.working_start),
                    "garbage_front": str(positions.front),
                    "runner_cursors": [str(c) for c in positions.cursors],
                    "written_at": positions.written_at,
                },
            }
        )
        return
    rcpts = sum(len(e.recipients) for e in entries)
    click.echo(f"{plural(len(entries), 'message')}, {plural(rcpts, 'recipient')}")
    click.echo("by state: " + (", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "-"))
    click.echo("by class: " + (", ".join(f"{k}: {v}" for k, v in sorted(by_class.items())) or "-"))
    click.echo("")
    print_shape(shape_of(waiting, now, senders), "sender domain" if senders else "domain")
    held_rcpts = sum(len(e.recipients) for e in held)
    click.echo(
        f"held (not in the table): {plural(len(held), 'message')}, "
        f"{plural(held_rcpts, 'recipient')}"
    )
    click.echo("")
    click.echo(
        "disk: "
        + ", ".join(f"{k} {human_size(v)}" for k, v in disk.items())
        + f"; {plural(segments, 'segment')}"
    )
    if positions is None:
        click.echo("positions: none (the next open scans the whole log)")
    else:
        click.echo(f"positions (written {human_time(positions.written_at)}):")
        click.echo(
            f"  consistent up to {positions.consistent}, working suffix from "
            f"{positions.working_start}, garbage front {positions.front}"
        )
        click.echo(
            "  runners: " + ", ".join(f"class {k} at {c}" for k, c in enumerate(positions.cursors))
        )


def print_shape(shape: dict[str, list[int]], what: str) -> None:
    header = f"{what:<28}{'total':>6}" + "".join(f"{b:>6}" for b in AGE_BUCKETS) + f"{'more':>6}"
    click.echo(header + "   (pending recipients by age in minutes, as qshape)")
    rows = sorted(shape.items(), key=lambda kv: (-sum(kv[1]), kv[0]))
    totals = [sum(col) for col in zip(*shape.values(), strict=True)] if shape else [0] * 10
    click.echo(f"{'TOTAL':<28}{sum(totals):>6}" + "".join(f"{n:>6}" for n in totals))
    for domain, counts in rows[:20]:
        click.echo(f"{domain[:27]:<28}{sum(counts):>6}" + "".join(f"{n:>6}" for n in counts))


def disk_use(directory: str) -> dict[str, int]:
    """Bytes on disk by kind of file (a file a running owner removes meanwhile counts 0)."""

    def size(path: str) -> int:
        try:
            found = DISK.stat(path)
            return found.st_size if stat.S_ISREG(found.st_mode) else 0
        except FileNotFoundError:
            return 0

    out = {"log": 0, "bodies": 0, "corrupt": 0, "other": 0}
    places = (
        ("log", fmt.LOG_DIR),
        ("bodies", fmt.INCOMING_DIR),  # body files written since the last checkpoint
        ("bodies", fmt.BODY_DIR),
        ("corrupt", fmt.CORRUPT_DIR),
    )
    for kind, sub in places:
        path = os.path.join(directory, sub)
        if DISK.is_dir(path):
            out[kind] += sum(size(os.path.join(path, n)) for n in DISK.listdir(path))
    for name in DISK.listdir(directory):
        out["other"] += size(os.path.join(directory, name))
    return out
