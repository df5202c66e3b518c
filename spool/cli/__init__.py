"""The ``spool`` command: recover, check, inspect and manage a spool (docs/cli.md).

Read-only commands (list, show, stats, dump, check) take no lock and write nothing: they
read the durable part of the log, so they work beside a running owner. Commands that
change the spool (hold, release, delete, bounce, retry, accept, checkpoint) ask the running
owner (``spool serve``) through its control socket when one runs, and otherwise open the
spool themselves, which takes the owner lock; they print the same either way. ``recover``
and ``check --repair`` need the spool to themselves: a running owner makes them fail with
a message naming its pid. ``serve`` runs the owner; ``status`` asks it how it is doing.

Exit codes: 0 success, 1 problems found or refused, 2 usage, 130 Ctrl-C, 141 a closed
pipe. Errors print one line; ``--debug`` shows the traceback. ``--json`` prints one JSON
object, or JSON lines for listings (one object per message or record).

One module per family of commands: ``queue_cmds`` (list, stats), ``record_cmds`` (show,
dump), ``maintenance`` (recover, check, checkpoint), ``actions`` (hold, release, delete,
bounce, retry, accept), ``owner_cmds`` (serve, status), ``report_cmd`` (report); what they
share is in ``common`` and ``selection``.
"""

from __future__ import annotations

import click

from spool.cli.actions import ACTION_COMMANDS, accept
from spool.cli.common import VERSION, handle_errors
from spool.cli.maintenance import check, checkpoint, recover_cmd
from spool.cli.owner_cmds import serve, status
from spool.cli.queue_cmds import disk_use, list_cmd, stats
from spool.cli.record_cmds import dump, show
from spool.cli.report_cmd import report


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show tracebacks instead of one-line errors.")
@click.version_option(VERSION, prog_name="spool")
def main(debug: bool) -> None:
    """Recover, check, inspect and manage a spool directory.

    `spool help COMMAND` (or `spool COMMAND --help`) describes a command; docs/cli.md
    describes them all, and how to turn on shell completion.

    \b
    Example:
      spool list var/spool --older-than 1h
    """


@main.command(name="help")
@click.argument("command", required=False)
@handle_errors
def help_cmd(command: str | None) -> None:
    """Describe a command (as COMMAND --help), or list the commands.

    \b
    Example:
      spool help retry
    """
    ctx = click.get_current_context()
    parent = ctx.parent
    assert parent is not None
    if command is None:
        click.echo(main.get_help(parent))
        return
    found = main.get_command(parent, command)
    if found is None:
        raise click.UsageError(
            f"no command {command!r}; the commands are: {', '.join(sorted(main.commands))}"
        )
    with click.Context(found, info_name=command, parent=parent) as sub:
        click.echo(found.get_help(sub))


for _command in (
    recover_cmd,
    check,
    list_cmd,
    show,
    stats,
    dump,
    *ACTION_COMMANDS,
    accept,
    checkpoint,
    serve,
    status,
    report,
):
    main.add_command(_command)

__all__ = ["disk_use", "main"]
