"""``pipe:COMMAND``: the message on a command's standard input, as Postfix's pipe(8).

``COMMAND`` is split as a shell would split it (no shell runs); ``{sender}`` and
``{recipient}`` in its words are replaced. With ``{recipient}`` the command runs once per
recipient; without it, once for all of them. Exit status as pipe(8) maps sysexits: 0
delivered; 75 (EX_TEMPFAIL) deferred; a signal or a run over ``TIMEOUT`` seconds deferred;
a command that cannot be started deferred (the operator fixes it, the mail waits); any
other status failed, quoting the first line of the command's standard error. A word that
an address would make begin with ``-`` is never run (it could pass as an option: Postfix's
``allow_min_user = no``): that recipient fails, 550 5.1.3.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from typing import Final

from spool.agents import Replies
from spool.attempts import MessageEnvelope
from spool.errors import SpoolMisuse

EX_TEMPFAIL: Final = 75
_PLACEHOLDER: Final = re.compile(r"\{sender\}|\{recipient\}")
TIMEOUT: Final = 1000.0  # seconds, as Postfix's command_time_limit


class PipeAgent:
    def __init__(self, words: list[str]) -> None:
        self.words = words
        self.per_recipient = any("{recipient}" in w for w in words)

    def deliver(self, envelope: MessageEnvelope, data: bytes) -> Replies:
        if self.per_recipient:
            return {r: self._run(envelope.sender, r, data) for r in envelope.recipients}
        reply = self._run(envelope.sender, None, data)
        return {r: reply for r in envelope.recipients}

    def _run(self, sender: str, recipient: str | None, data: bytes) -> str:
        values = {"{sender}": sender, "{recipient}": recipient or ""}
        # One pass: an address holding the text "{recipient}" stays as it is.
        argv = [_PLACEHOLDER.sub(lambda m: values[m.group(0)], w) for w in self.words]
        if any(a[:1] == "-" != w[:1] for w, a in zip(self.words, argv, strict=True)):
            # An address that would pass as an option (Postfix's allow_min_user = no).
            return "550 5.1.3 an address beginning with '-' is not given to a command"
        try:
            done = subprocess.run(argv, input=data, capture_output=True, timeout=TIMEOUT)
        except subprocess.TimeoutExpired:
            return f"451 4.3.0 command timed out after {TIMEOUT:.0f} s"
        except OSError as e:
            return f"451 4.3.0 cannot run {argv[0]}: {e.strerror or e}"
        if done.returncode == 0:
            return "250 2.0.0 delivered via command"
        said = done.stderr.decode("utf-8", "replace").strip().splitlines()
        detail = f": {said[0][:200]}" if said else ""
        if done.returncode == EX_TEMPFAIL or done.returncode < 0:
            return f"451 4.3.0 command status {done.returncode}{detail}"
        return f"550 5.3.0 command status {done.returncode}{detail}"

    def close(self) -> None:
        pass


def make(argument: str) -> PipeAgent:
    try:
        words = shlex.split(argument)
    except ValueError as e:
        raise SpoolMisuse(f"cannot split the pipe command: {e}") from None
    if not words:
        raise SpoolMisuse("give the command: --agent 'pipe:/usr/bin/procmail -d {recipient}'")
    return PipeAgent(words)
