"""Regenerate the example outputs in docs/cli.md from a real sample spool.

Usage: ``python -m tools.cli_examples > docs/cli-examples.md`` (then paste, or keep the
file). The sample: a few messages, one delivered, some deferred, one held.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile

from spool import Spool

COMMANDS = [
    ["list", "{d}"],
    ["list", "{d}", "--json", "--held"],
    ["list", "-i", "{d}", "--state", "deferred"],
    ["show", "{d}", "{deferred}"],
    ["show", "{d}", "{deferred}", "--headers"],
    ["stats", "{d}"],
    ["dump", "{d}", "--limit", "6"],
    ["check", "{d}"],
    ["recover", "--dry-run", "{d}"],
    ["hold", "{d}", "{fresh}"],
    ["retry", "--all", "{d}"],
    ["checkpoint", "{d}"],
]


def build(path: str) -> dict[str, str]:
    with Spool.open(path) as sp:
        ids = {
            "done": sp.accept("alice@example.org", ["bob@example.net"], b"Subject: a\r\n\r\nx\r\n"),
            "deferred": sp.accept(
                "alice@example.org",
                ["carol@example.com", "dave@example.net", "erin@example.com"],
                b"Subject: b\r\nFrom: alice@example.org\r\n\r\n" + b"y" * 2000,
            ),
            "held": sp.accept("", ["postmaster@example.org"], b"Subject: bounce\r\n\r\nz\r\n"),
            "fresh": sp.accept("erin@example.org", ["frank@example.com"], b"Subject: c\r\n\r\n"),
        }
        for _ in range(2):
            attempt = sp.claim()
            assert attempt is not None
            with attempt:
                if attempt.msg_id == ids["done"]:
                    attempt.delivered(attempt.envelope.recipients, "250 2.0.0 ok")
                else:
                    attempt.delivered(["dave@example.net"], "250 2.0.0 ok")
                    attempt.deferred(["carol@example.com"], "451 4.7.1 greylisted")
                    attempt.deferred(["erin@example.com"], "421 4.4.2 connection timed out")
        sp.hold(ids["held"])
    return ids


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/spool"
        ids = build(path)
        for cmd in COMMANDS:
            args = [a.format(d=path, **ids) for a in cmd]
            proc = subprocess.run(
                [sys.executable, "-m", "spool.cli", *args], capture_output=True, text=True
            )
            shown = " ".join(cmd).format(d="var/spool", **ids)
            out = (proc.stdout + proc.stderr).replace(path, "var/spool")
            print(f"```console\n$ spool {shown}\n{out.rstrip()}\n```\n")


if __name__ == "__main__":
    main()
