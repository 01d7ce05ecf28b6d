"""``python -m graphsplit``: the command-line interface (see :mod:`graphsplit.tools.cli`)."""

from graphsplit.tools.cli import main

raise SystemExit(main())
