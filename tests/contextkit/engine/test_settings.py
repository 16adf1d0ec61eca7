"""Engine settings: one dataclass each (EngineSettings, CacheSettings), checked once.

Bad values are refused at construction with one line that names the field and says
what to pass (issue 53 item 9): NaN, infinities, non-integers and bools for integer
fields, and values out of range.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from contextkit.config import CacheSettings, EngineSettings, load_config

BAD_ENGINE = [
    ("prefill_chunk", math.nan), ("prefill_chunk", math.inf), ("prefill_chunk", 1.5),
    ("prefill_chunk", 64.0), ("prefill_chunk", True), ("prefill_chunk", "64"),
    ("prefill_chunk", 0),
    ("residual_tokens", -1), ("residual_tokens", math.nan), ("residual_tokens", False),
    ("sink_tokens", -16), ("sink_tokens", 16.5), ("sink_tokens", math.nan),
    ("max_positions", math.nan), ("max_positions", math.inf), ("max_positions", 0),
    ("max_positions", 1024.0), ("max_positions", True),
    ("chunk_repair_ratio", math.nan), ("chunk_repair_ratio", math.inf),
    ("chunk_repair_ratio", 1.5), ("chunk_repair_ratio", True), ("chunk_repair_ratio", "0.1"),
    ("chunk_max_hops", math.nan), ("chunk_max_hops", 1.5), ("chunk_max_hops", -1),
    ("calibrate", "yes"), ("chunk_reuse", 1), ("chunk_edits", None),
    ("kv_format", "fp8"), ("weight_format", "int4"), ("chunk_repair_rule", "random"),
    ("chunk_layers", 3), ("model", 3),
]

BAD_CACHE = [
    ("block_size", 0), ("block_size", math.nan), ("block_size", 16.0), ("block_size", True),
    ("num_device_blocks", math.nan), ("num_device_blocks", 0), ("num_device_blocks", 2.5),
    ("num_host_blocks", -1), ("num_host_blocks", math.inf), ("num_host_blocks", False),
    ("eviction_policy", "fifo"),
]


def _one_line_naming(info: pytest.ExceptionInfo[ValueError], field: str) -> None:
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{field} must be"), message


@pytest.mark.parametrize(("field", "value"), BAD_ENGINE)
def test_engine_settings_refuse_a_bad_value_in_one_line(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        EngineSettings(**{field: value})
    _one_line_naming(info, field)


@pytest.mark.parametrize(("field", "value"), BAD_CACHE)
def test_cache_settings_refuse_a_bad_value_in_one_line(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as info:
        CacheSettings(**{field: value})
    _one_line_naming(info, field)


def test_a_refusal_says_what_to_pass() -> None:
    with pytest.raises(ValueError, match=r"^prefill_chunk must be an integer >= 1.*got nan"):
        EngineSettings(prefill_chunk=math.nan)
    with pytest.raises(ValueError, match=r"^max_positions must be an integer >= 1 or None"):
        EngineSettings(max_positions=math.nan)
    with pytest.raises(ValueError, match=r"^block_size must be an integer >= 1.*got 0"):
        CacheSettings(block_size=0)


def test_good_values_are_kept() -> None:
    s = EngineSettings(prefill_chunk=37, residual_tokens=0, sink_tokens=0, max_positions=40,
                       chunk_repair_ratio=1, chunk_max_hops=0)
    assert (s.prefill_chunk, s.max_positions, s.sink_tokens) == (37, 40, 0)
    assert EngineSettings().max_positions is None
    assert CacheSettings(block_size=32, num_host_blocks=0).block_size == 32


def test_max_positions_is_a_configuration_key() -> None:
    config = load_config(env={"CONTEXTKIT_ENGINE_MAX_POSITIONS": "16500"})
    assert config.engine.max_positions == 16500


# ---------------------------------------------------------------- through the engine
@pytest.mark.parametrize(("field", "value"), [
    ("prefill_chunk", math.nan), ("max_positions", math.nan), ("block_size", 0),
    ("num_device_blocks", math.nan), ("residual_tokens", 2.5)])
def test_the_engine_refuses_what_its_settings_refuse(engine: Any, field: str,
                                                     value: Any) -> None:
    from contextkit.engine.engine import Engine

    sizes: dict[str, Any] = {"num_device_blocks": 8, "num_host_blocks": 8, field: value}
    with pytest.raises(ValueError) as info:
        Engine(engine.model.hf, engine.tokenizer, kv_format="native", **sizes)
    _one_line_naming(info, field)
    with pytest.raises(ValueError) as info:
        engine.sibling("native", **sizes)
    _one_line_naming(info, field)


def test_an_unknown_keyword_is_a_type_error_naming_the_known_ones(engine: Any) -> None:
    with pytest.raises(TypeError, match=r"unknown engine setting 'prefil_chunk'.*"
                                        r"prefill_chunk.*num_device_blocks"):
        engine.sibling("native", prefil_chunk=64)


def test_the_engine_keeps_its_settings_and_a_sibling_replaces_them(engine: Any) -> None:
    import dataclasses

    from contextkit.engine.chunks import ChunkReuse
    from contextkit.engine.engine import Engine

    base = Engine(engine.model.hf, engine.tokenizer, EngineSettings(
        kv_format="native", prefill_chunk=37, residual_tokens=0, max_positions=400),
        num_device_blocks=8, num_host_blocks=4, eviction_policy="lru")
    assert base.settings == EngineSettings(kv_format="native", prefill_chunk=37,
                                           residual_tokens=0, max_positions=400)
    assert (base.kv_format, base.prefill_chunk, base.residual_tokens) == ("native", 37, 0)
    assert base.max_positions == 400 and base.sink_tokens == 16  # None: one block
    assert base.cache_settings.num_host_blocks == 4
    assert base.cache.config.eviction_policy == "lru"
    # a sibling is the same settings with the keywords replaced, over the same model
    twin = base.sibling(num_device_blocks=16, chunk_reuse=False)
    assert twin.settings == dataclasses.replace(base.settings, chunk_reuse=False)
    assert twin.cache_settings == dataclasses.replace(base.cache_settings,
                                                      num_device_blocks=16)
    assert twin.model is base.model and twin.cache is not base.cache
    assert not twin.chunk_reuse.enabled and base.chunk_reuse.enabled
    # a ChunkReuse keeps its finer knobs, and the settings say what they can of it
    fine = base.sibling(chunk_reuse=ChunkReuse(repair_ratio=0.5, min_tokens=3))
    assert fine.chunk_reuse.min_tokens == 3 and fine.chunk_reuse.repair_ratio == 0.5
    assert fine.settings.chunk_repair_ratio == 0.5
    again = fine.sibling(chunk_edits=False)
    assert again.chunk_reuse.min_tokens == 3 and not again.chunk_reuse.edits
    assert again.chunk_reuse == dataclasses.replace(fine.chunk_reuse, edits=False)
    assert base.sibling(chunk_reuse={"max_hops": 2}).chunk_reuse.max_hops == 2
