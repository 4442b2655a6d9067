"""``python -m pipeline``: the same command as the ``pipeline`` console script."""

import sys

from transports.cli import main

sys.exit(main())
