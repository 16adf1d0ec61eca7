"""CacheIdentity checks every field's type and range: one typed error naming the field."""

from __future__ import annotations

from typing import Any

import pytest

from gpu_cache import CacheConfig, CacheIdentity, CacheIdentityError, TQGPUCache

GOOD: dict[str, Any] = CacheIdentity("test/tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                                     block_size=4, rotation_seed=7).to_dict()

BAD_FIELDS = [
    ("model_id", {}, "non-empty str"),
    ("model_id", "", "non-empty str"),
    ("model_id", 3, "non-empty str"),
    ("num_layers", "2", "positive int"),
    ("num_layers", 0, "positive int"),
    ("num_kv_heads", 2.0, "positive int"),
    ("head_dim", True, "positive int"),
    ("head_dim", 15, "even"),
    ("block_size", None, "positive int"),
    ("codec", "tq8", "one of"),
    ("codec", ["tq4"], "one of"),
    ("rotation_seed", None, "int in [0, 2**64)"),
    ("rotation_seed", -1, "int in [0, 2**64)"),
    ("rotation_seed", 2**64, "int in [0, 2**64)"),
    ("rotation_seed", "7", "int in [0, 2**64)"),
    ("tokenizer_id", None, "str"),
    ("key_offset_digest", 5, "str"),
    ("schema_version", "1", "positive int"),
]


@pytest.mark.parametrize(("field", "value", "expected"), BAD_FIELDS,
                         ids=[f"{f}={v!r}" for f, v, _ in BAD_FIELDS])
def test_a_bad_field_is_a_cache_identity_error_naming_it(field: str, value: object,
                                                         expected: str) -> None:
    with pytest.raises(CacheIdentityError) as direct:
        CacheIdentity(**{**GOOD, field: value})
    message = str(direct.value)
    assert f"CacheIdentity.{field}" in message and expected in message, message
    assert "\n" not in message
    # The same from data (a manifest's identity block), with what to do about it.
    with pytest.raises(CacheIdentityError) as parsed:
        CacheIdentity.from_dict({**GOOD, field: value})
    assert f"CacheIdentity.{field}" in str(parsed.value) and "discard" in str(parsed.value)


def test_an_identity_that_is_not_an_object_is_refused() -> None:
    for doc in (["model_id"], "tq4", None, 5):
        with pytest.raises(CacheIdentityError, match="JSON object"):
            CacheIdentity.from_dict(doc)  # type: ignore[arg-type]


def test_valid_identities_round_trip_and_build_caches() -> None:
    identity = CacheIdentity.from_dict(GOOD)
    assert identity.to_dict() == GOOD and hash(identity) == hash(CacheIdentity(**GOOD))
    top = CacheIdentity.from_dict({**GOOD, "rotation_seed": 2**64 - 1})
    cache = TQGPUCache(top, CacheConfig(num_device_blocks=2, num_host_blocks=2, device="cpu"))
    assert cache.identity.rotation_seed == 2**64 - 1
    with pytest.raises(CacheIdentityError, match="missing"):
        CacheIdentity.from_dict({k: v for k, v in GOOD.items() if k != "head_dim"})
    with pytest.raises(CacheIdentityError, match="unknown fields"):
        CacheIdentity.from_dict({**GOOD, "future_field": 1})
