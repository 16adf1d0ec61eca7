"""``python -m contextkit.cli``: the ``contextkit`` command."""

import sys

from contextkit.cli.commands import main

sys.exit(main())
