"""Run ``spool serve`` or ``spool-worker`` with SIGTERM sent at the worst moment.

Python runs a signal's handler on the main thread between two bytecodes, whatever that
thread holds. This runs the command with a trace on its main thread that, the first time
the thread enters ``threading.Condition.wait`` or ``notify_all`` (an ``Event``'s wait or
set, the condition's lock held), sends the process SIGTERM: the handler runs at the next
bytecode, inside that lock. A handler that takes the same lock hangs the process for good.

A timer sends SIGTERM anyway some seconds after the trace is armed (``FALLBACK``), so that
a command whose main thread never enters those is stopped too.

Usage: ``python -m tests.serve.signal_at_worst serve|worker DIR [ARGS...]``. The trace is
armed when the owner is ready (after its ready line), or when the worker's delivery loops
run (it then prints "armed"): a worker's main thread sets its stop event when its owner
goes away.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType
from typing import Any

FALLBACK = {"serve": 1.0, "worker": 10.0}  # seconds
INSIDE_THE_LOCK = {"Condition.wait", "Condition.notify_all"}


def main() -> None:
    command, directory, *args = sys.argv[1:]
    sent = threading.Event()

    def send() -> None:
        if not sent.is_set():
            sent.set()
            os.kill(os.getpid(), signal.SIGTERM)

    def at_worst(frame: FrameType, event: str, _arg: Any) -> Any:
        if event == "call" and frame.f_code.co_qualname in INSIDE_THE_LOCK:
            sys.settrace(None)
            send()
        return None

    def arm() -> None:
        threading.Timer(FALLBACK[command], send).start()
        sys.settrace(at_worst)

    if command == "serve":
        from spool.serving import serve

        signum = serve(directory, workers=0, agent="", max_use=1, attempt_timeout=60.0,
                       ready=lambda line: (print(line, flush=True), arm()))  # fmt: skip
        print(f"stopped by {signal.Signals(signum).name}", flush=True)
    else:

        def arm_when_running(frame: FrameType, event: str, _arg: Any) -> Any:
            if event == "call" and frame.f_code.co_name == "_wait_for_loops":
                arm()
                print("armed", flush=True)
            return None

        from spool.worker import main as worker_main

        sys.settrace(arm_when_running)
        worker_main([directory, *args])


if __name__ == "__main__":
    main()
