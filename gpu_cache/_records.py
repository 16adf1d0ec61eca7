"""Checks of the block records :meth:`gpu_cache.TQGPUCache.import_blocks` takes, done
for every record before anything is allocated (a bad record leaks nothing)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from gpu_cache._errors import InvalidNameError
from gpu_cache.hashing import BlockHash
from gpu_cache.ids import validate_tenant

__all__ = ["ImportRecord", "check_import_record"]


@dataclass(frozen=True, slots=True)
class ImportRecord:
    """One checked block record."""

    source_layer: str
    importance: float
    token_range: tuple[int, int]
    tenant: str
    num_tokens: int
    key: BlockHash | None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_import_record(index: int, meta: Mapping[str, object], block_size: int) -> ImportRecord:
    """Check record ``index`` (defaults as :meth:`TQGPUCache.import_blocks` documents).

    Raises:
        ValueError: a field of the wrong type or out of range, naming the record and
            the field (:class:`~gpu_cache.InvalidNameError` for the tenant).
    """
    where = f"import_blocks record {index}"
    layer = meta.get("source_layer", "unassigned")
    if not isinstance(layer, str) or not layer:
        raise ValueError(f"{where}: source_layer must be a non-empty str, got {layer!r}")
    importance = meta.get("importance", 0.5)
    if (isinstance(importance, bool) or not isinstance(importance, (int, float))
            or not 0.0 <= float(importance) <= 1.0):
        raise ValueError(f"{where}: importance must be a number in [0, 1], got {importance!r}")
    token_range = meta.get("token_range", (0, 0))
    if (not isinstance(token_range, (tuple, list)) or len(token_range) != 2
            or not all(_is_int(x) and x >= 0 for x in token_range)
            or token_range[0] > token_range[1]):
        raise ValueError(f"{where}: token_range must be two ints 0 <= start <= end, got "
                         f"{token_range!r}")
    tenant = meta.get("tenant_slug", "default")
    try:
        validate_tenant(tenant)
    except InvalidNameError as exc:
        raise InvalidNameError(f"{where}: {exc}") from None
    assert isinstance(tenant, str)
    num_tokens = meta.get("num_tokens", block_size)
    if not _is_int(num_tokens) or not 0 <= num_tokens <= block_size:  # type: ignore[operator]
        raise ValueError(f"{where}: num_tokens must be an int in [0, {block_size}], got "
                         f"{num_tokens!r}")
    assert isinstance(num_tokens, int)
    key = meta.get("key")
    if key is not None and (not isinstance(key, bytes) or len(key) != 32):
        raise ValueError(f"{where}: key must be 32 bytes (a SHA-256 block key) or absent, got "
                         f"{key!r:.80}")
    return ImportRecord(layer, float(importance), (token_range[0], token_range[1]), tenant,
                        num_tokens, None if key is None else BlockHash(key))
