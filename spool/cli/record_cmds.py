"""``spool show`` and ``spool dump``: one message's records and data, or the log's records,
read from disk (no lock, nothing written)."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import click

from spool import format as fmt
from spool import records as rec
from spool.bodies import read_body
from spool.cli.common import (
    DIR,
    DISK,
    JSON,
    emit_json,
    fail,
    handle_errors,
    human_size,
    human_time,
    message_id,
    parse_position,
    require_spool,
    to_jsonable,
)
from spool.queue_view import history, walk
from spool.reader import list_segments, read_frame_at
from spool.records import Position
from spool.recovery import resolve_body


def describe(pos: Position, record: rec.Record) -> str:
    """One line for a record, as ``show`` and ``dump`` print it."""
    at = f"{pos!s:>14}"
    if isinstance(record, rec.Envelope):
        what = "replacement" if record.supersedes else "envelope"
        extra = f" supersedes {record.supersedes}" if record.supersedes else ""
        held = f" held ({record.held})" if record.held else ""
        return (
            f"{at}  {human_time(record.written_at)}  {what} {record.msg_id} "
            f"from <{record.sender}> to {', '.join(record.recipients)}; "
            f"attempts {record.attempts}, class {record.klass}, "
            f"body {record.body.kind} {human_size(record.body.size)}{held}{extra}"
        )
    if isinstance(record, rec.Start):
        return (
            f"{at}  {human_time(record.at)}  start {record.msg_id} "
            f"(envelope {record.envelope_at}, class {record.klass})"
        )
    if isinstance(record, rec.Delta):
        return (
            f"{at}  {human_time(record.at)}  {record.status} {record.msg_id} "
            f"{', '.join(record.recipients)}: {record.reply}"
        )
    if isinstance(record, rec.Finish):
        outcome = "; ".join(f"{o.recipient} {o.status}" for o in record.outcomes)
        tail = f": {outcome}" if outcome else ""  # (R6's finish names no recipient)
        return f"{at}  {human_time(record.at)}  finish {record.msg_id} ({record.reason}){tail}"
    return f"{at}  {human_time(record.at)}  {record.action} {record.target}"


def message_data(directory: str, records: list[tuple[Position, rec.Record]]) -> bytes:
    """The message's data, from its last envelope's body."""
    pos, env = [(p, r) for p, r in records if isinstance(r, rec.Envelope)][-1]
    assert isinstance(env, rec.Envelope)
    body = env.body
    if body.kind == rec.BODY_INLINE and body.at is None:
        size = read_frame_at(DISK, os.path.join(directory, fmt.LOG_DIR), pos).size
        body = resolve_body(env, pos, size)
    return read_body(DISK, directory, env.msg_id, body)


def header_block(data: bytes) -> bytes:
    """The message's header lines (up to the first empty line), as ``postcat -h``."""
    for end in (b"\r\n\r\n", b"\n\n"):
        at = data.find(end)
        if at >= 0:
            return data[: at + len(end) // 2]
    return data


@click.command()
@DIR
@click.argument("msg_id", type=message_id)
@click.option("--data", is_flag=True, help="Print the whole message (postcat -q -b -h).")
@click.option(
    "--headers",
    is_flag=True,
    help="Print the envelope and the message's headers (postcat -q -h, exim -Mvh).",
)
@JSON
@handle_errors
def show(directory: str, msg_id: str, data: bool, headers: bool, as_json: bool) -> None:
    """One message's history (every record of it still in the log), its headers, or its
    data. Ids are matched case-insensitively.

    \b
    Examples:
      spool show var/spool 6B49D2000F5A1C33
      spool show var/spool 6B49D2000F5A1C33 --headers
      spool show var/spool 6B49D2000F5A1C33 --data > message.eml
    """
    if sum((data, headers, as_json)) > 1:
        raise click.UsageError("give one of --data, --headers and --json")
    require_spool(directory)
    records = history(DISK, directory, msg_id)
    if not records:
        fail(f"no message {msg_id} in the spool")
    if (data or headers) and not any(isinstance(r, rec.Envelope) for _, r in records):
        fail(f"{msg_id} is finished and its envelope no longer in the log")
    if data:
        sys.stdout.buffer.write(message_data(directory, records))
        sys.stdout.buffer.flush()
    elif headers:
        env = [r for _, r in records if isinstance(r, rec.Envelope)][-1]
        assert isinstance(env, rec.Envelope)
        # (An outcome acknowledgement proves a finish, should damage have taken it.)
        finished = any(
            isinstance(r, rec.Finish)
            or (isinstance(r, rec.Control) and r.action == rec.OUTCOME_ACK)
            for _, r in records
        )
        click.echo(f"queue_id: {env.msg_id}")
        click.echo(f"arrival_time: {human_time(env.accepted_at)}")
        click.echo(f"state: {'finished' if finished else ('held' if env.held else 'queued')}")
        click.echo(f"sender: <{env.sender}>")
        for r in env.recipients:
            click.echo(f"{'recipient' if not finished else 'was pending'}: {r}")
        for o in env.outcomes:
            click.echo(f"done: {o.recipient} {o.status}")
        click.echo("")
        sys.stdout.flush()
        sys.stdout.buffer.write(header_block(message_data(directory, records)))
        sys.stdout.buffer.flush()
    elif as_json:
        emit_json(
            {
                "msg_id": msg_id,
                "records": [
                    {"at": str(p), "type": type(r).__name__.lower(), **to_jsonable(r)}
                    for p, r in records
                ],
            }
        )
    else:
        for pos, record in records:
            click.echo(describe(pos, record))


@click.command()
@DIR
@click.option("--segment", type=int, metavar="N", help="Only segment N.")
@click.option("--from", "start", type=parse_position, metavar="SEG:OFF", help="Start here.")
@click.option("--limit", type=click.IntRange(0), metavar="K", help="At most K records.")
@JSON
@handle_errors
def dump(
    directory: str, segment: int | None, start: Position | None, limit: int | None, as_json: bool
) -> None:
    """The records themselves, one a line, for debugging and scripts.

    \b
    Example:
      spool dump var/spool --from 3:32 --limit 20 --json
    """
    require_spool(directory)
    if segment is not None:
        present = list_segments(DISK, os.path.join(directory, fmt.LOG_DIR))
        if segment not in present:
            have = (
                "no segments"
                if not present
                else f"segment {present[0]}"
                if len(present) == 1
                else f"segments {present[0]} to {present[-1]}"
            )
            fail(f"no segment {segment} in {directory} (it has {have})")
    for count, (pos, record, frame) in enumerate(records_from(directory, segment, start)):
        if limit is not None and count >= limit:
            break
        if as_json:
            base: dict[str, Any] = {"at": str(pos), "size": frame.size if frame else None}
            if record is None:
                assert frame is not None
                base["type"] = fmt.TYPE_NAMES[frame.type]
            else:
                base.update(type=type(record).__name__.lower(), **to_jsonable(record))
            emit_json(base)
        elif record is None:
            assert frame is not None
            click.echo(f"{pos!s:>14}  {fmt.TYPE_NAMES[frame.type]} ({frame.size} bytes)")
        else:
            click.echo(describe(pos, record))


def records_from(
    directory: str, segment: int | None, start: Position | None
) -> Iterator[tuple[Position, rec.Record | None, Any]]:
    for pos, record, frame in walk(DISK, directory, skip_bodies=False):
        if segment is not None and pos.segment != segment:
            if pos.segment > segment:
                return
            continue
        if start is not None and pos < start:
            continue
        if record is None and frame is not None and frame.type == fmt.T_PAD:
            continue
        yield pos, record, frame
