"""The connector's precision policy: per-block format rules, overrides, refusals (no vLLM)."""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

import pytest

from gpu_cache import CacheIdentity, hash_token_blocks
from integrations.vllm import ConnectorConfig, ConnectorConfigError, kv_transfer_config
from integrations.vllm.planning import (
    RequestPlanner,
    StepRequest,
    WorkerReport,
    semantic_params,
)
from integrations.vllm.precision import (
    DEFAULT_POLICY,
    FORMATS,
    POLICY_KEYS,
    BlockLabel,
    PrecisionError,
    PrecisionPolicy,
    policy_for_codec,
    vs_fp16,
)

BS = 4
IDENTITY = CacheIdentity(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS)
TOKENS = list(range(100, 124))  # 24 tokens: 6 full blocks

#: a policy where every rule gives a distinct format, so the winner is visible
RULES = PrecisionPolicy(default="tq4", sink_blocks=1, sink_format="native",
                        layers={"axioms": "fp16"}, pinned="int8",
                        importance=((0.9, "native"), (0.6, "int8")))


def test_formats_are_gpu_caches() -> None:
    # precision.py carries the names itself (it must not import gpu_cache before vLLM
    # starts its engine); they must stay the codec's
    from gpu_cache.formats import FORMATS as CODEC_FORMATS

    assert FORMATS == CODEC_FORMATS


@pytest.mark.parametrize("block_index, label, expected", [
    (0, BlockLabel("axioms", 1.0, True), "native"),      # the sink wins over every label
    (1, BlockLabel("axioms", 0.1, True), "fp16"),        # then the layer rule
    (1, BlockLabel("rules", 0.95, True), "int8"),        # then pinned, over importance
    (1, BlockLabel("memories", 0.95), "native"),         # then the first threshold met
    (1, BlockLabel("memories", 0.9), "native"),          # thresholds are inclusive
    (1, BlockLabel("memories", 0.7), "int8"),
    (1, BlockLabel("memories", 0.59), "tq4"),            # then the default
    (7, BlockLabel("user_turn"), "tq4"),
], ids=["sink", "layer", "pinned", "importance-high", "importance-edge", "importance-low",
        "default", "default-late"])
def test_rules_apply_in_order(block_index: int, label: BlockLabel, expected: str) -> None:
    assert RULES.format_for(block_index, label) == expected


def test_no_sink_pinned_or_importance_rule_when_unset() -> None:
    policy = PrecisionPolicy(default="int8", sink_blocks=0)
    assert policy.format_for(0, BlockLabel("axioms", 1.0, True)) == "int8"
    wide = PrecisionPolicy(sink_blocks=3)
    assert [wide.format_for(b, BlockLabel("memories")) for b in range(5)] == [
        "fp16", "fp16", "fp16", "tq4", "tq4"]
    assert RULES.formats() == {"tq4", "int8", "fp16", "native"}
    assert PrecisionPolicy(sink_blocks=0).formats() == {"tq4"}


def test_from_mapping_replaces_the_given_keys_only() -> None:
    base = RULES
    merged = PrecisionPolicy.from_mapping({"default": "int8", "layers": {"rules": "fp16"}},
                                          base=base)
    assert merged.default == "int8"
    assert dict(merged.layers) == {"rules": "fp16"}  # a key replaces the whole value
    assert (merged.sink_format, merged.pinned, merged.importance) == (
        "native", "int8", ((0.9, "native"), (0.6, "int8")))
    assert PrecisionPolicy.from_mapping(None, base=base) is base
    assert PrecisionPolicy.from_mapping({}) == DEFAULT_POLICY
    # importance as {threshold: format} (JSON keys are text): highest threshold first
    by_map = PrecisionPolicy.from_mapping({"importance": {"0.5": "int8", "0.8": "fp16"}})
    assert by_map.importance == ((0.8, "fp16"), (0.5, "int8"))


def test_to_dict_round_trips_through_json() -> None:
    doc = json.loads(json.dumps(RULES.to_dict()))
    assert sorted(doc) == sorted(POLICY_KEYS)
    assert PrecisionPolicy.from_mapping(doc, base=PrecisionPolicy(default="native")) == RULES
    assert hash(PrecisionPolicy.from_mapping(doc)) == hash(RULES)  # usable as a dict key


_FORMATS_HINT = "write one of tq4, k5v4, int8, fp16, native"


@pytest.mark.parametrize("data, message", [
    ({"sink": 2}, "unknown precision key 'sink'; known keys: default, sink_blocks, "
                  "sink_format, layers, pinned, importance, key_offsets, max_vs_fp16, room_format"),
    ({"default": "tq3"}, f"precision.default: unknown block format 'tq3'; {_FORMATS_HINT}"),
    ({"sink_format": "fp8"}, f"precision.sink_format: unknown block format 'fp8'; "
                             f"{_FORMATS_HINT}"),
    ({"pinned": 8}, f"precision.pinned: unknown block format 8; {_FORMATS_HINT}"),
    ({"layers": {"axioms": "FP16"}},
     f"precision.layers.axioms: unknown block format 'FP16'; {_FORMATS_HINT}"),
    ({"layers": ["axioms"]}, "precision.layers: write a mapping of source layer to format "
                             "(e.g. {\"axioms\": \"fp16\"}), got ['axioms']"),
    ({"importance": [[0.5, "tq2"]]},
     f"precision.importance[0]: unknown block format 'tq2'; {_FORMATS_HINT}"),
    ({"importance": [[1.5, "int8"]]},
     "precision.importance[0]: an importance threshold is a number in [0, 1], got 1.5"),
    ({"importance": [0.5]}, "precision.importance[0]: write a [min importance, format] "
                            "pair, got 0.5"),
    ({"importance": "int8"}, "precision.importance: write a list of [min importance, "
                             "format] pairs (e.g. [[0.8, \"int8\"]]), got 'int8'"),
    ({"importance": [[0.3, "tq4"], [0.8, "int8"]]},
     "precision.importance: rules are tried in order, so thresholds must decrease (a "
     "later rule 0.8 after 0.3 never matches); got [0.3, 0.8]"),
    ({"sink_blocks": -1}, "precision.sink_blocks: write an integer >= 0, got -1"),
    ({"sink_blocks": "1"}, "precision.sink_blocks: write an integer >= 0, got '1'"),
    ({"key_offsets": "yes"}, "precision.key_offsets: write true or false, got 'yes'"),
    ("tq4", "precision: write a mapping of policy keys (e.g. {\"default\": \"tq4\"}), "
            "got 'tq4'"),
], ids=lambda v: "" if isinstance(v, str) and len(v) > 20 else json.dumps(v))
def test_refusals_are_one_line_and_say_what_to_write(data: Any, message: str) -> None:
    with pytest.raises(PrecisionError) as info:
        PrecisionPolicy.from_mapping(data)
    assert str(info.value) == message
    assert isinstance(info.value, ValueError)


def test_the_constructor_checks_as_from_mapping_does() -> None:
    with pytest.raises(PrecisionError, match=r"precision\.default: unknown block format"):
        PrecisionPolicy(default="int4")
    with pytest.raises(AttributeError):
        RULES.default = "native"  # type: ignore[misc]


def test_policy_for_codec() -> None:
    assert policy_for_codec("tq4") is DEFAULT_POLICY
    native = policy_for_codec("native")  # the old exact check mode: every block native
    assert (native.default, native.sink_blocks, native.key_offsets) == ("native", 0, False)
    assert native.formats() == {"native"}
    int8 = policy_for_codec("int8")
    assert int8.default == "int8" and int8.sink_blocks == DEFAULT_POLICY.sink_blocks
    with pytest.raises(PrecisionError, match="codec: unknown block format 'tq3'"):
        policy_for_codec("tq3")


# --------------------------------------------------------------------------- config
def test_connector_config_carries_the_policy() -> None:
    assert ConnectorConfig().policy == DEFAULT_POLICY
    assert ConnectorConfig(codec="native").policy == policy_for_codec("native")
    config = ConnectorConfig(codec="fp16", precision={"layers": {"axioms": "native"}})
    assert config.policy.default == "fp16"  # the codec's, no precision.default given
    assert dict(config.policy.layers) == {"axioms": "native"}
    assert ConnectorConfig(codec="int8", precision={"default": "tq4"}).policy.default == "tq4"
    hash(config)  # still a hashable frozen config


def test_connector_config_json_round_trip() -> None:
    config = ConnectorConfig(block_size=16, codec="tq4", precision={
        "sink_blocks": 2, "layers": {"axioms": "fp16"}, "pinned": "int8",
        "importance": [[0.8, "int8"]], "key_offsets": False})
    doc = json.loads(json.dumps(kv_transfer_config(config)))
    back = ConnectorConfig.from_json(json.dumps(doc))
    assert back == config and back.policy == config.policy
    assert back.policy.format_for(1, BlockLabel("memories", 0.85)) == "fp16"  # sink
    assert back.policy.format_for(2, BlockLabel("memories", 0.85)) == "int8"
    assert back.policy.key_offsets is False


def test_connector_config_reads_precision_from_the_environment() -> None:
    env = {"CONTEXTKIT_CONNECTOR_PRECISION": '{"default": "int8", "sink_blocks": 0}'}
    config = ConnectorConfig.from_extra_config({}, env=env)
    assert (config.policy.default, config.policy.sink_blocks) == ("int8", 0)
    # kv_connector_extra_config wins over the environment, key for key of the section
    config = ConnectorConfig.from_extra_config({"precision": {"pinned": "fp16"}}, env=env)
    assert config.policy.pinned == "fp16" and config.policy.default == "k5v4"


def test_connector_config_reads_precision_from_a_config_file(tmp_path: Any) -> None:
    from contextkit.config import load_config

    path = tmp_path / "contextkit.toml"
    path.write_text('[connector]\ncodec = "int8"\n[connector.precision]\nsink_blocks = 2\n'
                    'importance = [[0.8, "fp16"]]\n[connector.precision.layers]\n'
                    'axioms = "native"\n')
    policy = load_config(path, env={}).connector.policy
    # the keys it sets over the default policy with the codec as its default format
    assert policy == dataclasses.replace(DEFAULT_POLICY, default="int8", sink_blocks=2,
                                         layers={"axioms": "native"},
                                         importance=((0.8, "fp16"),))


@pytest.mark.parametrize("extra, message", [
    ({"precision": {"defualt": "tq4"}}, "connector: unknown precision key 'defualt'; known "
     "keys: default, sink_blocks, sink_format, layers, pinned, importance, key_offsets, "
     "max_vs_fp16, room_format"),
    ({"precision": {"layers": {"axioms": "fp8"}}}, "connector: precision.layers.axioms: "
     f"unknown block format 'fp8'; {_FORMATS_HINT}"),
    ({"precision": "int8"}, "connector: precision must be a JSON object (e.g. "
     "{\"default\": \"tq4\"}), got 'int8'"),
    ({"codec": "tq3"}, "connector: codec must be one of tq4, k5v4, int8, fp16, native, got 'tq3'"),
], ids=["key", "format", "not-a-mapping", "codec"])
def test_connector_config_refusals(extra: dict[str, Any], message: str) -> None:
    with pytest.raises(ConnectorConfigError) as info:
        ConnectorConfig.from_extra_config(extra, env={})
    # (the configuration loader may add where the value came from: "(connector.codec from
    # code)")
    assert str(info.value).startswith(message)


# --------------------------------------------------------------------------- planner
def _labelled() -> dict[str, Any]:
    # blocks: 0-1 axioms (pinned), 2 memories 0.9, 3 memories 0.4, 4-5 unlabelled
    return semantic_params([(0, 8, "axioms", 1.0), (8, 12, "memories", 0.9),
                            (12, 16, "memories", 0.4)], pin=True, prompt_token_ids=TOKENS)


def _saved(p: RequestPlanner, req_id: str, params: dict[str, Any] | None,
           tokens: list[int] = TOKENS) -> list[tuple[int, str, str]]:
    """(block index, source layer, format) of every block the planner saves."""
    p.matched_tokens(req_id, tokens, len(tokens), 0, params=params)
    _, saves = p.plan([StepRequest(req_id, tokens, 0, len(tokens), list(range(6)))])
    return [(s.first_block + i, lab.source_layer, lab.fmt)
            for s in saves for i, lab in enumerate(s.labels)]


POLICY = PrecisionPolicy(default="tq4", sink_blocks=1, sink_format="fp16",
                         layers={"axioms": "int8"}, importance=((0.8, "fp16"),))


def test_save_specs_carry_each_blocks_format() -> None:
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    assert _saved(p, "r", _labelled()) == [
        (0, "axioms", "fp16"),      # the sink
        (1, "axioms", "int8"),      # its layer
        (2, "memories", "fp16"),    # importance 0.9 >= 0.8
        (3, "memories", "tq4"),     # importance 0.4: the default
        (4, "user_turn", "tq4"), (5, "user_turn", "tq4")]


def test_the_sink_is_the_requests_first_blocks_not_a_runs() -> None:
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    p.seed(keys[:2])  # blocks 0-1 held: the save starts at block 2, no sink there
    assert _saved(p, "r", None) == [(b, "user_turn", "tq4") for b in range(2, 6)]
    p2 = RequestPlanner(IDENTITY.digest(), BS,
                        policy=PrecisionPolicy(sink_blocks=3, sink_format="native"))
    p2.seed([keys[0], keys[2]])  # two runs: [1] and [3, 4, 5]
    assert _saved(p2, "s", None) == [(1, "user_turn", "native"), (3, "user_turn", "tq4"),
                                     (4, "user_turn", "tq4"), (5, "user_turn", "tq4")]


def test_planner_defaults_to_the_default_policy() -> None:
    p = RequestPlanner(IDENTITY.digest(), BS)
    assert p.policy is DEFAULT_POLICY
    expected = DEFAULT_POLICY.formats_for([BlockLabel("user_turn")] * 6, p.head_dim)
    assert [fmt for _, _, fmt in _saved(p, "r", None)] == expected


def test_a_request_overrides_keys_of_the_servers_policy() -> None:
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    params = _labelled()
    params["contextkit"]["precision"] = {"default": "int8", "sink_blocks": 0}
    assert _saved(p, "r", params) == [
        (0, "axioms", "int8"), (1, "axioms", "int8"), (2, "memories", "fp16"),
        (3, "memories", "int8"), (4, "user_turn", "int8"), (5, "user_turn", "int8")]
    # other requests keep the server's policy
    other = [t + 1000 for t in TOKENS]
    assert [fmt for _, _, fmt in _saved(p, "s", None, other)] == ["fp16"] + ["tq4"] * 5


def test_semantic_params_carries_a_checked_precision_override() -> None:
    params = semantic_params([(0, 4, "axioms")], prompt_token_ids=TOKENS,
                             precision={"importance": {"0.7": "int8"}, "pinned": "fp16"})
    assert params["contextkit"]["precision"] == {"importance": [[0.7, "int8"]],
                                                 "pinned": "fp16"}
    json.dumps(params)  # travels as kv_transfer_params
    assert "precision" not in semantic_params([(0, 4, "axioms")])["contextkit"]
    with pytest.raises(PrecisionError, match=r"precision\.pinned: unknown block format 'fp4'"):
        semantic_params([(0, 4, "axioms")], precision={"pinned": "fp4"})


def test_a_bad_override_is_logged_once_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    params = _labelled()
    params["contextkit"]["precision"] = {"default": "tq3"}
    with caplog.at_level(logging.WARNING, logger="integrations.vllm.planning"):
        saved = _saved(p, "req-9", params)
        p.matched_tokens("req-9", TOKENS, len(TOKENS), 0, params=params)
        p.plan([StepRequest("req-9", [*TOKENS, 1], 24, 1, list(range(7)))])
    assert [fmt for _, _, fmt in saved] == ["fp16", "int8", "fp16", "tq4", "tq4", "tq4"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1, warnings
    assert "req-9" in warnings[0] and "precision.default: unknown block format 'tq3'" \
        in warnings[0] and "\n" not in warnings[0]


def test_an_override_with_mismatched_labels_is_ignored_with_them() -> None:
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    params = semantic_params([(0, 24, "axioms", 1.0)], prompt_token_ids=TOKENS[:-1],
                             precision={"default": "native", "sink_blocks": 0})
    # another prompt's fingerprint: default labels and the server's policy
    assert _saved(p, "r", params) == [(0, "user_turn", "fp16")] + [
        (b, "user_turn", "tq4") for b in range(1, 6)]


def test_formats_survive_the_worker_round_trip_of_keys() -> None:
    # a saved block is in the index whatever its format: another request matches it
    keys = hash_token_blocks(IDENTITY.digest(), "default", TOKENS, BS)
    p = RequestPlanner(IDENTITY.digest(), BS, policy=POLICY)
    _saved(p, "r", _labelled())
    p.apply(WorkerReport(stored=set(keys)))
    assert p.matched_tokens("s", TOKENS, len(TOKENS), 0) == 20


# ---------------------------------------------------------------------- byte budget
@pytest.mark.parametrize("head_dim", [64, 128])
def test_byte_costs_are_the_codecs(head_dim: int) -> None:
    from gpu_cache.formats import bytes_per_token_head

    for fmt in FORMATS:
        assert vs_fp16(fmt, head_dim) == bytes_per_token_head(fmt, head_dim) / (2 * head_dim)


def test_the_byte_budget_keeps_the_latest_raised_blocks() -> None:
    policy = PrecisionPolicy(sink_blocks=1, layers={"memories": "int8"}, max_vs_fp16=0.4)
    labels = [BlockLabel("memories")] * 10
    assert policy.formats_for(labels, 64) == ["fp16"] + ["tq4"] * 8 + ["int8"]
    cost = sum(vs_fp16(f, 64) for f in policy.formats_for(labels, 64))
    assert cost <= 0.4 * len(labels)
    # one raised block more would break it
    assert cost + vs_fp16("int8", 64) - vs_fp16("tq4", 64) > 0.4 * len(labels)
    # a wider budget keeps more of the latest blocks raised, never an earlier one alone
    wide = dataclasses.replace(policy, max_vs_fp16=0.45).formats_for(labels, 64)
    assert wide == ["fp16"] + ["tq4"] * 6 + ["int8"] * 3
    # no budget: the rules alone
    assert dataclasses.replace(policy, max_vs_fp16=None).formats_for(labels, 64) == [
        "fp16"] + ["int8"] * 9
    # blocks no rule raised are never touched; a sink alone over budget stays
    assert policy.formats_for([BlockLabel("axioms")] * 3, 64) == ["fp16", "tq4", "tq4"]
    assert policy.formats_for([BlockLabel("memories")], 64) == ["fp16"]


def test_the_default_policy_meets_its_budget_on_a_labelled_prompt() -> None:
    spans = [[0, 400, "axioms", 1.0], [400, 1000, "rules", 1.0],
             [1000, 1300, "memories", 0.9], [1300, 2000, "user_turn", 0.3]]
    params = semantic_params(spans)
    labels = [BlockLabel(layer) for layer in ["axioms"] * 13 + ["rules"] * 18
              + ["memories"] * 10 + ["user_turn"] * 21]
    fmts = DEFAULT_POLICY.formats_for(labels, 64)
    assert fmts[0] == "fp16" and fmts[-1] == "int8"
    budget = DEFAULT_POLICY.max_vs_fp16
    assert budget is not None and budget <= 0.35
    assert sum(vs_fp16(f, 64) for f in fmts) <= budget * len(fmts)
    assert set(fmts[1:31]) == {"k5v4"}  # the stable front stays at the default
    raised = [b for b, f in enumerate(fmts) if f == "int8"]
    assert raised == list(range(raised[0], len(fmts)))  # the latest blocks, contiguous
    assert params["contextkit"]["spans"][0][2] == "axioms"


@pytest.mark.parametrize("value", [0, -0.1, "x", True, float("nan")])
def test_a_bad_byte_budget_is_one_line(value: Any) -> None:
    with pytest.raises(PrecisionError, match=r"precision.max_vs_fp16: write a number > 0") as e:
        PrecisionPolicy.from_mapping({"max_vs_fp16": value})
    assert "\n" not in str(e.value)
    assert PrecisionPolicy.from_mapping({"max_vs_fp16": None}).max_vs_fp16 is None


def test_generated_blocks_are_raised_only_within_the_budget() -> None:
    # 6 prompt tokens of labels, 24 tokens in all: blocks 0-1 are the prompt's, 2-5
    # generated (default layer user_turn, which the policy raises)
    # head_dim 8: tq4 costs 0.5 of fp16, int8 0.75
    policy = PrecisionPolicy(sink_blocks=1, layers={"user_turn": "int8"}, max_vs_fp16=0.7)
    p = RequestPlanner(IDENTITY.digest(), BS, policy=policy, head_dim=IDENTITY.head_dim)
    p.matched_tokens("r", TOKENS, 8, 0)
    _, saves = p.plan([StepRequest("r", TOKENS, 0, len(TOKENS), list(range(6)))])
    fmts = [lab.fmt for s in saves for lab in s.labels]
    cost = [vs_fp16(f, IDENTITY.head_dim) for f in fmts]
    # every prefix of the request stays within budget once the sink is paid for
    assert fmts[0] == "fp16" and "int8" in fmts[2:]
    for b in range(2, len(fmts)):
        if fmts[b] == "int8":
            assert sum(cost[:b + 1]) <= 0.7 * (b + 1)
        else:
            assert sum(cost[:b]) + vs_fp16("int8", IDENTITY.head_dim) > 0.7 * (b + 1)
    assert fmts == ["fp16", "tq4", "tq4", "int8", "int8", "tq4"]
    # without a budget every generated block is raised
    free = RequestPlanner(IDENTITY.digest(), BS, head_dim=IDENTITY.head_dim,
                          policy=dataclasses.replace(policy, max_vs_fp16=None))
    free.matched_tokens("r", TOKENS, 8, 0)
    _, saves = free.plan([StepRequest("r", TOKENS, 0, len(TOKENS), list(range(6)))])
    assert [lab.fmt for s in saves for lab in s.labels][2:] == ["int8"] * 4


def test_room_format_raises_only_blocks_below_it() -> None:
    policy = PrecisionPolicy.from_mapping({"room_format": "int8"}, PrecisionPolicy())
    assert [policy.room_for(f) for f in FORMATS] == ["int8", "int8", None, None, None]
    assert PrecisionPolicy().room_for("tq4") is None
    assert DEFAULT_POLICY.room_format == "int8" and "int8" in DEFAULT_POLICY.formats()
    assert PrecisionPolicy.from_mapping(DEFAULT_POLICY.to_dict()) == DEFAULT_POLICY
    with pytest.raises(PrecisionError, match=r"precision.room_format: unknown block format"):
        PrecisionPolicy.from_mapping({"room_format": "fp8"})
