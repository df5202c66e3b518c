"""Entry points the benchmark runs in subprocesses: ``python -m tools.bench.child ...``.

Every trial runs in a fresh process on a fresh directory, so no trial inherits another's
threads, page-cache state of its own files, or heap; and a trial can be run under
``strace`` to count its sync calls from outside. Each command prints one JSON object on
the last line of its standard output.

Commands:
    ``trial``: one timed workload on one system (see ``workloads``);
    ``spool-hold`` / ``files-hold``: put 100 messages in flight, say ``ready``, wait to be
    killed (restart benchmark);
    ``spool-open`` / ``files-open``: time opening a queue and its first claim, then report
    peak memory (restart benchmark).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import tempfile
import time
from typing import Any

from tools.bench import restart_probe, workloads
from tools.bench.systems import SYSTEMS, Message
from tools.bench.workloads import TrialResult

RAW_SYSTEMS = ("raw-fdatasync", "raw-overwrite", "raw-bandwidth")
WORKLOAD_THREADS = {"accept-1": 1, "accept-32": 32, "lifecycle-1": 1, "lifecycle-32": 32}


def run_trial(system: str, workload: str, body: int, seconds: float, directory: str) -> TrialResult:
    """One trial of ``workload`` on ``system`` in a fresh ``directory`` (removed after)."""
    from spool.testing import FakeClock

    msg = Message.sample(body)
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    try:
        if system == "raw-fdatasync":
            return workloads.raw_fdatasync(directory, msg.serialized(), seconds)
        if system == "raw-overwrite":
            return workloads.raw_overwrite(directory, msg.serialized(), seconds)
        if system == "raw-bandwidth":
            return workloads.raw_bandwidth(directory, msg.serialized(), seconds)
        clock = FakeClock()
        target = SYSTEMS[system](os.path.join(directory, "q"), clock)
        try:
            threads = WORKLOAD_THREADS[workload]
            cpu = time.process_time()  # the workload's, not the open's or the close's
            if workload == "lifecycle-1":
                result = workloads.enqueue_then_drain(target, clock, msg, seconds)
            elif workload.startswith("lifecycle"):
                result = workloads.lifecycle(target, clock, msg, threads, seconds)
            else:
                result = workloads.accept(target, msg, threads, seconds)
            return dataclasses.replace(result, cpu_seconds=time.process_time() - cpu)
        finally:
            target.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def system_label(system: str) -> str:
    """A system's label, asking the system itself (it may depend on library defaults)."""
    if system == "raw-fdatasync":
        return "raw limit: write + fdatasync per record, 1 thread"
    if system == "raw-overwrite":
        return "raw: pwrite + fdatasync into a pre-written file, 1 thread"
    if system == "raw-bandwidth":
        return "raw limit: sequential buffered append bandwidth"
    from spool.testing import FakeClock

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_DIR", "var/bench")) as d:
        target = SYSTEMS[system](os.path.join(d, "q"), FakeClock())
        try:
            return target.label()
        finally:
            target.close()


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> None:
    """Parse the command line and run one child command."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.child")
    sub = parser.add_subparsers(dest="command", required=True)
    trial = sub.add_parser("trial", help="one timed workload on one system")
    trial.add_argument("--system", required=True, choices=[*RAW_SYSTEMS, *SYSTEMS])
    trial.add_argument("--workload", required=True, choices=list(WORKLOAD_THREADS))
    trial.add_argument("--body", type=int, required=True)
    trial.add_argument("--seconds", type=float, required=True)
    trial.add_argument("--dir", required=True)
    label = sub.add_parser("label", help="print a system's label")
    label.add_argument("--system", required=True, choices=[*RAW_SYSTEMS, *SYSTEMS])
    for name in ("spool-hold", "files-hold", "spool-open", "files-open"):
        p = sub.add_parser(name)
        p.add_argument("path")
        p.add_argument("--in-flight", type=int, default=restart_probe.IN_FLIGHT)
        p.add_argument("--work", type=int, default=restart_probe.WORK_AFTER_OPEN)
    args = parser.parse_args(argv)

    if args.command == "trial":
        r = run_trial(args.system, args.workload, args.body, args.seconds, args.dir)
        _emit({
            "messages": r.messages,
            "seconds": r.seconds,
            "fsyncs": r.fsyncs,
            "cpu_seconds": r.cpu_seconds,
        })  # fmt: skip
    elif args.command == "label":
        _emit({"label": system_label(args.system)})
    elif args.command == "spool-hold":
        restart_probe.spool_hold(args.path, args.in_flight)
    elif args.command == "files-hold":
        restart_probe.files_hold(args.path, args.in_flight)
    elif args.command == "spool-open":
        _emit(restart_probe.spool_open(args.path, args.work))
    elif args.command == "files-open":
        _emit(restart_probe.files_open(args.path, args.work))


if __name__ == "__main__":
    main()
