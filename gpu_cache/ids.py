"""One rule for the names users choose: tenants and shadow session ids.

A name is 1-128 characters of letters, digits and ``_ . : @ -``, starts with a letter
or digit, and contains no ``..``. So it can never hold a path separator, a control
character (newlines included) or whitespace, it is a safe single path component and
S3 key segment, and the empty string is an error rather than a silent default.
"""

from __future__ import annotations

import re

from gpu_cache._errors import InvalidNameError

__all__ = ["MAX_NAME_LENGTH", "RESERVED_NAMES", "validate_name", "validate_tenant"]

MAX_NAME_LENGTH = 128
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:@-]*")
#: Names that collide with files a store keeps beside its sessions.
RESERVED_NAMES = frozenset({"index.json"})


def validate_name(value: object, kind: str = "name") -> str:
    """Return ``value`` if it follows the naming rule; ``kind`` names it in the error.

    Raises:
        InvalidNameError: not a str, empty, too long, a character outside the rule
            (control characters and whitespace included), ``..``, or a reserved name.
    """
    rule = (f"{kind}s are 1-{MAX_NAME_LENGTH} characters of letters, digits and '_.:@-', "
            "starting with a letter or digit, with no '..'")
    if not isinstance(value, str):
        raise InvalidNameError(f"{kind} must be a str, got {type(value).__name__}; {rule}")
    if not value:
        raise InvalidNameError(f"{kind} is empty; {rule}")
    if len(value) > MAX_NAME_LENGTH:
        raise InvalidNameError(f"{kind} is {len(value)} characters long; {rule}")
    if not _NAME.fullmatch(value) or ".." in value:
        raise InvalidNameError(f"invalid {kind} {value!r}; {rule}")
    if value in RESERVED_NAMES:
        raise InvalidNameError(f"{kind} {value!r} is reserved by the store layout; pick another")
    return value


def validate_tenant(tenant: object) -> str:
    """Return ``tenant`` if it follows :func:`validate_name`'s rule."""
    return validate_name(tenant, "tenant")
