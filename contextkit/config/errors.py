"""Errors every room of contextkit shares: a bad configuration, a missing optional extra.

The lowest floor of contextkit: it imports nothing of the project, so any module may
raise these. :func:`require` imports an optional dependency lazily and says which
extra to install when it is missing.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["ConfigError", "MissingExtraError", "require"]


class ConfigError(ValueError):
    """A configuration source holds an unknown key or a value of the wrong type or range."""


class MissingExtraError(ImportError):
    """An optional dependency is missing; the message names the pip extra."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module`` or raise MissingExtraError naming ``contextkit[extra]``."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise MissingExtraError(
            f"{module!r} is not installed; install it with: pip install 'contextkit[{extra}]'"
        ) from exc
