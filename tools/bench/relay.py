"""``python -m tools.bench.relay``: ``spool serve`` as an SMTP relay against a stock Postfix.

Both systems are driven by the same Postfix load tools on loopback::

    smtp-source --SMTP--> system 127.0.0.1 --SMTP--> smtp-sink 127.0.0.1

* ``postfix``: the private instance of the Postfix peer recipe (a directory of scripts
  given by ``--recipe`` or ``SPOOL_POSTFIX_RECIPE``: its ``configure.sh``, ``start.sh``
  and ``teardown.sh``, run in a temporary work directory), stock settings,
  relayhost smtp-sink; started once, warmed up, then kept for every Postfix trial.
* ``spool wN`` / ``spool wN sM``: ``spool serve DIR --smtp ... --agent smtp:127.0.0.1:SINK
  --workers N [--smtp-processes M]``,
  a fresh spool directory and a fresh owner per trial; the clock starts once every worker
  is up.

Per trial, with a fresh smtp-sink (``-c``, counter polled, never ``-M``): the same
``smtp-source -c -s SESSIONS -m MESSAGES -l SIZE`` command. **accepted msg/s** is messages
over smtp-source's wall time (its last ``250`` after DATA, each given once the message
was durable); **relayed msg/s** is messages over the time until smtp-sink counted the last
one. Then the system is drained (Postfix: its queue directories empty; spool: every
message delivered by its statistics) before anything stops.

Also per trial: the system's CPU (a cgroup v2 per system: Postfix's from ``start.sh``, the
spool owner and its workers in one made here), the spool owner's own CPU (its share of
one core says whether the owner is the bottleneck), the spool log writer's fdatasyncs per
message (``Spool.statistics`` over the socket; Postfix's 1 fsync per message is the
recipe's strace count), block-device flush requests per message (machine-wide), the CPU
everything else on the machine used, and the warnings and errors each system logged.

Trials are interleaved in rounds: every round runs every session count, and for each the
systems in turn (postfix, spool w2, spool w4, ...), so drift of the machine hits all
systems alike. Medians over the rounds are compared as spool ÷ postfix ratios.

Needs root (Postfix's master starts as root; smtp-sink drops to user postfix) and the
recipe's ``install.sh`` run once. Every socket is on 127.0.0.1, every wait has a deadline,
and only processes this script started are signalled (by their recorded pids); Ctrl-C
stops and removes everything it set up.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from types import FrameType
from typing import Any

import attrs

from spool import connect
from tools.bench.spawn import ROOT

RECIPE = os.environ.get("SPOOL_POSTFIX_RECIPE", "")
SMTP_SOURCE = "/usr/sbin/smtp-source"
SMTP_SINK = "/usr/sbin/smtp-sink"
LOOP = "127.0.0.1"
SENDER = "sender@source.invalid"
RECIPIENT = "rcpt@dest.invalid"
QUEUE_DIRS = ("incoming", "active", "deferred", "hold", "maildrop")
POLL = 0.02
POSTFIX = "postfix"


class BenchError(RuntimeError):
    """A setup step or a trial went wrong; the run stops and cleans up."""


@dataclass
class Trial:
    """One measured run of one system at one session count."""

    system: str
    sessions: int
    messages: int
    size: int
    round: int
    accept_s: float = 0.0
    relay_s: float | None = None  # None: the sink never counted every message
    drain_s: float | None = None
    sink_msgs: int = 0
    cpu_s: float | None = None  # the system's cgroup: Postfix, or spool owner + workers
    owner_cpu_s: float | None = None  # spool only: the owner process itself
    source_cpu_s: float = 0.0
    sink_cpu_s: float = 0.0
    other_busy_frac: float = 0.0  # the rest of the machine, a fraction of all CPUs
    fsyncs: int | None = None  # spool only: the log writer's fdatasyncs
    disk_flushes: int | None = None
    deferred: int | None = None  # spool only: recipients deferred (should be 0)
    log_problems: list[str] = field(default_factory=list)
    status: list[str] = field(default_factory=list)

    @property
    def accepted_rate(self) -> float:
        """Accepted messages per second (smtp-source's wall time)."""
        return self.messages / self.accept_s

    @property
    def relayed_rate(self) -> float | None:
        """Relayed messages per second (until the sink counted the last one)."""
        return None if self.relay_s is None else self.messages / self.relay_s


# ---------------------------------------------------------------- small helpers


def _deadline_wait(what: str, done: Any, timeout: float, interval: float = POLL) -> float:
    """Poll ``done()`` until it is true; the time it took. Raises past ``timeout``."""
    start = time.monotonic()
    while not done():
        if time.monotonic() - start > timeout:
            raise BenchError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)
    return time.monotonic() - start


def _port_free(port: int) -> bool:
    """Whether nothing listens on 127.0.0.1:port."""
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((LOOP, port)) != 0


def _listening(port: int) -> bool:
    return not _port_free(port)


def _proc_cpu(pid: int, children: bool = False) -> float:
    """utime + stime of a live process (plus its reaped children's), in seconds."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    ticks = sum(int(x) for x in fields[11 : 15 if children else 13])
    return ticks / os.sysconf("SC_CLK_TCK")


def _busy_seconds() -> float:
    """Machine-wide busy CPU seconds (all CPUs) from /proc/stat."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def _cgroup_root() -> str | None:
    """Where a cgroup v2 hierarchy is mounted (pure v2, or a hybrid's unified half)."""
    with open("/proc/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 2 and parts[2] == "cgroup2":
                return parts[1]
    return None


def _cgroup_cpu(path: str | None) -> float | None:
    """CPU seconds of every process that ran in a cgroup, exited ones included."""
    if path is None:
        return None
    try:
        with open(os.path.join(path, "cpu.stat")) as f:
            for line in f:
                key, value = line.split()
                if key == "usage_usec":
                    return int(value) / 1e6
    except OSError:
        return None
    return None


def _block_device(path: str) -> str | None:
    """The /proc/diskstats name of the device holding ``path`` (None if not found)."""
    try:
        out = subprocess.run(
            ["df", "--output=source", path], capture_output=True, text=True, check=True
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        return None
    name = os.path.basename(out[-1]) if out else ""
    with open("/proc/diskstats") as f:
        return name if any(line.split()[2] == name for line in f) else None


def _disk_flushes(device: str | None) -> int | None:
    """Flush requests completed by ``device`` so far (machine-wide)."""
    if device is None:
        return None
    with open("/proc/diskstats") as f:
        for line in f:
            parts = line.split()
            if parts[2] == device and len(parts) >= 19:
                return int(parts[18])
    return None


def _signal_pid(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _stop(proc: subprocess.Popen[Any] | None, grace: float = 20) -> None:
    """SIGTERM a process this script started (by its pid), SIGKILL after ``grace``."""
    if proc is None or proc.poll() is not None:
        return
    _signal_pid(proc.pid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        _signal_pid(proc.pid, signal.SIGKILL)
        proc.wait(10)


# ---------------------------------------------------------------- smtp-sink


class Sink:
    """One smtp-sink on 127.0.0.1:port counting messages (``-c``) into a file."""

    def __init__(self, port: int, out: str) -> None:
        if not _port_free(port):
            raise BenchError(f"port {port} on 127.0.0.1 is already in use")
        self.out = out
        args = [SMTP_SINK, "-c"]
        if os.geteuid() == 0:
            args += ["-u", "postfix"]
        args += [f"{LOOP}:{port}", "1024"]
        with open(out, "wb") as f:
            self.proc = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                         start_new_session=True)  # fmt: skip
        try:
            _deadline_wait(f"smtp-sink on port {port}", lambda: self._up(port), 10)
        except BenchError:
            self.stop()
            raise

    def _up(self, port: int) -> bool:
        if self.proc.poll() is not None:
            with open(self.out, errors="replace") as f:
                raise BenchError(f"smtp-sink exited: {f.read()[-500:]}")
        return _listening(port)

    def count(self) -> int:
        """The last complete ``mesg=N`` the sink printed (0 before any)."""
        try:
            with open(self.out, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 128))
                tail = f.read().decode("ascii", "replace")
        except OSError:
            return 0
        done = tail.rsplit("\r", 1)[0] if not tail.endswith("\r") else tail
        found = re.findall(r"mesg=(\d+)", done)
        return int(found[-1]) if found else 0

    def cpu(self) -> float:
        """Its CPU seconds so far."""
        return _proc_cpu(self.proc.pid)

    def stop(self) -> None:
        """Stop it (by its recorded pid)."""
        _stop(self.proc, 10)


# ---------------------------------------------------------------- the two systems


class Postfix:
    """The recipe's private loopback Postfix instance in a temporary work directory."""

    def __init__(self, recipe: str, work: str, port: int, sink_port: int, timeout: float) -> None:
        self.recipe = recipe
        self.work = work
        self.port = port
        self.timeout = timeout
        self.queue = os.path.join(work, "queue")
        self.maillog = os.path.join(work, "log", "maillog")
        self.started = False
        root = _cgroup_root()
        self.cgroup = os.path.join(root, f"pfbench.{os.path.basename(work)}") if root else None
        self._script("configure.sh", str(port), str(sink_port))

    def _script(self, name: str, *args: str) -> str:
        proc = subprocess.run(
            [os.path.join(self.recipe, name), self.work, *args],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise BenchError(f"{name} failed ({proc.returncode}): {proc.stderr.strip()[-800:]}")
        return proc.stdout

    def start(self) -> None:
        """``start.sh`` (Postfix master in its own cgroup)."""
        if not _port_free(self.port):
            raise BenchError(f"port {self.port} on 127.0.0.1 is already in use")
        self.started = True
        self._script("start.sh")

    def queued(self) -> int:
        """Queue files left in incoming/active/deferred/hold/maildrop."""
        n = 0
        for d in QUEUE_DIRS:
            for _, _, files in os.walk(os.path.join(self.queue, d)):
                n += len(files)
        return n

    def log_offset(self) -> int:
        """The maillog's current size (where a trial's lines begin)."""
        try:
            return os.path.getsize(self.maillog)
        except OSError:
            return 0

    def log_problems(self, offset: int) -> list[str]:
        """Warnings, errors and non-delivered statuses logged since ``offset``."""
        try:
            with open(self.maillog, "rb") as f:
                f.seek(offset)
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return []
        pattern = re.compile(r"warning:|error:|fatal:|panic:|status=(deferred|bounced)|reject:")
        return [line for line in text.splitlines() if pattern.search(line)]

    def teardown(self) -> None:
        """``teardown.sh --purge``: Postfix stopped, its cgroup and work directory gone."""
        if os.path.exists(os.path.join(self.work, "bench.env")):
            self._script("teardown.sh", "--purge")
        shutil.rmtree(self.work, ignore_errors=True)


class SpoolServe:
    """``spool serve`` as a relay, a fresh spool and owner, in a cgroup of its own."""

    def __init__(
        self,
        scratch: str,
        name: str,
        port: int,
        sink_port: int,
        workers: int,
        max_use: int,
        smtp_processes: int = 0,
    ) -> None:
        self.directory = os.path.join(scratch, f"spool-{name}")
        self.log = os.path.join(scratch, f"spool-{name}.log")
        self.port = port
        shutil.rmtree(self.directory, ignore_errors=True)
        if not _port_free(port):
            raise BenchError(f"port {port} on 127.0.0.1 is already in use")
        root = _cgroup_root()
        self.cgroup: str | None = None
        if root is not None:
            path = os.path.join(root, f"spoolbench.{os.getpid()}.{name}")
            try:
                os.mkdir(path)
                self.cgroup = path
            except OSError:
                self.cgroup = None
        args = [sys.executable, "-m", "spool.cli", "serve", self.directory,
                "--smtp", f"{LOOP}:{port}", "--smtp-hostname", "spoolbench.localdomain",
                "--agent", f"smtp:{LOOP}:{sink_port}", "--workers", str(workers),
                "--max-use", str(max_use), "--log-file", self.log,
                "--smtp-processes", str(smtp_processes)]  # fmt: skip
        cgroup = self.cgroup

        def enter_cgroup() -> None:
            if cgroup is not None:
                with open(os.path.join(cgroup, "cgroup.procs"), "w") as f:
                    f.write(str(os.getpid()))

        self.proc = subprocess.Popen(
            args,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            preexec_fn=enter_cgroup,
            start_new_session=True,
        )
        try:
            self._wait_ready(workers, smtp_processes)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, workers: int, smtp_processes: int) -> None:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 60)
        line = self.proc.stdout.readline() if ready else b""
        if b"ready" not in line:
            raise BenchError(f"spool serve did not get ready: {line!r}; see {self.log}")

        def all_up() -> bool:
            with connect(self.directory) as client:
                status = client.status()
            up = [w for w in status["workers"] if w["pid"]]
            return len(up) == workers and len(status["smtp_processes"]) == smtp_processes

        _deadline_wait("the spool's workers", all_up, 60, 0.05)
        _deadline_wait("the spool's SMTP listener", lambda: _listening(self.port), 30)

    def statistics(self) -> dict[str, Any]:
        """``Spool.statistics`` of the owner, over its socket."""
        with connect(self.directory) as client:
            return attrs.asdict(client.statistics())

    def owner_cpu(self) -> float:
        """The owner's own CPU seconds (not its workers')."""
        return _proc_cpu(self.proc.pid)

    def cpu(self) -> float | None:
        """CPU seconds of the owner and every worker, exited ones included."""
        return _cgroup_cpu(self.cgroup)

    def log_problems(self) -> list[str]:
        """The log's lines above INFO."""
        try:
            with open(self.log, errors="replace") as f:
                return [line.rstrip() for line in f if not re.search(r" (INFO|DEBUG) ", line)]
        except OSError:
            return []

    def stop(self) -> None:
        """SIGTERM the owner (it stops its workers), wait for the cgroup to empty, drop it."""
        _stop(self.proc, 60)
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        if self.cgroup is not None:
            procs = os.path.join(self.cgroup, "cgroup.procs")

            def empty() -> bool:
                with open(procs) as f:
                    return not f.read().strip()

            try:
                _deadline_wait("the spool's workers to exit", empty, 20, 0.05)
            except BenchError:
                with open(os.path.join(self.cgroup, "cgroup.kill"), "w") as f:
                    f.write("1")  # only this script's own cgroup: owner and workers
                _deadline_wait("the spool's cgroup to empty", empty, 10, 0.05)
            os.rmdir(self.cgroup)
            self.cgroup = None

    def remove(self) -> None:
        """Delete the spool directory and its log."""
        shutil.rmtree(self.directory, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.unlink(self.log)


# ---------------------------------------------------------------- one trial


class Bench:
    """Everything the run set up, so that one ``close`` takes it all down again."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.scratch = tempfile.mkdtemp(prefix="spool-relay-")
        os.chmod(self.scratch, 0o755)  # the Postfix work dir inside must be traversable
        self.device = _block_device(self.scratch)
        self.postfix: Postfix | None = None
        self.spool: SpoolServe | None = None
        self.sink: Sink | None = None
        self.source: subprocess.Popen[bytes] | None = None
        self.count = 0

    def setup_postfix(self) -> None:
        """Configure, start and warm up the Postfix instance."""
        self.postfix = Postfix(
            self.args.recipe,
            os.path.join(self.scratch, "postfix"),
            self.args.postfix_port,
            self.args.sink_port,
            self.args.timeout,
        )
        self.postfix.start()
        if self.args.warmup:
            self.trial(POSTFIX, 20, self.args.warmup, 0)

    def _run_source(self, port: int, sessions: int, messages: int) -> tuple[float, float, str]:
        """smtp-source against 127.0.0.1:port: (wall seconds, its CPU seconds, problems)."""
        args = [SMTP_SOURCE, "-c", "-s", str(sessions), "-m", str(messages),
                "-l", str(self.args.size), "-M", "localhost", "-f", SENDER, "-t", RECIPIENT,
                f"{LOOP}:{port}"]  # fmt: skip
        out = os.path.join(self.scratch, "source.out")
        with open(out, "wb") as f:
            t0 = time.monotonic()
            self.source = subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # fmt: skip
            pid = self.source.pid
            while True:
                done, status, usage = os.wait4(pid, os.WNOHANG)
                if done:
                    elapsed = time.monotonic() - t0
                    self.source.returncode = os.waitstatus_to_exitcode(status)
                    break
                if time.monotonic() - t0 > self.args.timeout:
                    _signal_pid(pid, signal.SIGKILL)
                    self.source.wait(10)
                    raise BenchError(f"smtp-source took over {self.args.timeout:g} s")
                time.sleep(0.005)
        rc = self.source.returncode
        self.source = None
        problem = ""
        if rc != 0:
            with open(out, errors="replace") as f:
                tail = f.read().replace("\r", "\n").strip().splitlines()[-3:]
            problem = f"smtp-source exit {rc}: {' | '.join(tail)}"
        return elapsed, usage.ru_utime + usage.ru_stime, problem

    def trial(self, system: str, sessions: int, messages: int, round_: int) -> Trial:
        """One run of ``system`` (``postfix`` or ``spool wN``) at ``sessions``."""
        a = self.args
        t = Trial(system, sessions, messages, a.size, round_)
        self.count += 1
        self.sink = Sink(a.sink_port, os.path.join(self.scratch, "sink.out"))
        try:
            if system == POSTFIX:
                assert self.postfix is not None
                pf = self.postfix
                if pf.queued():
                    raise BenchError(f"Postfix queue not empty before a trial: {pf.queued()}")
                port, offset = a.postfix_port, pf.log_offset()
                cpu0 = _cgroup_cpu(pf.cgroup)
            else:
                workers, smtp_processes = _spool_variant(system)
                self.spool = SpoolServe(self.scratch, str(self.count), a.spool_port,
                                        a.sink_port, workers, a.max_use,
                                        smtp_processes)  # fmt: skip
                port = a.spool_port
                stats0 = self.spool.statistics()
                cpu0, owner0 = self.spool.cpu(), self.spool.owner_cpu()
            busy0, sink0, flush0 = _busy_seconds(), self.sink.cpu(), _disk_flushes(self.device)
            t0 = time.monotonic()
            t.accept_s, t.source_cpu_s, problem = self._run_source(port, sessions, messages)
            if problem:
                t.status.append(problem)
            sink = self.sink
            try:
                _deadline_wait("the sink", lambda: sink.count() >= messages, a.timeout)
                t.relay_s = time.monotonic() - t0
            except BenchError:
                t.status.append("sink-timeout")
            t.sink_msgs = sink.count()
            if system == POSTFIX:
                assert self.postfix is not None
                pf = self.postfix
                try:
                    _deadline_wait("Postfix's queue to drain", lambda: pf.queued() == 0, 120, 0.1)
                    t.drain_s = time.monotonic() - t0
                except BenchError:
                    t.status.append(f"queue-not-empty ({pf.queued()})")
                cpu1 = _cgroup_cpu(pf.cgroup)
                t.log_problems = pf.log_problems(offset)
            else:
                assert self.spool is not None
                sp = self.spool
                want = int(stats0["delivered"]) + t.sink_msgs

                def drained() -> bool:
                    return int(sp.statistics()["delivered"]) >= want

                try:
                    _deadline_wait("the spool to drain", drained, 120, 0.1)
                    t.drain_s = time.monotonic() - t0
                except BenchError:
                    t.status.append("spool-not-drained")
                stats1 = sp.statistics()
                cpu1 = sp.cpu()
                t.owner_cpu_s = sp.owner_cpu() - owner0
                t.fsyncs = stats1["fsyncs"] - stats0["fsyncs"]
                t.deferred = stats1["deferred"] - stats0["deferred"]
                if stats1["accepted"] - stats0["accepted"] != messages:
                    t.status.append(f"accepted {stats1['accepted'] - stats0['accepted']}")
            flush1 = _disk_flushes(self.device)
            t.sink_cpu_s = self.sink.cpu() - sink0
            busy = _busy_seconds() - busy0
            if cpu0 is not None and cpu1 is not None:
                t.cpu_s = cpu1 - cpu0
            if flush0 is not None and flush1 is not None:
                t.disk_flushes = flush1 - flush0
            span = t.drain_s or t.relay_s or t.accept_s
            other = busy - (t.cpu_s or 0.0) - t.source_cpu_s - t.sink_cpu_s
            t.other_busy_frac = max(0.0, other) / (span * (os.cpu_count() or 1))
        finally:
            self.sink.stop()
            self.sink = None
            if self.spool is not None:
                self.spool.stop()
                t.log_problems = self.spool.log_problems()
                self.spool.remove()
                self.spool = None
        if t.sink_msgs < messages and "sink-timeout" not in t.status:
            t.status.append(f"sink counted {t.sink_msgs}")
        return t

    def close(self) -> None:
        """Stop and remove everything, whatever state the run is in."""
        if self.source is not None and self.source.poll() is None:
            _signal_pid(self.source.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.source.wait(10)
        steps: list[Callable[[], object]] = [
            lambda: self.sink.stop() if self.sink else None,
            lambda: self.spool.stop() if self.spool else None,
            lambda: self.postfix.teardown() if self.postfix else None,
        ]
        for step in steps:
            try:
                step()
            except Exception as exc:  # keep cleaning up
                print(f"cleanup: {exc}", file=sys.stderr)
        shutil.rmtree(self.scratch, ignore_errors=True)


# ---------------------------------------------------------------- the table


def _spool_variant(system: str) -> tuple[int, int]:
    """``spool wN`` or ``spool wN sM``: N workers, M SMTP front-end processes (0: the
    listeners in the owner's process)."""
    words = system.split()
    workers = int(words[1].removeprefix("w"))
    smtp = int(words[2].removeprefix("s")) if len(words) > 2 else 0
    return workers, smtp


def _median(values: list[float]) -> float | None:
    return float(statistics.median(values)) if values else None


def _fmt(x: float | None, spec: str = ",.0f") -> str:
    return "–" if x is None else format(x, spec)


def _spread(values: list[float]) -> str:
    return f"{min(values):,.0f}–{max(values):,.0f}" if values else "–"


def _verdict(ratio: float | None) -> str:
    if ratio is None:
        return "no result"
    if ratio >= 1.1:
        return f"faster than Postfix ({ratio:.2f}x)"
    if ratio >= 0.9:
        return f"on par with Postfix ({ratio:.2f}x)"
    return f"slower than Postfix ({ratio:.2f}x)"


def render(trials: list[Trial], systems: list[str], sessions: list[int], args: Any) -> str:
    """The results as markdown: per (sessions, system) medians, then ratios and verdicts."""
    groups: dict[tuple[int, str], list[Trial]] = {}
    for t in trials:
        groups.setdefault((t.sessions, t.system), []).append(t)
    lines = [
        f"Medians of {args.repeats} interleaved rounds, {args.messages:,} messages of "
        f"{args.size:,} bytes per trial, {os.cpu_count()} CPUs; spool --max-use "
        f"{args.max_use}.",
        "",
        "| sessions | system | accepted msg/s (min–max) | relayed msg/s (min–max) "
        "| last 250 to last at sink, s | CPU ms/msg | owner CPU % of a core | fsync/msg "
        "| disk flushes/msg | other load | problems |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    fsyncs: dict[tuple[int, str], float | None] = {}
    med: dict[tuple[int, str], tuple[float | None, float | None]] = {}
    for s in sessions:
        for system in systems:
            ts = groups.get((s, system), [])
            acc = [t.accepted_rate for t in ts]
            rel = [r for t in ts if (r := t.relayed_rate) is not None]
            med[s, system] = (_median(acc), _median(rel))
            cpu = _median([t.cpu_s / t.messages * 1000 for t in ts if t.cpu_s is not None])
            owner = _median(
                [
                    100 * t.owner_cpu_s / (t.drain_s or t.accept_s)
                    for t in ts
                    if t.owner_cpu_s is not None
                ]
            )
            tail = _median([t.relay_s - t.accept_s for t in ts if t.relay_s is not None])
            fs = fsyncs[s, system] = _median(
                [t.fsyncs / t.messages for t in ts if t.fsyncs is not None]
            )
            fs_text = "1 (recipe's strace)" if system == POSTFIX else _fmt(fs, ".2f")
            fl = _median([t.disk_flushes / t.messages for t in ts if t.disk_flushes is not None])
            other = _median([t.other_busy_frac for t in ts])
            problems = sum(len(t.status) + len(t.log_problems) for t in ts)
            deferred = sum(t.deferred or 0 for t in ts)
            probs = f"{problems} ({deferred} deferred)" if deferred else str(problems)
            lines.append(
                f"| {s} | {system} | {_fmt(med[s, system][0])} ({_spread(acc)}) "
                f"| {_fmt(med[s, system][1])} ({_spread(rel)}) | {_fmt(tail, '.2f')} "
                f"| {_fmt(cpu, '.2f')} "
                f"| {_fmt(owner, '.0f')} | {fs_text} | {_fmt(fl, '.2f')} "
                f"| {_fmt(other, '.2f')} | {probs} |"
            )
    lines += [
        "",
        "| sessions | system | accepted ÷ postfix | relayed ÷ postfix | verdict |",
        "|---:|---|---:|---:|---|",
    ]
    for s in sessions:
        pa, pr = med.get((s, POSTFIX), (None, None))
        for system in systems:
            if system == POSTFIX:
                continue
            sa, sr = med.get((s, system), (None, None))
            ra = sa / pa if sa and pa else None
            rr = sr / pr if sr and pr else None
            lines.append(
                f"| {s} | {system} | {_fmt(ra, '.2f')}x | {_fmt(rr, '.2f')}x "
                f"| accepts {_verdict(ra).split(' (')[0]}, relays {_verdict(rr)} |"
            )
    return "\n".join([*lines, "", _target(med, fsyncs, systems)])


TARGET_SESSIONS, TARGET_RATIO, TARGET_FSYNCS = 20, 1.5, 0.1


def _target(
    med: dict[tuple[int, str], tuple[float | None, float | None]],
    fsyncs: dict[tuple[int, str], float | None],
    systems: list[str],
) -> str:
    """The target line: the best spool variant's relay rate at 20 sessions against
    1.5x Postfix's, and its fsyncs per message against 0.1."""
    want = (
        f"Target: relayed >= {TARGET_RATIO}x Postfix at {TARGET_SESSIONS} sessions, "
        f"at <= {TARGET_FSYNCS} fsync/msg"
    )
    postfix = med.get((TARGET_SESSIONS, POSTFIX), (None, None))[1]
    rates = {
        system: rate
        for system in systems
        if system != POSTFIX and (rate := med.get((TARGET_SESSIONS, system), (None, None))[1])
    }
    if not postfix or not rates:
        return f"{want}: not measured (run with {TARGET_SESSIONS} among --sessions)."
    best = max(rates, key=lambda system: rates[system])
    ratio, fs = rates[best] / postfix, fsyncs.get((TARGET_SESSIONS, best))
    fs_ok = fs is not None and fs <= TARGET_FSYNCS
    if ratio >= TARGET_RATIO and fs_ok:
        return f"{want}: **met** by {best} ({ratio:.2f}x, {_fmt(fs, '.2f')} fsync/msg)."
    short = []
    if ratio < TARGET_RATIO:
        short.append(f"{ratio:.2f}x Postfix, {TARGET_RATIO / ratio:.1f} times too slow")
    if not fs_ok:
        short.append(f"{_fmt(fs, '.2f')} fsync/msg")
    return f"{want}: **missed**; the best, {best}: {'; '.join(short)}."


# ---------------------------------------------------------------- main


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def _signals_as_interrupt() -> Iterator[None]:
    """Ctrl-C, SIGTERM and SIGHUP raise KeyboardInterrupt (even where the shell started
    this with SIGINT ignored), so that the run stops and cleans up."""

    def handler(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    old = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _close_ignoring_signals(bench: Bench) -> None:
    """Clean up with the stop signals ignored: a second Ctrl-C does not cut it short."""
    old = {s: signal.signal(s, signal.SIG_IGN) for s in STOP_SIGNALS}
    try:
        bench.close()
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def main(argv: list[str] | None = None) -> int:
    """Run the interleaved comparison and print the table."""
    p = argparse.ArgumentParser(prog="python -m tools.bench.relay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--messages", type=int, default=10_000, help="per trial [10000]")
    p.add_argument("--sessions", type=_ints, default=[1, 20, 50], help="comma list [1,20,50]")
    p.add_argument("--size", type=int, default=4096, help="message size in bytes [4096]")
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds [3]")
    p.add_argument("--workers", type=_ints, default=[2, 4], help="spool variants [2,4]")
    p.add_argument("--max-use", type=int, default=1000, help="spool serve --max-use [1000]")
    p.add_argument("--smtp", type=_ints, default=[0, 2],
                   help="spool serve --smtp-processes variants, comma list [0,2]")  # fmt: skip
    p.add_argument("--warmup", type=int, default=1000, help="Postfix warm-up messages [1000]")
    p.add_argument("--timeout", type=float, default=900, help="deadline per phase, s [900]")
    p.add_argument("--postfix-port", type=int, default=2525)
    p.add_argument("--spool-port", type=int, default=2535)
    p.add_argument("--sink-port", type=int, default=2526)
    p.add_argument("--raw", metavar="PATH", help="also write every trial as JSON lines")
    p.add_argument(
        "--recipe",
        metavar="DIR",
        default=RECIPE,
        help="the Postfix peer recipe's scripts [$SPOOL_POSTFIX_RECIPE]",
    )
    args = p.parse_args(argv)
    if not args.recipe or not os.path.isfile(os.path.join(args.recipe, "configure.sh")):
        p.error("give the Postfix peer recipe's directory: --recipe DIR or SPOOL_POSTFIX_RECIPE")
    if os.geteuid() != 0:
        p.error("run as root: the Postfix master starts as root (see the recipe's README)")
    for tool in (SMTP_SOURCE, SMTP_SINK, "/usr/sbin/postfix"):
        if not os.access(tool, os.X_OK):
            p.error(f"{tool} missing: run {args.recipe}/install.sh first")
    if not (1 <= args.messages <= 1_000_000 and args.size > 0 and args.repeats > 0):
        p.error("need 1 <= --messages <= 1000000, --size > 0, --repeats > 0")
    if not args.sessions or any(not 1 <= s <= 500 for s in args.sessions):
        p.error("--sessions must be 1..500")
    systems = [
        POSTFIX,
        *(f"spool w{w}" + (f" s{m}" if m else "") for w in args.workers for m in args.smtp),
    ]
    trials: list[Trial] = []
    bench = Bench(args)
    try:
        with _signals_as_interrupt():
            bench.setup_postfix()
            for r in range(1, args.repeats + 1):
                for s in args.sessions:
                    for system in systems:
                        t = bench.trial(system, s, args.messages, r)
                        trials.append(t)
                        print(
                            f"round {r}/{args.repeats} sessions {s:3} {system:9} accepted "
                            f"{t.accepted_rate:8,.0f} relayed {_fmt(t.relayed_rate, '8,.0f')}"
                            f" msg/s  cpu {_fmt(t.cpu_s, '.1f')} s owner "
                            f"{_fmt(t.owner_cpu_s, '.1f')} s  other {t.other_busy_frac:.2f}"
                            + (f"  [{'; '.join(t.status)}]" if t.status else "")
                            + (f"  log: {len(t.log_problems)} lines" if t.log_problems else ""),
                            file=sys.stderr,
                            flush=True,
                        )
                        if args.raw:
                            with open(args.raw, "a") as f:
                                f.write(json.dumps(asdict(t)) + "\n")
    except KeyboardInterrupt:
        print("interrupted: cleaning up", file=sys.stderr)
        return 130
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        _close_ignoring_signals(bench)
    print(render(trials, systems, args.sessions, args))
    problems = [(t.system, t.sessions, x) for t in trials for x in t.status + t.log_problems]
    if problems:
        print(f"\n{len(problems)} problem(s), first ones:")
        for system, s, text in problems[:10]:
            print(f"- {system}, {s} sessions: {text[:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
