"""The commands that change the queue: ``hold``, ``release``, ``delete``, ``bounce``,
``retry`` (``postsuper``, ``postqueue -i``/``-s``, ``exim -Mg``) and ``accept``
(``sendmail -f``). Each asks the running owner when there is one, else opens the spool.

The no-op rule: an action that does not apply to a message (a hold of a held message, a
release of one not held, a retry of one held, already due or being attempted) changes
nothing and is counted ``unchanged``; a message named by id is named with why, on
standard output. It is not an error: the exit status is 0. Only unknown ids and refusals
(the spool could not do what was asked) exit 1.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import click

from spool.cli.common import (
    DIR,
    handle_errors,
    message_id,
    plural,
    require_spool,
    running_owner,
    spool_or_owner,
    working,
)
from spool.cli.selection import selection_from, selection_options
from spool.operator import OperatorAction, not_held
from spool.spool import Spool

# What each action did to a message, for the summary line.
DONE = {
    OperatorAction.HOLD: "held",
    OperatorAction.RELEASE: "released (due now)",
    OperatorAction.DELETE: "deleted (no bounce)",
    OperatorAction.BOUNCE: "returned to their senders (bounced)",
    OperatorAction.RETRY: "due now",
}
# Why an action left a named message unchanged.
NO_OP = {
    OperatorAction.HOLD: "already held",
    OperatorAction.RELEASE: "not held",
    OperatorAction.RETRY: "not waiting for a retry (held, due already, or being attempted)",
    OperatorAction.DELETE: "nothing to do",
    OperatorAction.BOUNCE: "nothing to do",
}


def selected_ids(msg_ids: tuple[str, ...]) -> list[str] | None:
    """The ids named on the command line; ``-`` reads them from standard input (one or more
    a line, as ``postsuper -d -``); None when none were named. Case does not matter."""
    if not msg_ids:
        return None
    ids: list[str] = []
    for name in msg_ids:
        ids.extend(sys.stdin.read().split() if name == "-" else [name])
    return [message_id(i) for i in ids]


def run_action(
    action: OperatorAction,
    directory: str,
    msg_ids: tuple[str, ...],
    everything: bool,
    reason: str | None,
    filters: dict[str, Any],
) -> None:
    """One operator action on the messages named, selected, or all, in one walk."""
    ids = selected_ids(msg_ids)
    select = selection_from(filters)
    if ids is None and not (everything or select.given):
        raise click.UsageError("name messages (ids, or - to read them), or give --all or a filter")
    if ids is not None and everything:
        raise click.UsageError("give message ids or --all, not both")
    require_spool(directory)
    with spool_or_owner(directory) as sp, working(f"{action.value}: walking the queue"):
        result = sp.act(action, ids, where=select if select.given else None, reason=reason)
    refused = dict(result.refused)
    unchanged = list(result.unchanged)
    for msg_id, why in result.refused.items():
        if action is OperatorAction.RELEASE and why == not_held(msg_id):
            del refused[msg_id]
            unchanged.append(msg_id)
    if ids is not None:
        for msg_id in unchanged:
            click.echo(f"{msg_id}: unchanged, {NO_OP[action]}")
    for msg_id in result.unknown:
        click.echo(f"spool: no message {msg_id} in the spool", err=True)
    for why in refused.values():
        click.echo(f"spool: {why}", err=True)
    summary = f"{plural(len(result.changed), 'message')} {DONE[action]}"
    if unchanged:
        summary += f", {len(unchanged)} unchanged (nothing to do)"
    click.echo(summary)
    if result.unknown or refused:
        sys.exit(1)


def operator_command(
    action: OperatorAction, help_text: str, takes_reason: bool = False
) -> click.Command:
    """``spool hold`` and its kin: ids, ``-``, ``--all`` or filters; one walk."""

    def command(
        directory: str,
        msg_ids: tuple[str, ...],
        everything: bool,
        reason: str | None = None,
        **filters: Any,
    ) -> None:
        run_action(action, directory, msg_ids, everything, reason, filters)

    decorated: Callable[..., Any] = handle_errors(command)
    decorated = selection_options(decorated)
    decorated = click.option("--all", "everything", is_flag=True, help="Every live message.")(
        decorated
    )
    if takes_reason:
        decorated = click.option(
            "--reason", metavar="TEXT", help="The reason recorded (and quoted)."
        )(decorated)
    decorated = click.argument("msg_ids", nargs=-1, metavar="[ID|-]...")(decorated)
    decorated = DIR(decorated)
    return click.command(name=action.value, help=help_text)(decorated)


EXAMPLES = "\n\n\b\nExamples:\n"
ACTION_COMMANDS = [
    operator_command(
        OperatorAction.HOLD,
        "Hold messages: no attempts until released (postsuper -h)."
        + EXAMPLES
        + "  spool hold var/spool 6B49D2000F5A1C33\n"
        + "  spool hold var/spool --domain example.net --reason 'their MX is down'",
        takes_reason=True,
    ),
    operator_command(
        OperatorAction.RELEASE,
        "Release held messages; they are due at once (postsuper -H)."
        + EXAMPLES
        + "  spool release var/spool 6B49D2000F5A1C33\n  spool release var/spool --held",
    ),
    operator_command(
        OperatorAction.DELETE,
        "Delete messages silently, with no bounce (postsuper -d, exim -Mrm); see bounce."
        + EXAMPLES
        + "  spool delete var/spool 6B49D2000F5A1C33\n"
        + "  spool list -i var/spool --sender spam@ | spool delete var/spool -",
        takes_reason=True,
    ),
    operator_command(
        OperatorAction.BOUNCE,
        "Give up on messages: pending recipients fail, so their senders get a bounce "
        "(exim -Mg); see delete."
        + EXAMPLES
        + "  spool bounce var/spool 6B49D2000F5A1C33 --reason '554 5.7.1 relaying stopped'",
        takes_reason=True,
    ),
    operator_command(
        OperatorAction.RETRY,
        "Make deferred messages due now (postqueue -i, postqueue -f); for a site, "
        "--domain (postqueue -s, exim -R). A running owner attempts them at once."
        + EXAMPLES
        + "  spool retry var/spool 6B49D2000F5A1C33\n"
        + "  spool retry var/spool --domain example.com\n"
        + "  spool retry var/spool --all",
    ),
]


def envelope_sender(text: str) -> str:
    """``-f`` as sendmail takes it: angle brackets stripped, ``<>`` the null sender."""
    text = text.strip()
    if text.startswith("<") and text.endswith(">"):
        text = text[1:-1].strip()
    return text


@click.command()
@DIR
@click.option(
    "-f",
    "sender",
    required=True,
    type=envelope_sender,
    metavar="SENDER",
    help="Envelope sender, with or without <>; '' or '<>' for the null sender.",
)
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
        click.echo(sp.accept(sender, [envelope_sender(r) for r in recipients], data))
