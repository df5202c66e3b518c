"""The ``spool`` command: recover, check, inspect and manage a spool (docs/cli.md).

Read-only commands (list, show, stats, dump, check) take no lock and write nothing: they
read the durable part of the log, so they work beside a running owner. Commands that
change the spool (hold, release, delete, bounce, retry, accept, checkpoint) ask the running
owner (``spool serve``) through its control socket when one runs, and otherwise open the
spool themselves, which takes the owner lock; they print the same either way. ``recover``
and ``check --repair`` need the spool to themselves: a running owner makes them fail with
a message naming its pid. ``serve`` runs the owner; ``status`` asks it how it is doing.

Exit codes: 0 success, 1 problems found or refused, 2 usage. Errors print one line;
``--debug`` shows the traceback. ``--json`` prints one JSON object, or JSON lines for
listings (one object per message or record).
"""

from __future__ import annotations

import collections
import enum
import fcntl
import json
import os
import re
import stat
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn, TypeVar

import attrs
import click

from spool import format as fmt
from spool import records as rec
from spool.check import CheckReport, check_spool, repair_spool
from spool.client import Client, connect, socket_path
from spool.errors import OwnerUnreachable, SpoolError, SpoolLocked
from spool.fs import FileSystem
from spool.lock import read_owner_pid
from spool.logs import LOG_FORMATS, setup_logging
from spool.options import SpoolOptions, load_settings, resolve_options
from spool.positions import load_positions
from spool.queue_view import QueueEntry, history, live_messages, walk
from spool.records import Position
from spool.recovery import recover
from spool.spool import OperatorAction, Spool

F = TypeVar("F", bound=Callable[..., Any])
DISK = FileSystem()  # every look at the disk goes through the seam, as in the package
DIR = click.argument("directory", type=click.Path(file_okay=False))
JSON = click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
AGE_BUCKETS = (5, 10, 20, 40, 80, 160, 320, 640, 1280)  # minutes, as qshape's


# --- formatting ----------------------------------------------------------------------


def human_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def human_age(seconds: float) -> str:
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def human_time(ts: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def parse_duration(text: str) -> float:
    """'90s', '15m', '2h', '3d' or plain seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a duration like 30m, 2h or 3d")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_position(text: str) -> Position:
    m = re.fullmatch(r"(\d+):(\d+)", text)
    if not m:
        raise click.BadParameter(f"{text!r} is not a position SEGMENT:OFFSET")
    return Position(int(m.group(1)), int(m.group(2)))


def to_jsonable(obj: Any) -> Any:
    if isinstance(obj, Position):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return obj.value
    if attrs.has(type(obj)):
        return {k: to_jsonable(v) for k, v in attrs.asdict(obj, recurse=False).items()}
    if isinstance(obj, tuple | list | set | frozenset):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    return obj


def emit_json(obj: Any) -> None:
    click.echo(json.dumps(to_jsonable(obj), sort_keys=True))


# --- plumbing ------------------------------------------------------------------------


SIGPIPE_EXIT = 128 + 13  # the status of a command that SIGPIPE ended


class Failure(Exception):
    """An expected failure: print one line, exit 1."""


def fail(message: str) -> NoReturn:
    raise Failure(message)


def handle_errors(func: F) -> F:
    """Turn spool errors into one line and exit 1 (``--debug``: the traceback too)."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        ctx = click.get_current_context()
        try:
            return func(*args, **kwargs)
        except BrokenPipeError:
            # The reader went away (`spool dump DIR | head`): stop quietly, as a command
            # killed by SIGPIPE does. Standard output points at /dev/null from here, so
            # that flushing it at exit raises nothing more.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
            ctx.exit(SIGPIPE_EXIT)
        except (SpoolError, Failure, OSError, KeyError, ValueError) as exc:
            if ctx.find_root().params.get("debug"):
                raise
            text = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
            click.echo(f"spool: {text}", err=True)
            ctx.exit(1)

    wrapper.__name__ = func.__name__
    wrapper.__doc__ = func.__doc__
    return wrapper  # type: ignore[return-value]


def recorded_options(directory: str) -> SpoolOptions:
    """The owner's options as the spool recorded them (its settings; tuning left default)."""
    return resolve_options(load_settings(DISK, directory), {})


def require_spool(directory: str) -> None:
    if not DISK.is_dir(os.path.join(directory, fmt.LOG_DIR)):
        fail(f"{directory} is not a spool (no {fmt.LOG_DIR}/ directory)")


def open_spool(directory: str) -> Spool:
    """Open (and so recover) the spool; it keeps the settings its owner recorded."""
    require_spool(directory)
    return Spool.open(directory)


def running_owner(directory: str) -> Client | None:
    """A connection to the owner serving ``directory``, or None when none answers (then
    the command opens the spool itself; a live owner that does not answer makes that open
    fail with ``SpoolLocked``, naming its pid)."""
    if not os.path.exists(socket_path(directory)):
        return None
    try:
        return connect(directory)
    except OwnerUnreachable:
        return None


def spool_or_owner(directory: str) -> Spool | Client:
    """The running owner if there is one, else the spool opened here."""
    client = running_owner(directory)
    return client if client is not None else open_spool(directory)


# --- the command group -----------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(package_name="spool")
def main(debug: bool) -> None:
    """Recover, check, inspect and manage a spool directory.

    \b
    Example:
      spool list var/spool --older-than 1h
    """


@main.command()
@DIR
@click.option("--dry-run", is_flag=True, help="Report what recovery would do; write nothing.")
@JSON
@handle_errors
def recover_cmd(directory: str, dry_run: bool, as_json: bool) -> None:
    """Open the spool (that is recovery) and report what recovery found and did.

    \b
    Example:
      spool recover var/spool
      spool recover --dry-run var/spool
    """
    require_spool(directory)
    if dry_run:
        report = dry_run_recovery(directory)
    else:
        sp = open_spool(directory)
        report = sp.recovery
        sp.close()
    corrupt_dir = os.path.join(directory, fmt.CORRUPT_DIR)
    quarantined = len(DISK.listdir(corrupt_dir)) if DISK.is_dir(corrupt_dir) else 0
    if as_json:
        emit_json({**to_jsonable(report), "dry_run": dry_run, "quarantined_files": quarantined})
        return
    verb = "would write" if dry_run else "wrote"
    used = "used" if report.positions_used else "missing or unusable: full scan"
    click.echo(
        f"{'dry run: ' if dry_run else ''}recovery of {directory}\n"
        f"  restart positions: {used}\n"
        f"  scanned:           {report.records_scanned} records, "
        f"{human_size(report.bytes_scanned)} from {report.scanned_from}\n"
        f"  in flight:         {report.working_found} messages\n"
        f"  {verb:<18} {report.replacements_written} replacement envelopes, "
        f"{report.finishes_written} finish records\n"
        f"  crash loop held:   {report.held_for_crash_loop}\n"
        f"  torn tail:         {report.torn_bytes_cut} bytes"
        f"{f' at {report.torn_at}' if report.torn_at else ''}"
        f"{' (would be cut)' if dry_run and report.torn_bytes_cut else ''}\n"
        f"  quarantined files: {quarantined} in {fmt.CORRUPT_DIR}/\n"
        f"  time:              {report.seconds * 1000:.1f} ms"
    )


main.add_command(recover_cmd, name="recover")


def dry_run_recovery(directory: str) -> Any:
    """Run the recovery scan and decisions without the writes (needs no owner running)."""
    lock_path = os.path.join(directory, fmt.LOCK_NAME)
    fd = DISK.open(lock_path, os.O_RDONLY) if DISK.exists(lock_path) else None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise SpoolLocked(directory, read_owner_pid(lock_path, DISK)) from None
        state = recover(
            DISK,
            directory,
            options=recorded_options(directory),
            clock=time.time,
            dry_run=True,
        )
        return state.report
    finally:
        if fd is not None:
            DISK.close(fd)


@main.command()
@DIR
@click.option("--repair", is_flag=True, help="Set damaged files aside so that the spool opens.")
@JSON
@handle_errors
def check(directory: str, repair: bool, as_json: bool) -> None:
    """Verify every segment and body end to end; exit 1 when problems are found.

    With --repair, only damaged bytes are set aside (copied to corrupt/ first); every
    message the damage touched is named with what became of it, and the exit status is 1
    when mail was affected.

    \b
    Example:
      spool check var/spool
      spool check --repair var/spool
    """
    require_spool(directory)
    segments = len(DISK.listdir(os.path.join(directory, fmt.LOG_DIR)))
    if sys.stdout.isatty() and not as_json:
        with click.progressbar(length=segments, label="checking segments") as bar:
            report = check_spool(directory, progress=bar.update)
    else:
        report = check_spool(directory)
    repaired = None
    needs = not report.clean or report.orphan_bodies or report.affected
    if repair and needs:
        repaired = repair_spool(directory)
    if as_json:
        out: dict[str, Any] = {**to_jsonable(report), "clean": report.clean}
        if repaired is not None:
            out["repaired"] = list(repaired.actions)
            out["fates"] = dict(repaired.fates)
            out["clean_after_repair"] = repaired.after.clean
        emit_json(out)
    else:
        print_check(report)
        if repaired is not None:
            for line in repaired.actions:
                click.echo(f"repaired: {line}")
            for msg_id, fate in repaired.fates:
                click.echo(f"affected: {msg_id}: {fate}")
            for problem in repaired.after.problems:
                click.echo(f"still: {problem.path} at offset {problem.offset}: {problem.what}")
            state = "clean" if repaired.after.clean else "still damaged"
            click.echo(f"after repair: {state}")
    if repaired is not None:
        if repaired.mail_affected or not repaired.after.clean:
            sys.exit(1)
    elif not report.clean:
        sys.exit(1)


def print_check(report: CheckReport) -> None:
    for problem in report.problems:
        kind = "error" if problem.fatal else "warning"
        click.echo(f"{kind}: {problem.path} at offset {problem.offset}: {problem.what}")
    if report.changing:
        click.echo(
            "note: the spool changed under every pass (its owner is running): only damage "
            "in the durable log counts; what the owner's writes may explain is uncertain"
        )
    for problem in report.uncertain:
        click.echo(f"uncertain: {problem.path} at offset {problem.offset}: {problem.what}")
    for note in report.notes:
        click.echo(f"note: {note}")
    for a in report.affected:
        if not a.region.marker:
            click.echo(f"damaged: {a.msg_id}: {a.verdict.value} at {a.region}")
    click.echo(
        f"{'clean' if report.clean else f'{len(report.problems)} problem(s)'}: "
        f"{report.segments} segments, {report.records} records, "
        f"{human_size(report.bytes)}, {report.live_messages} live messages, "
        f"{report.body_files} body files ({report.seconds:.2f} s)"
    )


def matches(
    entry: QueueEntry,
    sender: str | None,
    recipient: str | None,
    held: bool,
    older_than: float | None,
    now: float,
) -> bool:
    if sender is not None and sender.lower() not in entry.sender.lower():
        return False
    if recipient is not None and not any(recipient.lower() in r.lower() for r in entry.recipients):
        return False
    if held and entry.held is None:
        return False
    return older_than is None or now - entry.accepted_at >= older_than


@main.command(name="list")
@DIR
@click.option("--sender", help="Only senders containing this text.")
@click.option("--recipient", help="Only messages with a recipient containing this (or @domain).")
@click.option("--held", is_flag=True, help="Only held messages.")
@click.option(
    "--older-than", type=parse_duration, help="Only messages older than this (30m, 2h, 3d)."
)
@JSON
@handle_errors
def list_cmd(
    directory: str,
    sender: str | None,
    recipient: str | None,
    held: bool,
    older_than: float | None,
    as_json: bool,
) -> None:
    """The queue, like mailq: one message per entry, then a summary line.

    \b
    Example:
      spool list var/spool --recipient @example.net --older-than 1h
    """
    require_spool(directory)
    now = time.time()
    intervals = recorded_options(directory).class_intervals()
    entries = sorted(
        live_messages(DISK, directory, intervals).values(),
        key=lambda e: (e.accepted_at, e.msg_id),
    )
    shown = [e for e in entries if matches(e, sender, recipient, held, older_than, now)]
    if as_json:
        for e in shown:
            emit_json(e)
        return
    if shown:
        click.echo(
            f"{'ID':<16}  {'AGE':>6}  {'SIZE':>9}  {'CLS':>3}  {'ATT':>3}  "
            f"{'NEXT':>6}  {'STATE':<8}  SENDER"
        )
    for e in shown:
        nxt = (
            "held"
            if e.held
            else ("now" if e.next_attempt_at <= now else human_age(e.next_attempt_at - now))
        )
        click.echo(
            f"{e.msg_id:<16}  {human_age(now - e.accepted_at):>6}  "
            f"{human_size(e.body_size):>9}  {e.klass:>3}  {e.attempts:>3}  {nxt:>6}  "
            f"{e.state:<8}  <{e.sender}>"
        )
        if e.held:
            click.echo(f"{'':18}(held: {e.held})")
        if e.last_reply:
            click.echo(f"{'':18}({e.last_reply})")
        for r in e.recipients:
            click.echo(f"{'':18}{r}")
    rcpts = sum(len(e.recipients) for e in shown)
    size = sum(e.body_size for e in shown)
    click.echo(f"-- {len(shown)} messages, {rcpts} recipients, {human_size(size)}")


@main.command()
@DIR
@click.argument("msg_id")
@click.option("--data", is_flag=True, help="Print the message body instead.")
@JSON
@handle_errors
def show(directory: str, msg_id: str, data: bool, as_json: bool) -> None:
    """One message's envelope and history (every record of it still in the log).

    \b
    Example:
      spool show var/spool 6B49D2000F5A1C33
    """
    require_spool(directory)
    fs = DISK
    records = history(fs, directory, msg_id)
    if not records:
        fail(f"no message {msg_id} in {directory}")
    if data:
        from spool.bodies import read_body
        from spool.recovery import resolve_body

        envelopes = [(p, r) for p, r in records if isinstance(r, rec.Envelope)]
        pos, env = envelopes[-1]
        assert isinstance(env, rec.Envelope)
        body = env.body
        if body.kind == rec.BODY_INLINE and body.at is None:
            from spool.reader import read_frame_at

            size = read_frame_at(fs, os.path.join(directory, fmt.LOG_DIR), pos).size
            body = resolve_body(env, pos, size)
        sys.stdout.buffer.write(read_body(fs, directory, msg_id, body))
        sys.stdout.buffer.flush()
        return
    if as_json:
        emit_json(
            {
                "msg_id": msg_id,
                "records": [
                    {"at": str(p), "type": type(r).__name__.lower(), **to_jsonable(r)}
                    for p, r in records
                ],
            }
        )
        return
    for pos, record in records:
        click.echo(describe(pos, record))


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
        return f"{at}  {human_time(record.at)}  finish {record.msg_id} ({record.reason}): {outcome}"
    return f"{at}  {human_time(record.at)}  {record.action} {record.target}"


@main.command()
@DIR
@JSON
@handle_errors
def stats(directory: str, as_json: bool) -> None:
    """Counts by class and state, a qshape table, disk use, and the log positions.

    \b
    Example:
      spool stats var/spool
    """
    require_spool(directory)
    now = time.time()
    intervals = recorded_options(directory).class_intervals()
    entries = list(live_messages(DISK, directory, intervals).values())
    by_state = collections.Counter(e.state for e in entries)
    by_class = collections.Counter(e.klass for e in entries)
    shape: dict[str, list[int]] = collections.defaultdict(lambda: [0] * (len(AGE_BUCKETS) + 1))
    for e in entries:
        minutes = (now - e.accepted_at) / 60
        bucket = next((i for i, b in enumerate(AGE_BUCKETS) if minutes < b), len(AGE_BUCKETS))
        for r in e.recipients:
            shape[r.rpartition("@")[2].lower()][bucket] += 1
    disk = disk_use(directory)
    positions = load_positions(DISK, directory)
    pos_info = (
        None
        if positions is None
        else {
            "consistent": str(positions.consistent),
            "working_start": str(positions.working_start),
            "garbage_front": str(positions.front),
            "runner_cursors": [str(c) for c in positions.cursors],
            "written_at": positions.written_at,
        }
    )
    segments = len(DISK.listdir(os.path.join(directory, fmt.LOG_DIR)))
    if as_json:
        emit_json(
            {
                "messages": len(entries),
                "recipients": sum(len(e.recipients) for e in entries),
                "by_state": dict(by_state),
                "by_class": {str(k): v for k, v in sorted(by_class.items())},
                "qshape": {"buckets_minutes": list(AGE_BUCKETS), "domains": dict(shape)},
                "disk_bytes": disk,
                "segments": segments,
                "positions": pos_info,
            }
        )
        return
    click.echo(f"messages: {len(entries)}, recipients: {sum(len(e.recipients) for e in entries)}")
    click.echo("by state: " + (", ".join(f"{k} {v}" for k, v in sorted(by_state.items())) or "-"))
    click.echo("by class: " + (", ".join(f"{k}: {v}" for k, v in sorted(by_class.items())) or "-"))
    click.echo("")
    header = (
        f"{'domain':<28}{'total':>6}" + "".join(f"{b:>6}" for b in AGE_BUCKETS) + f"{'more':>6}"
    )
    click.echo(header + "   (pending recipients by age in minutes, as qshape)")
    rows = sorted(shape.items(), key=lambda kv: -sum(kv[1]))
    totals = [sum(col) for col in zip(*shape.values(), strict=True)] if shape else [0] * 10
    click.echo(f"{'TOTAL':<28}{sum(totals):>6}" + "".join(f"{n:>6}" for n in totals))
    for domain, counts in rows[:20]:
        click.echo(f"{domain[:27]:<28}{sum(counts):>6}" + "".join(f"{n:>6}" for n in counts))
    click.echo("")
    click.echo(
        "disk: "
        + ", ".join(f"{k} {human_size(v)}" for k, v in disk.items())
        + f"; {segments} segments"
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


@main.command()
@DIR
@click.option("--segment", type=int, help="Only this segment.")
@click.option("--from", "start", type=parse_position, help="Start at SEGMENT:OFFSET.")
@click.option("--limit", type=int, help="At most this many records.")
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


SELECTION = (
    click.option("--all", "everything", is_flag=True, help="Every live message."),
    click.option("--sender", help="Only senders containing this text."),
    click.option("--recipient", help="Only messages with a recipient containing this."),
    click.option("--held", is_flag=True, help="Only held messages."),
    click.option("--older-than", type=parse_duration, help="Only messages older than this."),
)
# What each action did to a message, for the summary line.
DONE = {
    OperatorAction.HOLD: "held",
    OperatorAction.RELEASE: "released (due now)",
    OperatorAction.DELETE: "deleted (no bounce)",
    OperatorAction.BOUNCE: "returned to their senders (bounced)",
    OperatorAction.RETRY: "due now",
}


def selected_ids(msg_ids: tuple[str, ...]) -> list[str] | None:
    """The ids named on the command line; ``-`` reads them from standard input (one or more
    a line, as ``postsuper -d -``); None when none were named."""
    if not msg_ids:
        return None
    ids: list[str] = []
    for name in msg_ids:
        ids.extend(sys.stdin.read().split() if name == "-" else [name])
    return ids


def operator_command(action: OperatorAction, help_text: str, reason: bool = False) -> None:
    """Register ``spool hold`` and its kin: ids, ``-``, ``--all`` or filters; one walk."""

    def command(
        directory: str,
        msg_ids: tuple[str, ...],
        everything: bool,
        sender: str | None,
        recipient: str | None,
        held: bool,
        older_than: float | None,
        reason: str | None = None,
    ) -> None:
        ids = selected_ids(msg_ids)
        filtered = sender is not None or recipient is not None or held or older_than is not None
        if ids is None and not (everything or filtered):
            raise click.UsageError(
                "name messages (ids, or - to read them), or give --all or a filter"
            )
        if ids is not None and everything:
            raise click.UsageError("give message ids or --all, not both")
        now = time.time()
        where = (
            (lambda e: matches(e, sender, recipient, held, older_than, now)) if filtered else None
        )
        with spool_or_owner(directory) as sp:
            result = sp.act(action, ids, where=where, reason=reason)
        for msg_id in result.unknown:
            click.echo(f"spool: {msg_id}: no such message in the spool", err=True)
        for why in result.refused.values():
            click.echo(f"spool: {why}", err=True)
        summary = f"{len(result.changed)} message(s) {DONE[action]}"
        if result.unchanged:
            summary += f", {len(result.unchanged)} unchanged (nothing to do)"
        click.echo(summary)
        if result.unknown or result.refused:
            sys.exit(1)

    command = handle_errors(command)
    for option in reversed(SELECTION):
        command = option(command)
    if reason:
        command = click.option("--reason", help="The reason recorded (and quoted).")(command)
    command = click.argument("msg_ids", nargs=-1)(command)
    command = DIR(command)
    main.command(name=action.value, help=help_text)(command)


EXAMPLES = "\n\n\b\nExamples:\n"
operator_command(
    OperatorAction.HOLD,
    "Hold messages: no attempts until released (postsuper -h)."
    + EXAMPLES
    + "  spool hold var/spool 6B49D2000F5A1C33\n"
    + "  spool hold var/spool --recipient @example.net --reason 'their MX is down'",
    reason=True,
)
operator_command(
    OperatorAction.RELEASE,
    "Release held messages; they are due at once (postsuper -H)."
    + EXAMPLES
    + "  spool release var/spool 6B49D2000F5A1C33\n  spool release var/spool --held",
)
operator_command(
    OperatorAction.DELETE,
    "Delete messages silently, with no bounce (postsuper -d, exim -Mrm); see bounce."
    + EXAMPLES
    + "  spool delete var/spool 6B49D2000F5A1C33\n"
    + "  spool list var/spool --sender spam@ --json | jq -r .msg_id | spool delete var/spool -",
    reason=True,
)
operator_command(
    OperatorAction.BOUNCE,
    "Give up on messages: pending recipients fail, so their senders get a bounce "
    "(exim -Mg); see delete."
    + EXAMPLES
    + "  spool bounce var/spool 6B49D2000F5A1C33 --reason '554 5.7.1 relaying stopped'",
    reason=True,
)
operator_command(
    OperatorAction.RETRY,
    "Make deferred messages due now (postqueue -f, postqueue -i)."
    + EXAMPLES
    + "  spool retry var/spool 6B49D2000F5A1C33\n  spool retry var/spool --all",
)


@main.command()
@DIR
@click.option("-f", "sender", required=True, help="Envelope sender ('' for the null sender).")
@click.argument("recipients", nargs=-1, required=True)
@handle_errors
def accept(directory: str, sender: str, recipients: tuple[str, ...]) -> None:
    """Queue a message read from standard input, like sendmail -f; prints its id.

    \b
    Example:
      spool accept var/spool -f alice@example.org bob@example.net < message.eml
    """
    data = sys.stdin.buffer.read()
    client = running_owner(directory)
    with client if client is not None else Spool.open(directory) as sp:
        click.echo(sp.accept(sender, list(recipients), data))


@main.command()
@DIR
@handle_errors
def checkpoint(directory: str) -> None:
    """Write restart positions now (and free retired segments).

    \b
    Example:
      spool checkpoint var/spool
    """
    with spool_or_owner(directory) as sp:
        if isinstance(sp, Client):
            done = sp.checkpoint()
            written = done["written"]
            consistent, front = Position(*done["consistent"]), Position(*done["front"])
        else:
            before = sp.statistics().checkpoints
            positions = sp.checkpoint()
            written = sp.statistics().checkpoints > before
            consistent, front = positions.consistent, positions.front
    if not written:
        click.echo("positions current: nothing happened since they were written")
        return
    click.echo(f"positions written: consistent up to {consistent}, garbage front {front}")


@main.command()
@DIR
@click.option(
    "--agent",
    help="Delivery agent of the workers: demo, maildir:PATH, "
    "pipe:COMMAND, smtp:HOST:PORT, lmtp:HOST:PORT, python:MODULE:CALLABLE.",
)
@click.option(
    "--workers",
    type=click.IntRange(0, 256),
    help="Worker processes [default: 2 with --agent, else 0: clients claim over the socket].",
)
@click.option(
    "--max-use",
    type=click.IntRange(1),
    default=100,
    show_default=True,
    help="Attempts a worker makes before it is replaced (Postfix's max_use).",
)
@click.option(
    "--attempt-timeout",
    default="1000s",
    show_default=True,
    help="An attempt's lease: past it the attempt is closed as deferred and its "
    "worker killed and replaced.",
)
@click.option(
    "--concurrency",
    type=click.IntRange(1, 256),
    default=4,
    show_default=True,
    help="Deliveries at once in each worker (threads, each with its own agent).",
)
@click.option(
    "--metrics",
    "metrics_at",
    metavar="HOST:PORT",
    help="Serve Prometheus metrics at http://HOST:PORT/metrics.",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="Log lines on standard error.",
)
@handle_errors
def serve(
    directory: str,
    agent: str | None,
    workers: int | None,
    max_use: int,
    attempt_timeout: str,
    concurrency: int,
    metrics_at: str | None,
    log_format: str,
) -> None:
    """Run the spool's owner: recovery, queue runners, control socket, delivery workers.

    Runs until SIGTERM or Ctrl-C, then stops cleanly (workers settle the message in
    hand; attempts still open are deferred). Other commands reach it through the socket
    DIR/control.sock. docs/serve.md describes it.

    \b
    Examples:
      spool serve var/spool --agent demo --workers 2
      spool serve var/spool --agent maildir:/var/mail --workers 4
    """
    count = workers if workers is not None else (2 if agent else 0)
    if count and not agent:
        raise click.UsageError("workers need an agent: give --agent (for example --agent demo)")
    from spool.agents import load_agent

    if agent:
        load_agent(agent).close()  # a bad spec is refused now, not by every worker
    from spool.metrics import parse_listen

    try:
        metrics = None if metrics_at is None else parse_listen(metrics_at)
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    setup_logging(log_format)
    from spool.serving import serve as run_owner

    def ready(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()

    run_owner(
        directory,
        workers=count,
        agent=agent or "",
        max_use=max_use,
        attempt_timeout=parse_duration(attempt_timeout),
        concurrency=concurrency,
        metrics=metrics,
        ready=ready,
    )
    sys.exit(0)


@main.command()
@DIR
@JSON
@handle_errors
def status(directory: str, as_json: bool) -> None:
    """Show the running owner: pid, uptime, workers, and the spool's counters.

    \b
    Example:
      spool status var/spool
    """
    require_spool(directory)
    with connect(directory) as client:
        info = client.status()
        counters = attrs.asdict(client.statistics())
    if as_json:
        emit_json({**info, "statistics": counters})
        return
    click.echo(
        f"owner: pid {info['pid']}, up {human_age(info['uptime'])}, agent "
        f"{info['agent'] or '(none: clients claim over the socket)'}"
    )
    click.echo(
        f"workers: {len(info['workers'])}, restarts {info['worker_restarts']}, "
        f"killed at their lease {info['lease_kills']}"
    )
    for w in info["workers"]:
        pid = "(restarting)" if w["pid"] is None else f"pid {w['pid']}"
        holding = ", ".join(w["in_flight"]) or "-"
        click.echo(f"  worker {w['slot']}: {pid}, {w['attempts_done']} attempts, on {holding}")
    click.echo(
        "since start: accepted {accepted}, delivered {delivered}, deferred {deferred}, "
        "failed {failed}, expired {expired} (recipients); {in_flight} in flight; "
        "{fsyncs} fsyncs".format(**counters)
    )


@main.command()
@click.argument("sources", nargs=-1, required=True)
@click.option("--out", required=True, type=click.Path(file_okay=False), help="Output directory.")
@click.option("--since", help="Only records at or after this time (ISO 8601, UTC).")
@click.option("--until", help="Only records before this time (ISO 8601, UTC).")
@click.option("--master", help="Spark master URL (default local[*]).")
@click.option(
    "--on-damage",
    type=click.Choice(["error", "skip"]),
    default="error",
    show_default=True,
    help="Damaged log bytes: fail naming file and offset, or skip the rest of the segment.",
)
@click.option("--verbose", is_flag=True, help="Show Spark's own log.")
@JSON
@handle_errors
def report(
    sources: tuple[str, ...],
    out: str,
    since: str | None,
    until: str | None,
    master: str | None,
    on_damage: str,
    verbose: bool,
    as_json: bool,
) -> None:
    """Delivery reports of spools on Apache Spark: tables, reports, plots, one HTML page.

    SOURCES are spool directories or archive directories, each optionally named
    (NAME=DIR; the server name defaults to the directory's name). Needs the analytics
    extra (pip install 'spool[analytics]') and Java 17 or later. docs/analytics.md.

    \b
    Examples:
      spool report var/spool --out var/report
      spool report mx1=/var/spool/mx1 mx2=/var/spool/mx2 --out /tmp/fleet --json
    """
    try:
        from spool.analytics.command import run_command
    except ImportError as exc:
        fail(
            f"spool report needs the analytics extra ({exc.name} is missing): "
            "pip install 'spool[analytics]'"
        )
    summary = run_command(
        list(sources),
        out,
        since=since,
        until=until,
        master=master,
        on_damage=on_damage,
        verbose=verbose,
        progress=lambda line: click.echo(f"report: {line}", err=True),
    )
    for line in summary["damaged_segments"]:
        click.echo(f"spool: damaged, skipped: {line}", err=True)
    if as_json:
        emit_json(summary)
        sys.exit(1 if summary["damaged_segments"] else 0)
    click.echo(
        "received {received} messages ({recipients} recipients) on {servers} server(s): "
        "delivered {delivered}, bounced {bounced}, expired {expired}, deleted {deleted}, "
        "still queued {queued}; {deferrals} deferrals".format(**summary)
    )
    violations = summary["accountability_violations"]
    click.echo(
        f"accountability: {len(violations)} violation(s)"
        if violations
        else "accountability: every accepted recipient has one final outcome or is queued"
    )
    for line in violations[:20]:
        click.echo(f"  {line}")
    click.echo(f"report: {os.path.join(out, 'index.html')}")
    if summary["damaged_segments"]:
        sys.exit(1)  # written, but without the damaged segments' records: as `spool check`


if __name__ == "__main__":
    main()
