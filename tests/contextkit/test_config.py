"""One configuration model: file, environment and code give the same effective config."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from contextkit.config import CONFIG_ENV, ConfigError, load_config
from contextkit.loop.tiers import ContextTier

TOML = """
[cache]
num_device_blocks = 96
eviction_policy = "lru"

[pins]
tenant_share = 0.2
idle_ttl_s = 120

[shadow]
url = "s3://bucket/prefix"
endpoint_url = "http://127.0.0.1:5000"
allow_unauthenticated = true

[tiers]
spilled_line_tier = "archive"

[tiers.thresholds]
promote = 0.7
"""

YAML = """
cache:
  num_device_blocks: 96
  eviction_policy: lru
pins:
  tenant_share: 0.2
  idle_ttl_s: 120
shadow:
  url: s3://bucket/prefix
  endpoint_url: http://127.0.0.1:5000
  allow_unauthenticated: true
tiers:
  spilled_line_tier: archive
  thresholds:
    promote: 0.7
"""

ENV = {
    "CONTEXTKIT_CACHE_NUM_DEVICE_BLOCKS": "96",
    "CONTEXTKIT_CACHE_EVICTION_POLICY": "lru",
    "CONTEXTKIT_PINS_TENANT_SHARE": "0.2",
    "CONTEXTKIT_PINS_IDLE_TTL_S": "120",
    "CONTEXTKIT_SHADOW_URL": "s3://bucket/prefix",
    "CONTEXTKIT_SHADOW_ENDPOINT_URL": "http://127.0.0.1:5000",
    "CONTEXTKIT_SHADOW_ALLOW_UNAUTHENTICATED": "yes",
    "CONTEXTKIT_TIERS_SPILLED_LINE_TIER": "ARCHIVE",
    "CONTEXTKIT_TIERS_THRESHOLDS__PROMOTE": "0.7",
}

CODE = {
    "cache": {"num_device_blocks": 96, "eviction_policy": "lru"},
    "pins": {"tenant_share": 0.2, "idle_ttl_s": 120},
    "shadow": {"url": "s3://bucket/prefix", "endpoint_url": "http://127.0.0.1:5000",
               "allow_unauthenticated": True},
    "tiers": {"spilled_line_tier": "archive", "thresholds": {"promote": 0.7}},
}


def _values(config: object) -> dict[str, object]:
    return {key: value for key, value, _ in config.items()}  # type: ignore[attr-defined]


def test_file_env_and_code_give_the_same_effective_config(tmp_path: Path) -> None:
    toml = tmp_path / "contextkit.toml"
    toml.write_text(TOML)
    yaml = tmp_path / "contextkit.yaml"
    yaml.write_text(YAML)
    from_toml = load_config(toml, env={})
    from_yaml = load_config(yaml, env={})
    from_env = load_config(env=ENV)
    from_code = load_config(env={}, overrides=CODE)
    default = load_config(env={})
    assert _values(from_toml) == _values(from_yaml) == _values(from_env) == _values(from_code)
    assert _values(from_toml) != _values(default)
    # The values are typed, and they reach the component configs.
    assert from_env.cache.num_device_blocks == 96
    assert from_env.pins.idle_ttl_s == 120.0
    assert from_env.tiers.spilled_line_tier is ContextTier.ARCHIVE
    assert from_env.tiers.thresholds.promote == 0.7
    assert from_env.cache.cache_config(from_env.pins).pins.tenant_share == 0.2
    assert from_env.shadow.store_config().endpoint_url == "http://127.0.0.1:5000"
    assert from_env.shadow.shadow_config().allow_unauthenticated is True
    # Each value says where it came from.
    assert from_toml.sources["pins.tenant_share"] == f"file {toml}"
    assert from_env.sources["pins.tenant_share"] == "env CONTEXTKIT_PINS_TENANT_SHARE"
    assert from_code.sources["pins.tenant_share"] == "code"
    assert "pins.total_share" not in from_code.sources  # a default


def test_conflicts_resolve_file_then_env_then_code(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text("[pins]\ntenant_share = 0.1\ntotal_share = 0.5\n"
                    "[cache]\nnum_host_blocks = 10\n")
    env = {CONFIG_ENV: str(toml), "CONTEXTKIT_PINS_TENANT_SHARE": "0.2",
           "CONTEXTKIT_PINS_TOTAL_SHARE": "0.6"}
    config = load_config(env=env, overrides={"pins": {"total_share": 0.7}})
    assert config.cache.num_host_blocks == 10          # only the file sets it
    assert config.pins.tenant_share == 0.2             # env over file
    assert config.pins.total_share == 0.7              # code over env over file
    assert config.sources["cache.num_host_blocks"] == f"file {toml}"
    assert config.sources["pins.total_share"] == "code"


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"env": {"CONTEXTKIT_SHADOW_URLL": "file:///x"}}, r"shadow\.urll.*known keys.*'url'"),
    ({"env": {"CONTEXTKIT_NOPE_X": "1"}}, r"\$CONTEXTKIT_NOPE_X.*sections"),
    ({"env": {}, "overrides": {"pins": {"share": 0.1}}},
     r"unknown key 'pins\.share'.*tenant_share"),
    ({"env": {}, "overrides": {"pin": {}}}, r"unknown configuration section 'pin'"),
    ({"env": {"CONTEXTKIT_PINS_TENANT_SHARE": "lots"}}, r"pins\.tenant_share.*expected float"),
    ({"env": {"CONTEXTKIT_PINS_TENANT_SHARE": "2"}}, r"pins: tenant_share must be in \(0, 1\]"),
    ({"env": {}, "overrides": {"cache": {"num_device_blocks": "96"}}}, r"expected a number"),
    ({"env": {}, "overrides": {"engine": {"calibrate": "maybe"}}}, r"expected true or false"),
    ({"env": {}, "overrides": {"pipeline": {"tenant": "a\nb"}}}, r"invalid tenant"),
    ({"env": {}, "overrides": {"tiers": {"spilled_line_tier": "attic"}}}, r"expected one of"),
    ({"env": {CONFIG_ENV: "/nonexistent/contextkit.toml"}}, r"does not exist"),
])
def test_bad_configuration_is_one_clear_line(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match) as info:
        load_config(**kwargs)  # type: ignore[arg-type]
    assert "\n" not in str(info.value)


def test_unparsable_file_names_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[shadow\nurl = 1\n")
    with pytest.raises(ConfigError, match=r"cannot parse configuration file .*bad\.toml"):
        load_config(bad, env={})


def test_describe_masks_the_key_and_names_sources() -> None:
    config = load_config(env={"CONTEXTKIT_SHADOW_KEY": "s3cret"})
    text = config.describe()
    assert "s3cret" not in text and "s3cret" not in json.dumps(config.as_dict())
    assert 'shadow.key' in text and '"***"  (env CONTEXTKIT_SHADOW_KEY)' in text
    assert config.shadow.key == "s3cret"
    assert config.shadow.shadow_config().auth_key == "s3cret"


def test_connector_config_reads_the_same_sources() -> None:
    from integrations.vllm.config import ConnectorConfig, ConnectorConfigError

    env = {"CONTEXTKIT_CONNECTOR_DEVICE_BLOCKS": "8",
           "CONTEXTKIT_CONNECTOR_CONFIG": '{"codec": "native", "host_blocks": 5}'}
    config = ConnectorConfig.from_extra_config({"host_blocks": 10}, env=env)
    assert (config.device_blocks, config.codec, config.host_blocks) == (8, "native", 10)
    with pytest.raises(ConnectorConfigError, match="known keys"):
        ConnectorConfig.from_extra_config({"shadow_ulr": "file:///x"}, env={})
    with pytest.raises(ConnectorConfigError, match=r"CONTEXTKIT_CONNECTOR_HOST_BLOCKS"):
        ConnectorConfig.from_extra_config({}, env={"CONTEXTKIT_CONNECTOR_HOST_BLOCKS": "many"})


def test_the_connectors_json_variable_wins_over_its_per_key_variables() -> None:
    """docs/vllm.md: per-key variables, then CONTEXTKIT_CONNECTOR_CONFIG, later winning. A
    leftover SHADOW_URL export must not redirect recovery to another shadow."""
    from integrations.vllm.config import ConnectorConfig

    env = {"CONTEXTKIT_CONNECTOR_SHADOW_URL": "file:///old",
           "CONTEXTKIT_CONNECTOR_HOST_BLOCKS": "7",
           "CONTEXTKIT_CONNECTOR_CONFIG": '{"shadow_url": "file:///configured"}'}
    config = ConnectorConfig.from_extra_config({}, env=env)
    assert config.shadow_url == "file:///configured"
    assert config.host_blocks == 7  # a key the JSON does not set still comes through
    assert ConnectorConfig.from_extra_config({"shadow_url": "file:///flag"},
                                             env=env).shadow_url == "file:///flag"


def test_a_typo_in_the_connector_json_is_an_unknown_key_with_a_suggestion() -> None:
    from integrations.vllm.config import ConnectorConfig, ConnectorConfigError

    with pytest.raises(ConnectorConfigError,
                       match=r"unknown key 'connector.shadow_ulr' "
                             r"\(\$CONTEXTKIT_CONNECTOR_CONFIG\) \(did you mean 'shadow_url'\?\)"):
        ConnectorConfig.from_extra_config(
            {}, env={"CONTEXTKIT_CONNECTOR_CONFIG": '{"shadow_ulr": "file:///x"}'})
    with pytest.raises(ConnectorConfigError, match=r"did you mean 'block_size'"):
        ConnectorConfig.from_extra_config({}, env={"CONTEXTKIT_CONNECTOR_BLOCK_SZE": "32"})


def test_config_show_prints_sources_and_fails_in_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from contextkit.cli.commands import main

    path = tmp_path / "c.yaml"
    path.write_text("pins:\n  tenant_share: 0.5\n")
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "hush")
    assert main(["config", "show", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pins.tenant_share" in out and f"0.5  (file {path})" in out
    assert "hush" not in out
    assert main(["config", "show", "--json", "--config", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["pins.tenant_share"] == {"value": 0.5, "source": f"file {path}"}
    monkeypatch.setenv("CONTEXTKIT_PINS_TENANT_SHARE", "half")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "CONTEXTKIT_PINS_TENANT_SHARE" in err
    assert "Traceback" not in err


# ------------------------------------------------- issue 33, item 8: ranges checked at load
@pytest.mark.parametrize(("env", "setting"), [
    ({"CONTEXTKIT_TIERS_INTERVAL_S": "nan"}, "tiers.interval_s"),
    ({"CONTEXTKIT_TIERS_INTERVAL_S": "inf"}, "tiers.interval_s"),
    ({"CONTEXTKIT_SHADOW_INTERVAL_SECONDS": "nan"}, "shadow.interval_seconds"),
    ({"CONTEXTKIT_SHADOW_UPLOAD_ABORT_AFTER_SECONDS": "nan"},
     "shadow.upload_abort_after_seconds"),
    ({"CONTEXTKIT_TIERS_MISFIRE_GRACE_S": "-1"}, "tiers.misfire_grace_s"),
    ({"CONTEXTKIT_PINS_IDLE_TTL_S": "-inf"}, "pins.idle_ttl_s"),
    ({"CONTEXTKIT_TIERS_THRESHOLDS__PROMOTE": "nan"}, "tiers.thresholds.promote"),
], ids=lambda v: v if isinstance(v, str) else next(iter(v.values())))
def test_non_finite_and_negative_values_are_refused_at_load_naming_setting_and_source(
        env: dict[str, str], setting: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(env=env)
    message = str(info.value)
    assert setting in message and next(iter(env)) in message and "\n" not in message


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -0.5])
def test_shadow_intervals_are_checked_in_code_too(value: float) -> None:
    with pytest.raises(ConfigError, match=r"shadow\.interval_seconds.*\(code\)"):
        load_config(env={}, overrides={"shadow": {"interval_seconds": value}})


def test_a_section_check_names_the_source_of_the_value(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("[shadow]\ninterval_seconds = 0\n")
    with pytest.raises(ConfigError, match=rf"shadow\.interval_seconds.*file {path}"):
        load_config(path, env={})


def test_a_non_utf8_config_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b"[shadow]\nsession_id = \"caf\xe9\"\n")
    with pytest.raises(ConfigError, match=rf"{path}.*UTF-8"):
        load_config(path, env={})


def test_a_non_utf8_key_variable_names_the_variable() -> None:
    import os

    raw = os.fsdecode(b"k\xff\xfe-key")  # what Python makes of non-UTF-8 environment bytes
    with pytest.raises(ConfigError, match=r"CONTEXTKIT_SHADOW_KEY.*UTF-8"):
        load_config(env={"CONTEXTKIT_SHADOW_KEY": raw})


def test_a_non_utf8_key_variable_read_by_the_shadow_names_the_variable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from shadow.auth import resolve_key

    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", os.fsdecode(b"k\xff\xfe-key"))
    with pytest.raises(ValueError, match=r"CONTEXTKIT_SHADOW_KEY.*UTF-8"):
        resolve_key()
