"""``contextkit bench vllm`` without vLLM: the agent prompts, the harness's prompts file,
the per-policy configurations, metrics, acceptance, arguments and plot.

The prompts are built with the packaged SmolLM2 on the embedded engine (what the bench
does); the connector configurations go through the real ``ConnectorConfig``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import re
from pathlib import Path
from typing import Any

import pytest

from contextkit.bench import _vllm_report
from contextkit.bench import vllm as bench_vllm
from contextkit.bench._vllm_report import (
    ACCEPTANCE,
    POLICIES,
    acceptance,
    greedy,
    parse_policies,
    policy_config,
    policy_dirname,
    policy_metrics,
    stored_bytes,
)
from contextkit.prompt.layers import LayerConfig
from contextkit.workloads import vllm_prompts as _vllm_prompts

PROMPT_TOKENS = 2048
NUM_PROMPTS = 3


@pytest.fixture(scope="module")
def engine() -> Any:
    from contextkit.engine.engine import Engine

    return Engine.from_pretrained(num_device_blocks=8, num_host_blocks=8)


@pytest.fixture(scope="module")
def prompts(engine: Any) -> list[dict[str, Any]]:
    return _vllm_prompts.agent_prompts(engine, NUM_PROMPTS, PROMPT_TOKENS)


# ---------------------------------------------------------------------- prompts
def test_agent_prompts_are_about_the_asked_length_and_each_its_own_tenant(
        prompts: list[dict[str, Any]]) -> None:
    assert len(prompts) == NUM_PROMPTS
    for p in prompts:
        assert PROMPT_TOKENS - 128 <= len(p["token_ids"]) <= PROMPT_TOKENS
    assert [p["cache_salt"] for p in prompts] == [f"agent-{i}" for i in range(NUM_PROMPTS)]
    assert [p["turn"] for p in prompts] == list(range(NUM_PROMPTS))
    # distinct prompts (turn, snapshot, history), the same stable layers
    assert len({tuple(p["token_ids"]) for p in prompts}) == NUM_PROMPTS


def test_agent_prompts_are_chat_turns_with_their_layer_labels(
        engine: Any, prompts: list[dict[str, Any]]) -> None:
    for p in prompts:
        ids, spans = p["token_ids"], p["spans"]
        text = engine.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system")
        assert text.endswith("<|im_start|>assistant\n")
        layers = [s["layer"] for s in spans]
        # the identity-bearing layers are whole and first, pinned; the rest are not
        assert layers[:4] == ["axioms", "identity", "rules", "capabilities"]
        assert {"neurons", "memories", "system_state", "current_time", "user_turn"} <= set(layers)
        for s in spans:
            assert s["pinned"] == (s["layer"] in {"axioms", "identity", "rules",
                                                  "capabilities"})
            assert 0.0 <= s["importance"] <= 1.0
        ends = [(s["start"], s["end"]) for s in spans]
        assert all(a < b <= c for (a, b), (c, _) in itertools.pairwise(ends))
        assert ends[-1][1] <= len(ids)
    # turn 1 and later carry a conversation (the scripted history) before the volatile
    # layers: more than one user turn
    assert sum(s["layer"] == "user_turn" for s in prompts[2]["spans"]) >= 3


def test_agent_prompts_keep_the_axioms_whole(engine: Any,
                                             prompts: list[dict[str, Any]]) -> None:
    from contextkit.workloads.replay import AgentReplay

    replay = AgentReplay(1)
    axioms = replay.build_system_message(0).sections[0]
    assert axioms.layer == "axioms"
    span = prompts[0]["spans"][0]
    text = engine.tokenizer.decode(prompts[0]["token_ids"][span["start"]:span["end"]])
    for line in axioms.lines:
        assert line.text in text


def test_agent_prompts_refuse_a_length_the_stable_layers_do_not_fit(engine: Any) -> None:
    with pytest.raises(ValueError, match=r"agent prompt 0 is \d+ tokens even trimmed; use "
                                         r"--prompt-tokens \d+ or more"):
        _vllm_prompts.agent_prompts(engine, 1, 512)


def test_trimmed_layers_cut_in_order_and_keep_the_floors() -> None:
    layers = LayerConfig()
    lengths = {"capabilities": 1300, "neurons": 400, "memories": 300, "axioms": 180}
    out = {s.name: s for s in _vllm_prompts.trimmed_layers(layers, lengths, 1000)}
    assert out["capabilities"].budget == 300 and out["capabilities"].expanded_budget == 300
    assert out["neurons"].budget == 1600  # capabilities alone covered the excess
    floors = dict(_vllm_prompts.TRIM_ORDER)
    out = {s.name: s for s in _vllm_prompts.trimmed_layers(layers, lengths, 1400)}
    assert out["capabilities"].budget == floors["capabilities"]
    assert out["neurons"].budget == 400 - (1400 - (1300 - floors["capabilities"]))
    assert out["memories"].budget == 1100
    out = {s.name: s for s in _vllm_prompts.trimmed_layers(layers, lengths, 1500)}
    assert out["neurons"].budget == floors["neurons"]  # then the next layer
    assert out["memories"].budget == 300 - (1500 - (1300 - floors["capabilities"])
                                            - (400 - floors["neurons"]))
    assert out["axioms"].budget == 200  # never trimmed


# ---------------------------------------------------------------------- harness
def test_harness_reads_labelled_prompts_and_the_old_format(
        tmp_path: Path, prompts: list[dict[str, Any]]) -> None:
    from integrations.vllm.bench.harness import load_prompts, params_for
    from integrations.vllm.planning import PARAMS_KEY, label_mismatch

    path = tmp_path / "prompts.json"
    path.write_text(json.dumps(prompts))
    loaded = load_prompts(path, cache_salt="ignored")
    assert [p.cache_salt for p in loaded] == [p["cache_salt"] for p in prompts]
    for p, src in zip(loaded, prompts, strict=True):
        assert p.token_ids == src["token_ids"]
        assert p.kv_transfer_params is not None
        ours = p.kv_transfer_params[PARAMS_KEY]
        assert ours["pin"] is True
        assert ours["spans"] == [[s["start"], s["end"], s["layer"], s["importance"],
                                  s["pinned"]] for s in src["spans"]]
        assert label_mismatch(p.kv_transfer_params, p.token_ids) is None
        # a teacher-forced request extends the prompt: labels kept, fingerprint its own
        longer = [*p.token_ids, 42, 43]
        assert label_mismatch(p.kv_transfer_params, longer) is not None
        extended = params_for(p.kv_transfer_params, longer)
        assert extended is not None and label_mismatch(extended, longer) is None
        assert extended[PARAMS_KEY]["spans"] == ours["spans"]
        assert params_for(p.kv_transfer_params, p.token_ids) is p.kv_transfer_params

    path.write_text(json.dumps([[1, 2, 3], [4, 5]]))
    old = load_prompts(path, cache_salt="tenant-a")
    assert [(p.token_ids, p.cache_salt, p.kv_transfer_params) for p in old] == [
        ([1, 2, 3], "tenant-a", None), ([4, 5], "tenant-a", None)]
    assert params_for(None, [1, 2]) is None
    explicit = {"token_ids": [7, 8], "kv_transfer_params": {"x": 1}}
    path.write_text(json.dumps([explicit]))
    assert load_prompts(path)[0].kv_transfer_params == {"x": 1}
    assert load_prompts(path)[0].cache_salt is None


@pytest.mark.parametrize(("content", "message"), [
    ("{}", "expected a JSON list, got dict"),
    ("[[1, 2], {\"ids\": [3]}]", 'item 1 needs "token_ids"'),
    ("[{\"token_ids\": [1], \"spans\": [[0, 1]]}]", "item 0 has a bad span"),
    ("[{\"token_ids\": [1], \"kv_transfer_params\": [1]}]", "must be an object"),
    ("not json", "write a JSON list"),
])
def test_harness_refuses_a_bad_prompts_file_in_one_line(tmp_path: Path, content: str,
                                                        message: str) -> None:
    from integrations.vllm.bench.harness import load_prompts

    path = tmp_path / "prompts.json"
    path.write_text(content)
    with pytest.raises(SystemExit) as err:
        load_prompts(path)
    text = str(err.value)
    assert message in text and "\n" not in text


# ---------------------------------------------------------------------- policies
def test_every_policy_is_a_valid_connector_configuration() -> None:
    from integrations.vllm.config import ConnectorConfig

    base = {"block_size": 32, "shadow_url": "file:///tmp/s", "local_store": "file:///tmp/l",
            "stats_path": "/tmp/stats.jsonl", "codec": "int8", "precision": {"default": "fp16"}}
    policies = {}
    for name in POLICIES:
        cfg = policy_config(name, base)
        assert {k: cfg[k] for k in ("block_size", "shadow_url", "stats_path")} == {
            "block_size": 32, "shadow_url": "file:///tmp/s", "stats_path": "/tmp/stats.jsonl"}
        policies[name] = ConnectorConfig.from_json(json.dumps(cfg)).policy
    tq4, sink, native = policies["tq4"], policies["sink+offsets"], policies["native"]
    assert (tq4.default, tq4.sink_blocks, tq4.key_offsets, tq4.pinned, tq4.importance,
            dict(tq4.layers)) == ("tq4", 0, False, None, (), {})
    assert (sink.default, sink.sink_blocks, sink.key_offsets, sink.pinned,
            sink.importance, dict(sink.layers)) == ("tq4", 1, True, None, (), {})
    assert native.default == "native" and native.sink_blocks == 0
    from integrations.vllm.precision import policy_for_codec

    # the server's default, as a full store keeps it (room_format off)
    assert policies["importance"] == dataclasses.replace(policy_for_codec("tq4"),
                                                         room_format=None)
    assert policy_config("importance", base)["precision"] == {"room_format": None}
    assert policies["importance"].default == "k5v4"
    # the default before k5v4 and its control at the same budget: tq4 under the same rules
    old, control = policies["importance-tq4"], policies["tq4-0.35"]
    assert (old.default, old.max_vs_fp16, control.default, control.max_vs_fp16) == (
        "tq4", 0.33, "tq4", 0.35)
    assert old.layers == control.layers == policies["importance"].layers
    assert policies["k5v4"].default == "k5v4" and not policies["k5v4"].layers
    assert policy_dirname("sink+offsets") == "sink_offsets"


def test_policies_argument() -> None:
    parser = argparse.ArgumentParser()
    bench_vllm.add_arguments(parser)
    args = parser.parse_args([])
    assert args.policies == ["tq4", "sink+offsets", "stable-int8", "importance",
                             "importance-tq4", "tq4-0.35", "late-int8", "k5v4", "int8", "native"]
    assert (args.prompts, args.prompt_tokens, args.max_tokens) == (8, 2048, 32)
    assert parser.parse_args(["--policies", "native, importance"]).policies == [
        "native", "importance"]
    assert parse_policies("tq4") == ["tq4"]
    for bad, message in (("tq3", "unknown policy 'tq3'; choose from "
                                 "tq4,sink+offsets,stable-int8,importance,importance-tq4,"
                                 "tq4-0.35,late-int8,k5v4,int8,native"),
                         ("tq4,tq4", "a policy is named twice"),
                         (",", "choose from")):
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
            parse_policies(bad)


def test_run_outside_the_vllm_virtualenv_says_where_to_run() -> None:
    parser = argparse.ArgumentParser()
    bench_vllm.add_arguments(parser)
    with pytest.raises(SystemExit, match="runs inside the vLLM virtualenv"):
        bench_vllm.run(parser.parse_args([]))


# ---------------------------------------------------------------------- metrics
def test_greedy_compares_replies() -> None:
    assert greedy([1, 2, 3, 4], [1, 2, 3, 4]) == (1.0, 4, True)
    assert greedy([1, 2, 3, 4], [1, 9, 3, 4]) == (0.75, 1, False)
    assert greedy([5, 2], [1, 2]) == (0.5, 0, False)


def _formats() -> dict[str, dict[str, Any]]:
    return {"tq4": {"blocks": 30, "bytes": 30 * 32 * 100, "bytes_per_token": 100.0,
                    "vs_fp16": 0.25},
            "fp16": {"blocks": 10, "bytes": 10 * 32 * 400, "bytes_per_token": 400.0,
                     "vs_fp16": 1.0}}


def test_stored_bytes_weighs_formats_by_blocks() -> None:
    out = stored_bytes(_formats())
    assert out["bytes_per_token"] == pytest.approx((30 * 100 + 10 * 400) / 40)
    assert out["vs_fp16"] == pytest.approx((30 * 0.25 + 10 * 1.0) / 40)
    assert out["formats"]["fp16"] == {"blocks": 10, "bytes": 128000, "bytes_per_token": 400.0,
                                      "vs_fp16": 1.0}
    assert stored_bytes(None) == {"bytes_per_token": None, "vs_fp16": None, "formats": {}}


def _result(ttft: float, ids: list[int], hit: int = 0) -> dict[str, Any]:
    return {"ttft_ms": ttft, "token_ids": ids, "connector": {"external_hit_tokens": hit}}


def test_policy_metrics() -> None:
    cold = [_result(1000, [1, 2, 3, 4]), _result(3000, [5, 6, 7, 8]),
            _result(2000, [9, 9, 9, 9])]
    warm = [_result(100, [1, 2, 3, 4], 2016), _result(150, [5, 6, 0, 8], 2016),
            _result(200, [0, 9, 9, 9], 1984)]
    recovered: dict[str, Any] = {"results": warm,
                                 "teacher_forced_agreement": [1.0, 0.75, 0.5]}
    recovery = {"formats": _formats(), "snapshot_blocks": 40, "seconds": 1.5}
    m = policy_metrics(cold, recovered, recovery)
    assert m["teacher_forced_agreement"] == 0.75
    assert m["greedy_match"] == round(1 / 3, 4)
    assert m["greedy_prefix_match"] == round((4 + 2 + 0) / 3, 2)
    assert m["greedy_token_match"] == round((1 + 0.75 + 0.75) / 3, 4)
    assert m["first_token_match"] == round(2 / 3, 4)
    assert (m["ttft_cold_ms"], m["ttft_recovered_ms"], m["speedup"]) == (2000.0, 150.0, 13.33)
    assert m["external_hit_tokens"] == 2016
    assert m["vs_fp16"] == pytest.approx(0.4375)
    assert set(m["formats"]) == {"tq4", "fp16"}
    assert (m["recovered_blocks"], m["recover_seconds"], m["recover_errors"]) == (40, 1.5, {})
    with pytest.raises(ValueError, match="served 2 prompts, the cold run 3"):
        policy_metrics(cold, {"results": warm[:2]}, recovery)


def test_acceptance_of_the_default_policy() -> None:
    good = {"teacher_forced_agreement": 0.98, "greedy_match": 0.9, "vs_fp16": 0.35,
            "speedup": 10.0}
    assert acceptance(good) == {**dict.fromkeys(ACCEPTANCE, True), "all": True}
    bad = {**good, "greedy_match": 0.875, "vs_fp16": None}
    out = acceptance(bad)
    assert (out["greedy_match"], out["vs_fp16"], out["teacher_forced_agreement"],
            out["all"]) == (False, False, True, False)


def test_plot_writes_a_png(tmp_path: Path) -> None:
    m = {"teacher_forced_agreement": 0.99, "greedy_match": 0.9, "vs_fp16": 0.3}
    path = tmp_path / "sub" / "vllm.png"
    _vllm_report.plot(path, {"tq4": {**m, "vs_fp16": 0.28}, "importance": m}, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = _vllm_report.table_rows({"tq4": m})
    assert ("tq4: teacher_forced_agreement", 0.99) in rows and ("tq4: speedup", None) in rows


def test_build_prompts_refuses_too_few_tokens_in_one_line() -> None:
    with pytest.raises(SystemExit) as err:
        bench_vllm.build_prompts(1, 512)
    assert re.fullmatch(r"contextkit bench vllm: agent prompt 0 is \d+ tokens even trimmed; "
                        r"use --prompt-tokens \d+ or more", str(err.value))


def test_build_prompts_refuses_another_tokenizer(tmp_path: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    with pytest.raises(SystemExit) as err:
        bench_vllm.build_prompts(1, 2048, str(tmp_path))
    assert re.fullmatch(rf"--model {re.escape(str(tmp_path))}: its tokenizer \(\w+:2:\w+\) "
                        r"is not the packaged SmolLM2's \(\w+:49152:\w+\) the agent prompts "
                        r"are built with; serve a SmolLM2 model", str(err.value))
