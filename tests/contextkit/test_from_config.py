"""The configuration reaches what the product builds: engine, pipeline, tier manager,
shadow and the CLI, identically from a file, the environment and code.

Real components throughout: the packaged SmolLM2 (loaded without calibration where the
test is about sizes and quotas: ~1 s instead of ~9 s), real shadow stores on disk and
over S3 (moto's HTTP server), the CLI's ``main``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from contextkit.config import ConfigError, load_config
from contextkit.engine.engine import Engine
from contextkit.loop.tiers import ContextTierManager, TierManagerConfig
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from gpu_cache.calibration import key_offset_digest
from gpu_cache.config import PinConfig

TOML = """
[cache]
num_device_blocks = 48
num_host_blocks = 24
eviction_policy = "lru"

[engine]
calibrate = false
residual_tokens = 32

[pins]
tenant_share = 0.5
idle_ttl_s = 120

[pipeline]
tenant = "acme"
reorder = false
volatility_alpha = 0.5

[tiers]
interval_s = 30

[tiers.thresholds]
promote = 0.7

[metrics]
enabled = false
"""

ENV = {
    "CONTEXTKIT_CACHE_NUM_DEVICE_BLOCKS": "48",
    "CONTEXTKIT_CACHE_NUM_HOST_BLOCKS": "24",
    "CONTEXTKIT_CACHE_EVICTION_POLICY": "lru",
    "CONTEXTKIT_ENGINE_CALIBRATE": "false",
    "CONTEXTKIT_ENGINE_RESIDUAL_TOKENS": "32",
    "CONTEXTKIT_PINS_TENANT_SHARE": "0.5",
    "CONTEXTKIT_PINS_IDLE_TTL_S": "120",
    "CONTEXTKIT_PIPELINE_TENANT": "acme",
    "CONTEXTKIT_PIPELINE_REORDER": "0",
    "CONTEXTKIT_PIPELINE_VOLATILITY_ALPHA": "0.5",
    "CONTEXTKIT_TIERS_INTERVAL_S": "30",
    "CONTEXTKIT_TIERS_THRESHOLDS__PROMOTE": "0.7",
    "CONTEXTKIT_METRICS_ENABLED": "off",
}

CODE: dict[str, Any] = {
    "cache": {"num_device_blocks": 48, "num_host_blocks": 24, "eviction_policy": "lru"},
    "engine": {"calibrate": False, "residual_tokens": 32},
    "pins": {"tenant_share": 0.5, "idle_ttl_s": 120.0},
    "pipeline": {"tenant": "acme", "reorder": False, "volatility_alpha": 0.5},
    "tiers": {"interval_s": 30.0, "thresholds": {"promote": 0.7}},
    "metrics": {"enabled": False},
}

PROMPT = ("[AXIOMS]\nTell the truth about what you checked.\n[/AXIOMS]\n"
          "[IDENTITY]\nYou are Atlas, the platform team's SRE assistant.\n[/IDENTITY]\n")


@pytest.fixture(autouse=True)
def _clean_environment(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A developer's CONTEXTKIT_* variables must not change what these tests see."""
    for var in [v for v in os.environ if v.startswith("CONTEXTKIT_")]:
        monkeypatch.delenv(var)
    yield


def _cache(pipeline: CacheAwareContextPipeline) -> Any:
    assert pipeline.engine is not None  # from_config always attaches one
    return pipeline.engine.cache


def _built(pipeline: CacheAwareContextPipeline, tiers: ContextTierManager) -> dict[str, Any]:
    """What the configuration decided in the objects it built."""
    engine = pipeline.engine
    assert engine is not None
    return {"cache": engine.cache.config, "identity": engine.identity,
            "residual_tokens": engine.residual_tokens, "sink_tokens": engine.sink_tokens,
            "kv_format": engine.kv_format, "engine_metrics": engine.metrics,
            "tenant": pipeline.tenant, "reorder": pipeline.reorder,
            "trailing_message": pipeline.trailing_message, "pin_stable": pipeline.pin_stable,
            "alpha": pipeline.alpha, "tiers": tiers.config}


def test_file_env_and_code_build_the_same_engine_pipeline_and_tier_manager(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "contextkit.toml"
    path.write_text(TOML)

    from_file = CacheAwareContextPipeline.from_config(config=path)
    tiers_file = ContextTierManager.from_config(_cache(from_file), path)

    with monkeypatch.context() as env:
        for var, value in ENV.items():
            env.setenv(var, value)
        from_env = CacheAwareContextPipeline.from_config()
        tiers_env = ContextTierManager.from_config(_cache(from_env))

    # Code: section tables as keywords; ``engine=`` as a dict is the engine section.
    from_code = CacheAwareContextPipeline.from_config(
        engine=CODE["engine"], cache=CODE["cache"], pins=CODE["pins"],
        pipeline=CODE["pipeline"], metrics=CODE["metrics"])
    tiers_code = ContextTierManager.from_config(_cache(from_code), tiers=CODE["tiers"])

    built = _built(from_file, tiers_file)
    assert built == _built(from_env, tiers_env) == _built(from_code, tiers_code)
    # ... and they are the configured values, not three copies of the defaults.
    cache = built["cache"]
    assert (cache.num_device_blocks, cache.num_host_blocks, cache.eviction_policy) == (
        48, 24, "lru")
    assert cache.pins == PinConfig(tenant_share=0.5, total_share=0.75, idle_ttl_s=120.0)
    assert built["identity"].key_offset_digest == key_offset_digest(None)  # calibrate off
    assert built["residual_tokens"] == 32 and built["engine_metrics"] is False
    assert (built["tenant"], built["reorder"], built["alpha"]) == ("acme", False, 0.5)
    assert built["tiers"] == TierManagerConfig(interval_s=30.0, thresholds=built[
        "tiers"].thresholds) and built["tiers"].thresholds.promote == 0.7
    assert tiers_file.thresholds.promote == 0.7

    # A call that names no tenant lands on the configured one, blocks and report alike.
    pipeline = from_env
    pipeline.build(PROMPT)
    result = pipeline.generate("Is checkout slow?", max_new_tokens=1)
    assert result.report.tenant == "acme" and result.report.prompt_tokens > 0
    assert pipeline.engine is not None
    assert pipeline.engine.cache.metadata.of_tenant("acme")
    assert not pipeline.engine.cache.metadata.of_tenant("default")


def test_conflicting_sources_resolve_file_then_env_then_code_in_built_objects(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cache:\n  num_device_blocks: 40\n  num_host_blocks: 40\n"
                    "  eviction_policy: lru\nengine:\n  calibrate: false\n"
                    "pins:\n  tenant_share: 0.25\npipeline:\n  tenant: from-file\n")
    monkeypatch.setenv("CONTEXTKIT_CONFIG", str(path))
    monkeypatch.setenv("CONTEXTKIT_CACHE_NUM_DEVICE_BLOCKS", "56")
    monkeypatch.setenv("CONTEXTKIT_PINS_TENANT_SHARE", "0.5")
    monkeypatch.setenv("CONTEXTKIT_PIPELINE_TENANT", "from-env")

    config = load_config()  # $CONTEXTKIT_CONFIG, then the environment
    pipeline = CacheAwareContextPipeline.from_config(
        config=config, pipeline={"tenant": "from-code"}, cache={"num_host_blocks": 16})
    assert pipeline.engine is not None
    cache = pipeline.engine.cache.config
    assert cache.num_device_blocks == 56           # env over file
    assert cache.num_host_blocks == 16             # code over file
    assert cache.eviction_policy == "lru"          # the file alone
    assert cache.pins.tenant_share == 0.5          # env over file
    assert pipeline.tenant == "from-code"          # code over env over file
    sources = config.with_overrides({"pipeline": {"tenant": "from-code"}}).sources
    assert sources["pipeline.tenant"] == "code"
    assert sources["cache.num_device_blocks"] == "env CONTEXTKIT_CACHE_NUM_DEVICE_BLOCKS"
    assert sources["cache.eviction_policy"] == f"file {path}"
    # Overriding in code is checked like every other source.
    with pytest.raises(ConfigError, match=r"pins: tenant_share must be in"):
        config.with_overrides({"pins": {"tenant_share": 3.0}})


def test_the_default_configuration_builds_the_packaged_model_as_from_pretrained(
        engine: Engine) -> None:
    built = Engine.from_config(cache={"num_device_blocks": 128, "num_host_blocks": 128})
    # Same model, tokenizer, format and (calibrated) key offsets: the same identity.
    assert built.identity == engine.identity
    assert built.cache.config == engine.cache.config
    assert built.model_id == engine.model_id == "SmolLM2-135M-Instruct"
    assert built.metrics is None  # metrics.enabled: the process default


@pytest.mark.parametrize("build", [
    lambda path: Engine.from_config(path),
    lambda path: CacheAwareContextPipeline.from_config(config=path),
    lambda path: ContextTierManager.from_config(None, path),
])
def test_an_unknown_key_in_a_file_is_refused_listing_the_known_keys(
        tmp_path: Path, build: Callable[[Path], object]) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[cache]\nnum_device_block = 64\n")
    with pytest.raises(ConfigError, match=r"unknown key 'cache\.num_device_block' \(file "
                       r".*typo\.toml\); known keys of \[cache\]: .*'num_device_blocks'") as info:
        build(path)
    assert "\n" not in str(info.value)


def test_from_config_refuses_what_is_not_a_configuration() -> None:
    with pytest.raises(ConfigError, match=r"config must be a contextkit\.config\.Config"):
        ContextTierManager.from_config(None, {"tiers": {}})
    with pytest.raises(ConfigError, match=r"unknown configuration section 'tier'"):
        ContextTierManager.from_config(None, tier={"interval_s": 1})


def _shadow_a_session(fresh: Callable[..., Engine], config_path: Path) -> str:
    """Serve one request and shadow the cache as the file's [shadow] says."""
    settings = load_config(config_path).shadow
    engine = fresh("tq4", 32, 32)
    engine.generate(engine.encode("The quick brown fox jumps over the lazy dog. " * 4),
                    max_new_tokens=1)
    shadow = settings.cache_shadow(engine.cache, autostart=False)
    try:
        assert shadow.shadow_now().num_blocks > 0
    finally:
        shadow.close()
    return str(shadow.session_id)


def test_the_shadow_section_opens_the_store_and_signs_with_its_key(
        tmp_path: Path, fresh: Callable[..., Engine],
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from contextkit.cli.commands import main
    from shadow import load_manifest

    store = tmp_path / "shadow"
    path = tmp_path / "contextkit.toml"
    path.write_text(f'[shadow]\nurl = "file://{store}"\nkey = "file-key"\n'
                    'session_id = "from-file"\n')
    assert _shadow_a_session(fresh, path) == "from-file"
    opened = load_config(path).shadow.open_store(create=False)
    try:
        assert load_manifest(opened, "from-file", key=b"file-key").authenticated
    finally:
        opened.close()

    # The CLI reads the same file: store and key reach `status` and `recover`.
    assert main(["status", "--config", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["store"] == f"file://{store}" and doc["auth"]["authenticated"] is True
    assert [(s["session_id"], s["authenticated"]) for s in doc["sessions"]] == [
        ("from-file", True)]
    assert main(["recover", "--config", str(path), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["sessions"] == 1 and doc["authenticated"] is True and not doc["errors"]
    assert "CONTEXTKIT_SHADOW_KEY" not in os.environ  # exported for the command only
    # An option on the command line wins over the file.
    other = tmp_path / "other"
    other.mkdir()
    assert main(["status", "--config", str(path), "--store", f"file://{other}", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["store"] == f"file://{other}" and doc["sessions"] == []

    # The historical variables still work without any file, and win over one.
    monkeypatch.setenv("CONTEXTKIT_SHADOW_URL", f"file://{store}")
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "file-key")
    assert main(["status", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [s["session_id"] for s in doc["sessions"]] == ["from-file"]
    assert doc["auth"]["authenticated"] is True
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "another-key")
    assert main(["status", "--config", str(path), "--json"]) == 1  # env key wins: MAC fails
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert "from-file" in json.dumps(doc["sessions"]) and doc["sessions"][0]["error"]


def test_a_configured_store_that_does_not_exist_is_one_line_naming_the_file(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from contextkit.cli.commands import main

    path = tmp_path / "c.toml"
    path.write_text(f'[shadow]\nurl = "file://{tmp_path / "nope"}"\n')
    for argv in (["status", "--config", str(path)], ["recover", "--config", str(path)]):
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "Traceback" not in err
        assert f"no shadow store directory at {tmp_path / 'nope'}" in err
        assert f"shadow.url (file {path})" in err
    bad = tmp_path / "bad.toml"
    bad.write_text("[shadow]\nurll = 'file:///x'\n")
    assert main(["status", "--config", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "known keys of [shadow]" in err and "'url'" in err


BUCKET = "contextkit-config"


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    """A real S3 endpoint over HTTP: moto's threaded server on 127.0.0.1."""
    import boto3
    import moto.server as moto_server

    mp = pytest.MonkeyPatch()
    for var, value in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                       ("AWS_DEFAULT_REGION", "us-east-1")):
        mp.setenv(var, value)
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()
    mp.undo()


def test_the_s3_endpoint_of_the_file_reaches_the_shadow_and_status(
        tmp_path: Path, fresh: Callable[..., Engine], s3_endpoint: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    from contextkit.cli.commands import main

    path = tmp_path / "contextkit.yaml"
    path.write_text(f"shadow:\n  url: s3://{BUCKET}/prod\n  endpoint_url: {s3_endpoint}\n"
                    "  key: s3-key\n  session_id: on-s3\n")
    assert _shadow_a_session(fresh, path) == "on-s3"
    assert main(["status", "--config", str(path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["store"] == f"s3://{BUCKET}/prod"
    assert [(s["session_id"], s["authenticated"]) for s in doc["sessions"]] == [("on-s3", True)]
    # The file's key signs the session, so `recover` takes it from s3.
    assert main(["recover", "--config", str(path), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["sessions"] == 1 and not doc["errors"]

    # Unsigned on s3: refused, unless the file allows it (recover --allow-unauthenticated).
    unsigned = tmp_path / "unsigned.yaml"
    unsigned.write_text(f"shadow:\n  url: s3://{BUCKET}/open\n  endpoint_url: {s3_endpoint}\n"
                        "  session_id: unsigned\n")
    assert _shadow_a_session(fresh, unsigned) == "unsigned"
    assert main(["recover", "--config", str(unsigned), "--json", "--no-progress"]) == 1
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["sessions"] == 0 and "unsigned" in doc["errors"]
    allowing = tmp_path / "allowing.yaml"
    allowing.write_text(unsigned.read_text() + "  allow_unauthenticated: true\n")
    assert main(["recover", "--config", str(allowing), "--json", "--no-progress"]) == 0
    doc = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert doc["sessions"] == 1 and not doc["errors"] and doc["authenticated"] is False


def test_cache_dir_from_a_file_is_where_the_packaged_model_is_read(tmp_path: Path) -> None:
    """``[cache] dir`` reaches Engine.from_config (it used to be read only from
    $CONTEXTKIT_CACHE_DIR): a damaged conversion under that directory is what fails."""
    from contextkit.engine import models

    converted = models._converted_dir()  # the conversion the session already made
    models._convert_once()
    mine = models._converted_dir(tmp_path / "ck")
    mine.mkdir(parents=True)
    for item in converted.iterdir():
        (mine / item.name).symlink_to(item)
    (mine / "config.json").unlink()
    (mine / "config.json").write_text("{ not json")
    models.load_tokenizer.cache_clear()
    config_file = tmp_path / "contextkit.toml"
    config_file.write_text(f'[cache]\ndir = "{tmp_path / "ck"}"\n')
    try:
        with pytest.raises(OSError, match="not a valid JSON") as failure:
            Engine.from_config(str(config_file))
        assert str(mine) in str(failure.value)
        (mine / "config.json").unlink()
        (mine / "config.json").symlink_to(converted / "config.json")
        engine = Engine.from_config(str(config_file), cache={"num_device_blocks": 32,
                                                             "num_host_blocks": 16})
        assert engine.generate(engine.encode("Hi"), max_new_tokens=1).token_ids
    finally:
        models.load_tokenizer.cache_clear()
