"""The S3 client's retries, timeouts and pool come from the store config, and reach
the real botocore client; a bad value is a one-line error."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from contextkit.config import ConfigError, load_config
from shadow import S3Store, StoreConfig

pytest.importorskip("boto3")


def _client_config(config: StoreConfig) -> Any:
    store = S3Store("s3://bucket/prefix", config)
    return store.client.meta.config


def test_defaults_reach_the_botocore_client() -> None:
    cfg = _client_config(StoreConfig(region_name="us-east-1"))
    assert cfg.retries == {"mode": "standard", "total_max_attempts": 3}
    assert (cfg.connect_timeout, cfg.read_timeout, cfg.max_pool_connections) == (5.0, 60.0, 10)


def test_shadow_section_settings_reach_the_botocore_client(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[shadow]\nurl = "s3://bucket/prefix"\nregion_name = "eu-west-1"\n'
                    'retry_mode = "adaptive"\nmax_attempts = 7\nconnect_timeout_s = 2.5\n'
                    "read_timeout_s = 30\n")
    env = {"CONTEXTKIT_SHADOW_MAX_POOL_CONNECTIONS": "32"}
    shadow = load_config(path, env=env).shadow
    cfg = _client_config(shadow.store_config())
    assert cfg.retries == {"mode": "adaptive", "total_max_attempts": 7}
    assert (cfg.connect_timeout, cfg.read_timeout, cfg.max_pool_connections) == (2.5, 30, 32)
    assert cfg.region_name == "eu-west-1"


@pytest.mark.parametrize(("field", "value", "says"), [
    ("retry_mode", "fast", "retry_mode must be one of standard, adaptive, legacy"),
    ("max_attempts", 0, "max_attempts must be an integer >= 1"),
    ("connect_timeout_s", 0.0, "connect_timeout_s must be a number of seconds > 0"),
    ("read_timeout_s", -1.0, "read_timeout_s must be a number of seconds > 0"),
    ("max_pool_connections", 0, "max_pool_connections must be an integer >= 1"),
])
def test_a_bad_value_is_a_one_line_error(field: str, value: Any, says: str) -> None:
    with pytest.raises(ValueError) as exc:
        StoreConfig(**{field: value})
    assert says in str(exc.value) and "\n" not in str(exc.value)


def test_a_bad_value_in_the_configuration_names_its_source(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[shadow]\nretry_mode = "fast"\n')
    with pytest.raises(ConfigError) as exc:
        load_config(path, env={})
    message = str(exc.value)
    assert "retry_mode must be one of standard, adaptive, legacy" in message
    assert "c.toml" in message and "\n" not in message
