"""``python -m spool.cli``: the ``spool`` command."""

from spool.cli import main

main()
