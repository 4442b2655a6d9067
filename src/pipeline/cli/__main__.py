"""``python -m pipeline.cli``: the same command as the ``pipeline`` console script."""

import sys

from pipeline.cli.commands import main

sys.exit(main())
