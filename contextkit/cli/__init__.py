"""The ``contextkit`` command: ``demo``, ``status``, ``recover``, ``config show``, ``bench``, and
the commands of the ``contextkit.commands`` entry points (``serve-vllm``).

Owns the argument parser, the commands and the exit codes (``commands``), the demo
(``demo``), the status of a shadow store (``status``) and the reading of a
``/metrics`` page (``scrape``). ``contextkit.cli:main`` is the console script; ``python -m
contextkit.cli`` runs it too. It sits on top: it may import every room and
:mod:`contextkit.bench`; nothing in contextkit imports it.
"""

from __future__ import annotations

from contextkit import lazy_face

_EXPORTS = {
    "main": "contextkit.cli.commands",
    "build_parser": "contextkit.cli.commands",
    "run_command": "contextkit.cli.commands",
    "EXIT_BUG": "contextkit.cli.commands",
    "EXIT_INTERRUPTED": "contextkit.cli.commands",
    "EXIT_USER_ERROR": "contextkit.cli.commands",
}

__getattr__, __dir__, __all__ = lazy_face(__name__, _EXPORTS)
