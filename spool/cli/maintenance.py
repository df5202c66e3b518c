"""``spool recover``, ``spool check`` and ``spool checkpoint``: recovery, verification
and repair, and restart positions on demand."""

from __future__ import annotations

import fcntl
import os
import sys
import time
from typing import Any

import click

from spool import format as fmt
from spool.check import CheckReport, check_spool, repair_spool
from spool.cli.common import (
    DIR,
    DISK,
    JSON,
    emit_json,
    handle_errors,
    human_size,
    open_spool,
    plural,
    recorded_options,
    require_spool,
    segment_count,
    spool_or_owner,
    to_jsonable,
)
from spool.client import Client
from spool.errors import SpoolLocked
from spool.lock import read_owner_pid
from spool.records import Position
from spool.recovery import recover


@click.command(name="recover")
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
        f"  scanned:           {plural(report.records_scanned, 'record')}, "
        f"{human_size(report.bytes_scanned)} from {report.scanned_from}\n"
        f"  in flight:         {plural(report.working_found, 'message')}\n"
        f"  {verb:<18} {plural(report.replacements_written, 'replacement envelope')}, "
        f"{plural(report.finishes_written, 'finish record')}\n"
        f"  crash loop held:   {report.held_for_crash_loop}\n"
        f"  torn tail:         {plural(report.torn_bytes_cut, 'byte')}"
        f"{f' at {report.torn_at}' if report.torn_at else ''}"
        f"{' (would be cut)' if dry_run and report.torn_bytes_cut else ''}\n"
        f"  quarantined files: {quarantined} in {fmt.CORRUPT_DIR}/\n"
        f"  time:              {report.seconds * 1000:.1f} ms"
    )


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


@click.command()
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
    segments = segment_count(directory)
    if sys.stdout.isatty() and not as_json:
        with click.progressbar(length=segments, label="checking segments") as bar:
            report = check_spool(directory, progress=bar.update)
    else:
        report = check_spool(directory)
    repaired = None
    needs = not report.clean or report.orphan_bodies or report.affected
    if repair and needs:
        try:
            repaired = repair_spool(directory)
        except KeyboardInterrupt:
            if os.path.exists(os.path.join(directory, fmt.REPAIRING_NAME)):
                # Every step is durable as it ends; the rerun finishes from the markers.
                click.echo(
                    "spool: interrupted: the repair is not finished, and no open serves "
                    f"the spool until it is: run `spool check --repair {directory}` again",
                    err=True,
                )
            raise
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
            earlier = {a.msg_id for a in report.affected if a.region.marker}
            earlier -= {a.msg_id for a in report.affected if not a.region.marker}
            for msg_id, fate in repaired.fates:
                said = "settled by an earlier repair" if msg_id in earlier else "affected"
                click.echo(f"{said}: {msg_id}: {fate}")
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
        f"{'clean' if report.clean else plural(len(report.problems), 'problem')}: "
        f"{plural(report.segments, 'segment')}, {plural(report.records, 'record')}, "
        f"{human_size(report.bytes)}, {plural(report.live_messages, 'live message')}, "
        f"{plural(report.body_files, 'body file')} ({report.seconds:.2f} s)"
    )


@click.command()
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
