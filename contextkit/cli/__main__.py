"""``python -m contextkit.cli``: the ``contextkit`` command."""

import sys

from contextkit.cli.main import main

sys.exit(main())
