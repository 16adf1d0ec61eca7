"""Issue 53 items 6, 7, 10: the connector's settings are checked once, in one line, for
every way they arrive (Python, JSON, the shared tier's URL and key)."""

from __future__ import annotations

import json
import math

import pytest

from integrations.vllm.config import ConnectorConfig, ConnectorConfigError

SHARED = "file:///tmp/ck-shared-checks"


@pytest.mark.parametrize("field", ["shared_deadline_s", "shared_max_age_s",
                                   "shared_pinned_max_age_s"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, 0.0, -1.0])
def test_shared_durations_must_be_finite_and_positive(field: str, bad: float) -> None:
    with pytest.raises(ConnectorConfigError, match=f"^{field} must be a finite number"):
        ConnectorConfig(shared_url=SHARED, **{field: bad})


@pytest.mark.parametrize("field", ["shadow_interval_s", "shared_gc_interval_s"])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0])
def test_intervals_must_be_finite_and_not_negative(field: str, bad: float) -> None:
    with pytest.raises(ConnectorConfigError, match=f"^{field} must be a finite number"):
        ConnectorConfig(**{field: bad})


@pytest.mark.parametrize(("field", "bad"), [
    ("shared_tenant_budget_mb", 1.5), ("shared_tenant_budget_mb", 0),
    ("shared_chunk_blocks", 2.0), ("host_blocks", 1.5), ("device_blocks", 0),
    ("block_size", 16.5), ("save_threads", 0),
])
def test_sizes_must_be_whole_numbers_with_a_clear_error(field: str, bad: float) -> None:
    with pytest.raises(ConnectorConfigError, match=f"^{field} must be a whole number >= 1"):
        ConnectorConfig(shared_url=SHARED, **{field: bad})


def test_a_shared_url_of_no_known_store_is_refused_at_configuration() -> None:
    with pytest.raises(ConnectorConfigError, match=r"^shared_url .*ftp.*file://, s3://"):
        ConnectorConfig(shared_url="ftp://host/tier")


def test_the_shared_key_is_asked_for_where_the_connector_asks(monkeypatch) -> None:
    monkeypatch.delenv("CONTEXTKIT_SHADOW_KEY", raising=False)
    config = ConnectorConfig(shared_url=SHARED)
    with pytest.raises(ConnectorConfigError, match="CONTEXTKIT_SHADOW_KEY"):
        config.shared_tier_key()
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "k" * 32)
    assert config.shared_tier_key() == b"k" * 32


def test_connector_json_is_bounded_in_nesting_and_size() -> None:
    with pytest.raises(ConnectorConfigError, match="nests deeper"):
        ConnectorConfig.from_json("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConnectorConfigError, match="over 1 MiB"):
        ConnectorConfig.from_json(json.dumps({"stats_path": "x" * (2 << 20)}))
    with pytest.raises(ConnectorConfigError, match="finite number"):
        ConnectorConfig.from_json('{"shared_url": "file:///tmp/x", "shared_deadline_s": 1e400}')


def test_the_environments_connector_json_is_bounded_too(monkeypatch) -> None:
    monkeypatch.setenv("CONTEXTKIT_CONNECTOR_CONFIG", "[" * 100_000 + "]" * 100_000)
    with pytest.raises(ConnectorConfigError, match="nests deeper"):
        ConnectorConfig.from_json("{}")


def test_the_pin_advice_names_a_wider_pools_own_size() -> None:
    """device_blocks counts the codec's blocks; an int8 pool holds fewer, so a quota of 33
    with pin_share 0.5 of device_blocks 128 needs its pool named to add up."""
    from integrations.vllm.config import ConnectorConfig, pin_advice

    config = ConnectorConfig.from_extra_config({"device_blocks": 128, "pin_share": 0.5},
                                               env={})
    plain = pin_advice(config, tenant="acme", needed=70, quota=64)
    assert "(pin_share=0.5 of device_blocks=128)" in plain
    wide = pin_advice(config, tenant="acme", needed=40, quota=33, pool_ratio=0.52)
    assert "of the 66 blocks of this pool" in wide and "1.92x their size" in wide
    # what it asks for still covers the need within the wider pool
    assert "device_blocks to 154" in wide  # ceil(40 / (0.5 * 0.52))
