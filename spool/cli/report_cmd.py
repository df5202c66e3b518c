"""``spool report``: delivery reports of spools on Apache Spark (docs/analytics.md)."""

from __future__ import annotations

import os
import sys

import click

from spool.cli.common import JSON, emit_json, fail, handle_errors


@click.command()
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
    extra (pip install 'mailspool[analytics]') and Java 17 or later. docs/analytics.md.

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
            "pip install 'mailspool[analytics]'"
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
        "still queued {queued}{lost}; {deferrals} deferrals".format(
            **summary,
            lost=f", outcome lost to damage {summary['unknown']}" if summary.get("unknown") else "",
        )
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
