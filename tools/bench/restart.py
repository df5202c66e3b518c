"""Restart benchmark: opening a spool costs what was in flight, not what is queued.

``python -m tools.bench.restart`` builds a spool and a one-file-per-message queue with
10k, 100k and 1M messages (``--sizes``), leaves 100 messages in flight in each by
killing a child that holds them (SIGKILL), and times the reopen in a fresh process: time
to open (recovery, for spool; moving ``active/`` back and listing the queue, for the
file spool), time to the first claim, records and bytes scanned (``Spool.recovery``),
and the reopening process's peak RSS after 1000 more attempts. The repetitions
alternate the two systems. The queues grow in place from one size to the next, so the
largest is built once.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from typing import Any

from tools.bench import report
from tools.bench.restart_probe import IN_FLIGHT, grow_files, grow_spool
from tools.bench.spawn import hold_then_kill, run_json
from tools.bench.systems import Message

FULL_SIZES = (10_000, 100_000, 1_000_000)
QUICK_SIZES = (10_000, 50_000)
BODY = 1024  # the reopen never reads bodies; small ones keep the 1M-message build short


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run(
    root: str, sizes: Sequence[int], reps: int, body: int = BODY, keep: bool = False
) -> list[dict[str, Any]]:
    """Build, crash and reopen at each size; return one row per reopen."""
    spool_dir, files_dir = os.path.join(root, "spool"), os.path.join(root, "files")
    shutil.rmtree(root, ignore_errors=True)
    os.makedirs(root)
    msg = Message.sample(body)
    rows: list[dict[str, Any]] = []
    have = 0
    try:
        for n in sorted(sizes):
            started = time.monotonic()
            grow_spool(spool_dir, have, n, msg)
            grow_files(files_dir, have, n, msg)
            have = n
            _log(f"restart: built {n:,} queued in each ({time.monotonic() - started:.0f} s)")
            for rep in range(reps):
                order = [("spool", spool_dir), ("file-per-message", files_dir)]
                for system, path in order if rep % 2 == 0 else order[::-1]:
                    kind = "spool" if system == "spool" else "files"
                    hold_then_kill([f"{kind}-hold", path, "--in-flight", str(IN_FLIGHT)])
                    row = run_json([f"{kind}-open", path])
                    row.update(system=system, queued=n, rep=rep)
                    rows.append(row)
                    _log(
                        f"restart: {system:16} {n:>9,} queued: open "
                        f"{row['open_s'] * 1000:8.1f} ms, first claim "
                        f"{row['first_claim_s'] * 1000:8.1f} ms, "
                        f"RSS {row['peak_rss_kib'] / 1024:.1f} MiB"
                    )
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command line: run the restart benchmark alone and print its table."""
    parser = argparse.ArgumentParser(prog="python -m tools.bench.restart", description=__doc__)
    parser.add_argument(
        "--sizes",
        default=",".join(str(n) for n in FULL_SIZES),
        help="comma-separated queue sizes (default: %(default)s)",
    )
    parser.add_argument("--quick", action="store_true", help="sizes 10k and 50k")
    parser.add_argument("--reps", type=int, default=3, help="reopens per size and system")
    parser.add_argument("--dir", default="var/bench/restart", help="scratch directory")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--keep", action="store_true", help="keep the built queues")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else tuple(int(s) for s in args.sizes.split(","))
    rows = run(args.dir, sizes, args.reps, keep=args.keep)
    print("\n".join(report.restart_table(rows)))
    print()
    print("\n".join(report.targets_table(report.restart_targets(rows))))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
