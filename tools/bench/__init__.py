"""The benchmark harness: ``python -m tools.bench [--quick]``.

Runs every workload against every system on the same file system, interleaved, and
prints one table of medians. Modules:

* ``systems``: the systems under test behind one interface (raw limit, file per message,
  SQLite, persist-queue, spool), each counting its own sync calls where it can.
* ``workloads``: durable accept with 1 and 32 producers, and the full lifecycle.
* ``fsyncs``: counts every system's syncs from outside with ``strace -c``.
* ``restart``: time and memory to open a large spool, against a directory scan
  (``python -m tools.bench.restart``); ``restart_probe`` builds the queues and holds
  and reopens them in children.
* ``child``: the entry points the parent runs in subprocesses; ``spawn`` runs them.
* ``machine``: the machine facts printed with every run.
* ``report``: medians, ratios, targets and the markdown tables.
"""
