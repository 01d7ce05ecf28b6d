"""``python -m graphsplit``: the command-line interface (see :mod:`graphsplit.cli`)."""

from graphsplit.cli import main

raise SystemExit(main())
