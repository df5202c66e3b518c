"""Regenerate docs/format.md's worked example: the bytes of a one-message spool.

    python -m tools.format_example DIR

The example is deterministic: the clock is fixed, and the two random numbers a spool
draws (the segment salt and the start of the message-id counter) are pinned to the values
the page shows, so running this reproduces the page's dumps byte for byte.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys

from spool import Spool, writer
from spool.testing import FakeClock

SALT = 0x5A17CAFE
ID_COUNTER = 0x54D06D28


def make(path: str, *, inline_body_max: int | None = None, deliver: bool = True) -> None:
    # Pin the two random draws (a tool, not the spool: nothing else runs in this process).
    setattr(writer, "new_salt", lambda: SALT)  # noqa: B010
    setattr(secrets, "randbits", lambda bits: ID_COUNTER)  # noqa: B010
    clock = FakeClock(1_800_000_000.0)
    options = {} if inline_body_max is None else {"inline_body_max": inline_body_max}
    with Spool.open(path, clock=clock, **options) as sp:  # type: ignore[arg-type]
        sp.accept("alice@example.org", ["bob@example.net"], b"Subject: hi\r\n\r\nhello\r\n")
        if not deliver:
            return  # a body file is removed once its message is finished
        clock.advance(1.5)
        with sp.claim() as attempt:  # type: ignore[union-attr]
            attempt.delivered(["bob@example.net"], "250 2.0.0 ok")


def main() -> None:
    base = sys.argv[1]
    inline, filed = os.path.join(base, "example"), os.path.join(base, "example-file")
    make(inline)
    make(filed, inline_body_max=16, deliver=False)
    seg = os.path.join(inline, "log", "00000000000000000001.seg")
    print(subprocess.run(["xxd", "-a", seg], capture_output=True, text=True).stdout)
    for name in ("positions", "settings"):
        with open(os.path.join(inline, name)) as f:
            print(f.read())
    bodies = os.path.join(filed, "bodies")
    for name in os.listdir(bodies):
        print(
            subprocess.run(
                ["xxd", os.path.join(bodies, name)], capture_output=True, text=True
            ).stdout
        )


if __name__ == "__main__":
    main()
