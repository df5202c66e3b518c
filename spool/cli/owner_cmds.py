"""``spool serve`` and ``spool status``: run the spool's owner, and ask it how it does."""

from __future__ import annotations

import ipaddress
import signal
import sys

import attrs
import click

from spool.cli.common import (
    AGE,
    DIR,
    JSON,
    SIGINT_EXIT,
    emit_json,
    fail,
    handle_errors,
    human_age,
    require_spool,
)
from spool.client import connect
from spool.errors import SpoolMisuse
from spool.logs import LOG_FORMATS, setup_logging

SERVE_EXTRA = "pip install 'mailspool[serve]'"


@click.command()
@DIR
@click.option(
    "--agent",
    help="Delivery agent of the workers: demo, maildir:PATH, pipe:COMMAND, smtp:HOST:PORT, mx, "
    "routes:PATH (a transport map), lmtp:HOST:PORT, python:MODULE:CALLABLE.",
)
@click.option(
    "--relay",
    metavar="HOST:PORT",
    help="Relay everything to this smarthost: the same as --agent smtp:HOST:PORT "
    "(Postfix's relayhost).",
)
@click.option(
    "--transport-map",
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Relay by recipient domain through a transport(5)-shaped map: the same as "
    "--agent routes:PATH.",
)
@click.option(
    "--workers",
    type=click.IntRange(0, 256),
    help="Worker processes [default: 2 with --agent, else 0: clients claim over the socket].",
)
@click.option(
    "--max-use",
    type=click.IntRange(1),
    default=1000,
    show_default=True,
    help="Attempts a worker makes before it is replaced (Postfix's max_use).",
)
@click.option(
    "--attempt-timeout",
    type=AGE,
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
    "--smtp",
    "smtp_at",
    multiple=True,
    metavar="HOST:PORT",
    help="Accept mail over SMTP on HOST:PORT (repeat for more listeners); 250 only once "
    "the message is durable.",
)
@click.option(
    "--smtp-processes",
    type=click.IntRange(0, 64),
    default=0,
    show_default=True,
    help="Run the SMTP listeners in N processes of their own, which hand each message to "
    "the owner over the control socket (0: in the owner's process).",
)
@click.option(
    "--mynetworks",
    multiple=True,
    metavar="CIDR",
    help="Clients that may relay to any domain [default: 127.0.0.0/8 and ::1]; repeat, "
    "or separate with commas.",
)
@click.option(
    "--relay-domain",
    "relay_domains",
    multiple=True,
    metavar="DOMAIN",
    help="A domain any client may send to (repeatable); other clients are refused "
    "(554 5.7.1 Relay access denied).",
)
@click.option(
    "--smtp-hostname",
    metavar="NAME",
    help="The name the SMTP listeners greet with and write in Received: [default: the "
    "host's fully qualified name].",
)
@click.option(
    "--tls-cert",
    type=click.Path(exists=True, dir_okay=False),
    metavar="PEM",
    help="Offer STARTTLS on the SMTP listeners with this certificate (chain); with --tls-key.",
)
@click.option(
    "--tls-key",
    type=click.Path(exists=True, dir_okay=False),
    metavar="PEM",
    help="The private key of --tls-cert.",
)
@click.option(
    "--bounces",
    is_flag=True,
    help="Track outcomes and send each failed or expired recipient's sender an RFC 3464 "
    "bounce (recorded in the spool: later starts keep sending them).",
)
@click.option(
    "--delay-warning",
    type=AGE,
    metavar="AGE",
    help="Warn the sender once when a message is still queued after AGE (for example 4h; "
    "Postfix's delay_warning_time) [default: no warnings].",
)
@click.option(
    "--log-format",
    type=click.Choice(LOG_FORMATS),
    default="text",
    show_default=True,
    help="Log lines on standard error.",
)
@click.option(
    "--log-file",
    type=click.Path(dir_okay=False),
    metavar="PATH",
    help="Append the log (the delivery log included) to PATH instead of standard error.",
)
@handle_errors
def serve(
    directory: str,
    agent: str | None,
    relay: str | None,
    transport_map: str | None,
    workers: int | None,
    max_use: int,
    attempt_timeout: float,
    concurrency: int,
    metrics_at: str | None,
    smtp_at: tuple[str, ...],
    smtp_processes: int,
    mynetworks: tuple[str, ...],
    relay_domains: tuple[str, ...],
    smtp_hostname: str | None,
    tls_cert: str | None,
    tls_key: str | None,
    bounces: bool,
    delay_warning: float | None,
    log_format: str,
    log_file: str | None,
) -> None:
    """Run the spool's owner: recovery, queue runners, control socket, delivery workers.

    Runs until SIGTERM or Ctrl-C, then stops cleanly (workers settle the message in
    hand; attempts still open are deferred). Other commands reach it through the socket
    DIR/control.sock. docs/serve.md describes it.

    \b
    Examples:
      spool serve var/spool --agent demo --workers 2
      spool serve var/spool --agent maildir:/var/mail --workers 4
      spool serve var/spool --smtp 127.0.0.1:2525 --relay mail.example.net:25
    """
    agent = _agent_spec(agent, relay, transport_map)
    count = workers if workers is not None else (2 if agent else 0)
    if count and not agent:
        raise click.UsageError("workers need an agent: give --agent (for example --agent demo)")
    from spool.agents import load_agent

    if agent:
        load_agent(agent).close()  # a bad spec is refused now, not by every worker
    metrics = None
    if metrics_at is not None:
        try:
            from spool.metrics import parse_listen
        except ImportError as exc:
            fail(
                f"--metrics needs the serve extra ({exc.name} is missing): "
                "pip install 'mailspool[serve]'"
            )
        try:
            metrics = parse_listen(metrics_at)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
    if delay_warning is not None and not delay_warning > 0:
        raise click.UsageError("--delay-warning must be more than 0 seconds")
    if smtp_processes and not smtp_at:
        raise click.UsageError("--smtp-processes needs --smtp HOST:PORT")
    smtp, networks = _smtp_options(smtp_at, mynetworks)
    _check_relay_domains(relay_domains)
    tls = _tls_options(smtp, tls_cert, tls_key)
    setup_logging(log_format, log_file=log_file)
    from spool.serving import serve as run_owner

    def ready(line: str) -> None:
        click.echo(line)
        sys.stdout.flush()

    stopped_by = run_owner(
        directory,
        workers=count,
        agent=agent or "",
        max_use=max_use,
        attempt_timeout=attempt_timeout,
        concurrency=concurrency,
        metrics=metrics,
        smtp=smtp,
        smtp_processes=smtp_processes,
        smtp_hostname=smtp_hostname,
        mynetworks=networks,
        relay_domains=relay_domains,
        bounces=bounces,
        delay_warning=delay_warning,
        tls=tls,
        ready=ready,
    )
    # Stopped cleanly either way; after Ctrl-C the status says so, as a shell expects.
    sys.exit(SIGINT_EXIT if stopped_by == signal.SIGINT else 0)


def _agent_spec(agent: str | None, relay: str | None, transport_map: str | None) -> str | None:
    """The agent ``--agent``, ``--relay`` or ``--transport-map`` names (one of them)."""
    given = [
        spec
        for spec in (
            agent,
            None if relay is None else "smtp:" + relay,
            None if transport_map is None else "routes:" + transport_map,
        )
        if spec is not None
    ]
    if len(given) > 1:
        raise click.UsageError("give one of --agent, --relay and --transport-map")
    if relay is not None:
        from spool.agents.smtp import parse_next_hop

        try:
            parse_next_hop(relay, usage="--relay HOST:PORT[,tls=LEVEL][,cafile=PEM]")
        except SpoolMisuse as e:
            raise click.UsageError(str(e)) from None
    return given[0] if given else None


def _smtp_options(
    smtp_at: tuple[str, ...], mynetworks: tuple[str, ...]
) -> tuple[list[tuple[str, int]], list[str] | None]:
    """The SMTP listeners and mynetworks, checked (a usage error names the bad one)."""
    if not smtp_at:
        if mynetworks:
            raise click.UsageError("--mynetworks applies to --smtp listeners: give --smtp")
        return [], None
    try:
        from spool.smtp_in import parse_listen
    except ImportError as exc:
        fail(f"--smtp needs the serve extra ({exc.name} is missing): " + SERVE_EXTRA)

    try:
        smtp = [parse_listen(text) for text in smtp_at]
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    networks = [n.strip() for text in mynetworks for n in text.split(",") if n.strip()]
    for n in networks:
        try:
            ipaddress.ip_network(n, strict=False)
        except ValueError:
            raise click.UsageError(f"--mynetworks: {n!r} is not a network (CIDR)") from None
    return smtp, (networks or None)


def _tls_options(
    smtp: list[tuple[str, int]], cert: str | None, key: str | None
) -> tuple[str, str] | None:
    """The certificate and key for STARTTLS, checked now (a usage error names the fault)."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        raise click.UsageError("STARTTLS needs both --tls-cert and --tls-key")
    if not smtp:
        raise click.UsageError("--tls-cert and --tls-key apply to --smtp listeners: give --smtp")
    import ssl

    from spool.smtp_in import tls_context

    try:
        tls_context(cert, key)
    except (OSError, ssl.SSLError) as e:
        raise click.UsageError(f"--tls-cert/--tls-key: cannot use them ({e})") from None
    return cert, key


def _check_relay_domains(domains: tuple[str, ...]) -> None:
    """Each ``--relay-domain`` a domain the spool's address rules take (IDNA2008 for an
    internationalised one), else a usage error."""
    from spool.addresses import check_mailbox
    from spool.errors import InvalidAddress

    for domain in domains:
        try:
            check_mailbox("postmaster@" + domain.rstrip("."))
        except InvalidAddress as e:
            raise click.UsageError(f"--relay-domain {domain!r}: {e.reason}") from None


@click.command()
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
    if info.get("smtp_processes"):  # an owner from before them has no such field
        pids = ", ".join(str(p) for p in info["smtp_processes"])
        click.echo(f"smtp processes: {len(info['smtp_processes'])} (pids {pids})")
    smtp = info.get("smtp")  # None without --smtp (and from an owner before the figures)
    if smtp:
        refused = sum(smtp[f"{c}_{k}"] for c in ("mail", "rcpt", "data") for k in ("4xx", "5xx"))
        click.echo(
            f"smtp since start: {_count(smtp['connections'], 'connection')}, "
            f"{_count(smtp['data_2xx'], 'message')} accepted ({smtp['accepted_bytes']} bytes), "
            f"{_count(refused, 'command')} refused"
        )
    click.echo(
        "since start: accepted {accepted}, delivered {delivered}, deferred {deferred}, "
        "failed {failed}, expired {expired} (recipients); {in_flight} in flight; "
        "{fsyncs} fsyncs".format(**counters)
    )


def _count(n: int, noun: str) -> str:
    """``1 connection``, ``2 connections``."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
