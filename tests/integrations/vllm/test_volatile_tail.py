"""A request's volatile tail (from its ``volatile_from`` on) is stored only while the DDR
tier has room: the sender's next call changes it (no vLLM needed)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from contextkit.pipeline.served.wire import PARAMS_KEY
from gpu_cache import CacheIdentity
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.planning import (
    BlockLabel,
    RequestPlanner,
    StepRequest,
    label_problem,
    labels_from_params,
    semantic_params,
)
from integrations.vllm.store import ConnectorStore

BS, LAYERS, HEADS, DIM = 16, 2, 2, 64


# ---------------------------------------------------------------------- the labels
def test_blocks_from_the_one_holding_volatile_from_on_are_the_tail() -> None:
    params = semantic_params([(0, 40, "axioms", 1.0), (40, 70, "system_state")],
                             volatile_from=40)
    assert params[PARAMS_KEY]["volatile_from"] == 40
    # block 2 (tokens 32-47) holds token 40; generated blocks (5, 6) are tail too
    labels = labels_from_params(params, 0, 7, BS, "user_turn")
    assert [lab.tail for lab in labels] == [False, False, True, True, True, True, True]
    assert [lab.source_layer for lab in labels][:3] == ["axioms", "axioms", "axioms"]
    untold = semantic_params([(0, 40, "axioms", 1.0), (40, 70, "system_state")])
    assert "volatile_from" not in untold[PARAMS_KEY]
    assert not any(lab.tail for lab in labels_from_params(untold, 0, 7, BS, "user_turn"))
    with pytest.raises(ValueError, match="volatile_from must be >= 0"):
        semantic_params([(0, 4, "axioms")], volatile_from=-1)


@pytest.mark.parametrize("bad", [71, -1, "40", 4.5, True])
def test_a_bad_volatile_from_is_named_and_the_labels_ignored(bad: object) -> None:
    params = semantic_params([(0, 40, "axioms", 1.0)])
    params[PARAMS_KEY]["volatile_from"] = bad
    problem = label_problem(params, list(range(70)))
    assert problem is not None and "volatile_from must be a token index in [0, 70]" in problem
    planner = RequestPlanner(b"d" * 32, BS)
    planner.matched_tokens("r", list(range(70)), 70, 0, params=params)
    _, saves = planner.plan([StepRequest("r", list(range(70)), 0, 70, list(range(5)))])
    assert [lab.tail for s in saves for lab in s.labels] == [False] * 4  # served unlabelled


def test_the_planner_marks_the_tail_of_what_it_saves() -> None:
    ident = CacheIdentity(model_id="m", num_layers=2, num_kv_heads=2, head_dim=8,
                          block_size=BS)
    planner = RequestPlanner(ident.digest(), BS)
    tokens = list(range(100, 180))  # 5 blocks
    params = semantic_params([(0, 50, "rules"), (50, 80, "current_time")], volatile_from=50)
    planner.matched_tokens("r", tokens, len(tokens), 0, params=params)
    _, saves = planner.plan([StepRequest("r", tokens, 0, len(tokens), list(range(5)))])
    assert [lab.tail for s in saves for lab in s.labels] == [False, False, False, True, True]


# ---------------------------------------------------------------------- the store
@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.integrations.vllm.test_store import _model_dir

    return _model_dir(tmp_path_factory.mktemp("models"), "tiny")


def _store(model: Path, tmp: Path, **kw: object) -> ConnectorStore:
    config = ConnectorConfig(block_size=BS, shadow_url="", shadow_on_save=False,
                             local_store=f"file://{tmp / 'local'}", host_blocks=8,
                             codec="tq4", precision={"sink_blocks": 0, "default": "tq4",
                                                     "layers": {}, "room_format": None},
                             **kw)  # type: ignore[arg-type]
    return ConnectorStore(vllm_cache_identity(str(model), BS), config)


def _save(store: ConnectorStore, name: str, layers: list[str], tail: list[bool]):  # type: ignore[no-untyped-def]
    n = len(layers)
    g = torch.Generator().manual_seed(len(name))
    k = torch.randn((LAYERS, n, BS, HEADS, DIM), generator=g)
    keys = [hashlib.sha256(f"{name}/{i}".encode()).digest() for i in range(n)]
    labels = [BlockLabel(layer, 0.5, fmt="tq4", tail=t) for layer, t in zip(layers, tail,
                                                                            strict=True)]
    return keys, store.save(k, k.clone(), keys, "acme", labels)


def test_the_tail_is_stored_while_there_is_room(model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)
    keys, result = _save(store, "a", ["rules"] * 3 + ["current_time"] * 2, [False] * 3 + [True] * 2)
    assert result.stored == keys and not result.skipped  # 5 of 8 blocks: room
    stats = store.take_stats() or {}
    assert "skipped_blocks" not in stats.get("counters", {})


def test_under_pressure_the_tail_is_skipped_and_nothing_is_evicted_for_it(
        model: Path, tmp_path: Path) -> None:
    store = _store(model, tmp_path)
    first, _ = _save(store, "a", ["rules"] * 5 + ["current_time"] * 2, [False] * 5 + [True] * 2)
    # 7 of 8 held; the next agent's 3 blocks + 2 tail blocks do not fit without evicting
    keys, result = _save(store, "b", ["memories"] * 3 + ["system_state"] * 2,
                         [False] * 3 + [True] * 2)
    assert result.skipped == keys[3:]
    assert result.stored == keys[:3]  # the reusable blocks still go in, evicting
    assert set(result.removed) <= set(first[5:])  # the old tail goes first
    assert store.read(keys[3:4], "acme") is None
    stats = store.take_stats()
    assert stats is not None and stats["counters"]["skipped_blocks"] == 2


def test_store_volatile_always_stores_the_tail_under_pressure(model: Path,
                                                              tmp_path: Path) -> None:
    store = _store(model, tmp_path, store_volatile="always")
    _save(store, "a", ["rules"] * 5 + ["current_time"] * 2, [False] * 5 + [True] * 2)
    keys, result = _save(store, "b", ["memories"] * 3 + ["system_state"] * 2,
                         [False] * 3 + [True] * 2)
    assert not result.skipped and result.stored == keys


def test_store_volatile_is_checked_in_one_line() -> None:
    with pytest.raises(ConnectorConfigError, match="store_volatile must be one of room, always, "
                                                   "got 'never'"):
        ConnectorConfig(store_volatile="never")
    assert ConnectorConfig.from_extra_config({"store_volatile": "always"},
                                             env={}).store_volatile == "always"
