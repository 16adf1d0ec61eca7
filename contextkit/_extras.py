"""Optional dependencies: import them lazily, and say which extra to install."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


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
