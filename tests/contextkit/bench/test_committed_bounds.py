"""No configuration beats the ceiling its own run reports, in any committed bench JSON.

The bounds are in tokens (computed, or reused), which a configuration cannot beat on
the same prompts by construction; a timing ratio can, by noise, and is therefore never
called a bound (issue 58).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from contextkit.bench.figures import RESULTS


def _files(prefix: str) -> list[Path]:
    return sorted(RESULTS.glob(f"{prefix}*.json"))


def _load(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


@pytest.mark.parametrize("path", [p for p in _files("ttft-")
                                  if "computed_tokens_chunk_ceiling" in _load(p)],
                         ids=lambda p: p.name)
def test_ttft_no_turn_computes_less_than_its_chunk_ceiling(path: Path) -> None:
    data = _load(path)
    for turn, (got, ceiling) in enumerate(zip(data["computed_tokens"],
                                              data["computed_tokens_chunk_ceiling"],
                                              strict=True), start=1):
        assert got >= ceiling, f"{path.name} turn {turn}: {got} < ceiling {ceiling}"


@pytest.mark.parametrize("path", [p for p in _files("agents-")
                                  if {"policies", "ceiling"} <= set(_load(p))],
                         ids=lambda p: p.name)
def test_agents_no_policy_computes_less_than_the_cache_that_holds_everyone(path: Path
                                                                         ) -> None:
    data = _load(path)
    ceiling = data["ceiling"]["computed_tokens"]
    for name, figures in data["policies"].items():
        assert figures["computed_tokens"] >= ceiling, f"{path.name}: {name}"
    for name, bound in (data.get("bounds") or {}).items():
        assert bound["beats_ceiling"] is False, f"{path.name}: {name}"
        assert bound["ceiling_fraction"] is None or bound["ceiling_fraction"] <= 1, name


@pytest.mark.parametrize("path", [p for p in _files("agents-vllm-")
                                  if "ceiling" in _load(p).get("cached_tokens", {})],
                         ids=lambda p: p.name)
def test_agents_vllm_no_configuration_reuses_more_than_the_ceiling(path: Path) -> None:
    """The ceiling bounds prefix reuse; chunk reuse (``connector_chunks``) reuses the
    text after a changed layer too, past that bound by design: its own bound is
    checked against the tokens it computed (fewer than the ceiling's, no fewer than
    the oracle's, which computes only what the tenant never sent)."""
    data = _load(path)
    cached = {name: sum(v) for name, v in data["cached_tokens"].items()}
    for name, tokens in cached.items():
        if name in ("connector_chunks", "oracle"):
            computed = data["chunks"]["computed_tokens"]
            assert computed[name] < computed["ceiling"], f"{path.name}: {name}"
            if name == "oracle" and "connector_chunks" in computed:
                assert computed[name] <= computed["connector_chunks"], path.name
            continue
        assert tokens <= cached["ceiling"], f"{path.name}: {name} {tokens}"


@pytest.mark.parametrize("path", [p for p in _files("replicas-")
                                  if "cross_replica_hit_rate" in _load(p)],
                         ids=lambda p: p.name)
def test_replicas_no_pair_reuses_more_than_one_replica_that_saw_every_turn(path: Path
                                                                           ) -> None:
    data = _load(path)
    for key in ("cross_replica_hit_rate", "cross_replica_hit_rate_local"):
        if data.get(key) is not None:
            assert data[key] <= 1.0, f"{path.name}: {key} {data[key]}"


def test_every_bench_with_a_bound_has_a_committed_file_checked() -> None:
    """The parametrised checks above must find files, or they prove nothing."""
    assert [p for p in _files("ttft-") if "computed_tokens_chunk_ceiling" in _load(p)]
    assert [p for p in _files("agents-") if {"policies", "ceiling"} <= set(_load(p))]
    assert [p for p in _files("agents-vllm-") if "ceiling" in _load(p).get("cached_tokens", {})]
    assert [p for p in _files("replicas-") if "cross_replica_hit_rate" in _load(p)]
