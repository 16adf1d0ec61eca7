"""The ``contextkit`` command: ``demo``, ``status``, ``recover``, ``config show``, ``bench``.

Owns the argument parser, the commands and the exit codes (``commands``), the demo
(``demo``), the status of a shadow store (``status``) and the reading of a
``/metrics`` page (``scrape``). ``contextkit.cli:main`` is the console script; ``python -m
contextkit.cli`` runs it too. It sits on top: it may import every room and
:mod:`contextkit.bench`; nothing in contextkit imports it.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "main": "contextkit.cli.commands",
    "build_parser": "contextkit.cli.commands",
    "run_command": "contextkit.cli.commands",
    "EXIT_BUG": "contextkit.cli.commands",
    "EXIT_INTERRUPTED": "contextkit.cli.commands",
    "EXIT_USER_ERROR": "contextkit.cli.commands",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
