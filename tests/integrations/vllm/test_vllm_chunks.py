"""Chunk reuse on vLLM's CPU build, end to end: documents in a new order are moved in
with their keys re-rotated and their seams computed by the served model; what the
connector places matches a fresh computation where it must; requests that did not opt
in, and other tenants, never see moved K/V; the model check and a missing model loader
turn it off with their reasons. Run by ``make test-vllm`` (each scenario in a child
process: :mod:`tests.integrations.vllm.chunk_probe`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

#: A moved key against the same token's key computed fresh at its new position, at
#: layer 0 (its K/V depend on the token and position only): float32 RoPE rounding.
ROTATION_TOLERANCE = 1e-3
#: K/V the connector computed with exact context (the seam right after the prefix)
#: against vLLM-free fresh computation by the same modules: float32 rounding.
FORWARD_TOLERANCE = 1e-3
#: The same K/V computed with bfloat16 projections against the model's float32 ones:
#: relative error (the worst layer) of bfloat16 rounding through 30 layers.
BF16_TOLERANCE = 3e-2


def _probe(tmp_path: Path, scenario: str) -> dict[str, Any]:
    out = tmp_path / f"{scenario}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "CK_PROBE_SHARED": str(tmp_path / "shared"),
           "CONTEXTKIT_SHADOW_KEY": "chunk-probe-deployment-key"}
    proc = subprocess.run([sys.executable, "-m", "tests.integrations.vllm.chunk_probe",
                           scenario, str(out)], env=env, capture_output=True, text=True,
                          check=False, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return dict(json.loads(out.read_text()))


@pytest.fixture(scope="module")
def kv(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _probe(tmp_path_factory.mktemp("chunks"), "kv")


def test_documents_in_a_new_order_reuse_their_chunks(kv: dict[str, Any]) -> None:
    first, second = kv["turn1"]["report"], kv["turn2"]["report"]
    assert first["reuse"] == "none"
    assert second["reuse"] == "chunk", second
    assert second["chunk_reused_tokens"] > 250  # C and A moved in
    # D is new: the connector computed it, with C's and A's seams
    assert second["repaired_tokens"] > 250
    assert second["computed_tokens"] == (second["prompt_tokens"] - second["vllm_cached_tokens"]
                                         - second["contextkit_loaded_tokens"]
                                         - second["chunk_reused_tokens"])
    assert kv["full2"]["report"]["reuse"] == "none"
    # the third order finds D too, computed by the connector last turn (one hop away)
    third = kv["turn3"]["report"]
    assert third["reuse"] == "chunk" and third["chunk_reused_tokens"] > 800, third
    assert third["repaired_tokens"] < 100


def test_a_moved_chunk_has_the_kv_of_a_fresh_computation_where_context_allows(
        kv: dict[str, Any]) -> None:
    check = kv["check"]
    assert check["moved"] > 250 and check["seam"] >= 4 and check["before_seam_unmoved"]
    layer0 = check["layers"]["0"]
    # layer 0 depends on the token and its position only: the move is exact there
    assert layer0["k_moved"] < ROTATION_TOLERANCE, layer0
    assert layer0["v_moved"] == 0.0
    for layer, diff in check["layers"].items():
        # the seam after the rules (reused where computed) attends over exact K/V:
        # exact at every layer
        assert diff["k_seam"] < FORWARD_TOLERANCE and diff["v_seam"] < FORWARD_TOLERANCE, (
            layer, diff)
    # deeper, moved K/V were computed after other text: they differ (CacheBlend's
    # approximation, which the seam repair and the model check bound)
    assert check["layers"]["29"]["k_moved"] > ROTATION_TOLERANCE


def test_the_first_reply_token_matches_a_full_prefill(kv: dict[str, Any]) -> None:
    # moved K/V approximate a full prefill: later tokens may flip at near ties (the
    # bench measures agreement over many positions); the first one must not here
    assert kv["turn2"]["reply"][:1] == kv["full2"]["reply"][:1]
    assert kv["turn3"]["reply"][:1] == kv["full3"]["reply"][:1]


def test_moved_kv_never_reaches_a_request_that_did_not_opt_in(kv: dict[str, Any]) -> None:
    prompt = kv["turn2"]["report"]["prompt_tokens"]
    # the namespace that opted in gets vLLM's cached (moved) blocks back ...
    assert kv["again_opted_in"]["cached"] >= prompt - 64
    # ... the same tenant without the opt-in finds nothing in vLLM's cache or contextkit's
    out = kv["again_opted_out"]
    assert out["cached"] == 0 and out["report"]["reuse"] == "none", out
    assert out["report"]["fallback"] is None


def test_another_tenant_never_reuses_or_reads_the_chunks(kv: dict[str, Any]) -> None:
    other = kv["other_tenant"]
    assert other["cached"] == 0 and other["report"]["chunk_reused_tokens"] == 0
    assert kv["sources"] == {"own": True, "foreign": False}


def test_the_model_check_turns_chunk_reuse_off_with_its_reason(tmp_path: Path) -> None:
    gate = _probe(tmp_path, "gate")
    second = gate["turn2"]["report"]
    assert second["reuse"] != "chunk" and second["chunk_reused_tokens"] == 0
    assert "chunk-reuse check failed" in (second["fallback"] or ""), second
    assert gate["turn2"]["reply"] == gate["full2"]["reply"]


def test_without_the_model_loader_chunk_reuse_is_off_with_its_reason(tmp_path: Path) -> None:
    plain = _probe(tmp_path, "no-loader")
    second = plain["turn2"]["report"]
    assert second["reuse"] != "chunk"
    assert "--load-format contextkit" in (second["fallback"] or ""), second


def test_a_replica_reuses_the_documents_another_replica_computed(tmp_path: Path) -> None:
    a = _probe(tmp_path, "replica-a")
    assert a["turn1"]["report"]["reuse"] == "none"
    # published as span objects: the rules, A, B and C (C ends in the prompt's last,
    # partial block, saved for chunk reuse; the question is shorter than a chunk)
    assert a["spans"] == 4
    b = _probe(tmp_path, "replica-b")  # a fresh server: its DDR tier and index are empty
    second = b["turn2"]["report"]
    assert second["reuse"] == "chunk", second
    assert second["chunk_reused_tokens"] > 250, second  # A, from replica A's span object
    assert second["contextkit_loaded_tokens"] == 0 and second["vllm_cached_tokens"] == 0
    assert b["turn2"]["reply"][:1] == b["full2"]["reply"][:1]
    # B computed with bfloat16 projections (copied from the weights the loader kept):
    # K/V within bfloat16 rounding of the model's own, not equal to them
    proj = b["projections"]
    assert proj["dtype"] == "torch.bfloat16", proj
    assert 0 < proj["rel_k"] < BF16_TOLERANCE and 0 < proj["rel_v"] < BF16_TOLERANCE, proj
    other = b["other_tenant"]["report"]  # another tenant finds none of acme's spans
    assert other["chunk_reused_tokens"] == 0 and b["other_tenant"]["cached"] == 0
