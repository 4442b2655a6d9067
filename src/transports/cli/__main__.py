"""``python -m transports.cli``: the same command as the ``pipeline`` console script."""

import sys

from transports.cli.commands import main

sys.exit(main())
