"""Worker-side store and the recovery job of the vLLM connector (no vLLM needed)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from gpu_cache import Tier, hash_token_blocks
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.identity import model_fingerprint, vllm_cache_identity
from integrations.vllm.precision import BlockLabel
from integrations.vllm.recovery import recover_for_vllm
from integrations.vllm.store import ConnectorStore, local_session_keys

BS = 16
LAYERS, HEADS, DIM = 2, 2, 64


def _model_dir(root: Path, name: str, num_layers: int = LAYERS) -> Path:
    """A tiny Hugging Face directory: Llama config.json and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = root / name
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": HEADS, "head_dim": DIM, "hidden_size": 256}))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _model_dir(tmp_path_factory.mktemp("models"), "tiny")


def _config(tmp: Path, **kw: object) -> ConnectorConfig:
    return ConnectorConfig(block_size=BS, shadow_url=f"file://{tmp / 'shadow'}",
                           local_store=f"file://{tmp / 'local'}", host_blocks=8,
                           shadow_on_save=False, **kw)  # type: ignore[arg-type]


def _kv(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, n, BS, HEADS, DIM)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _keys(identity_digest: bytes, n: int, tenant: str = "default", offset: int = 0) -> list[bytes]:
    return hash_token_blocks(identity_digest, tenant, list(range(offset, offset + n * BS)), BS)


def test_identity_follows_model_weights_and_block_size(model: Path, tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    assert (ident.num_layers, ident.num_kv_heads, ident.head_dim) == (LAYERS, HEADS, DIM)
    assert ident.model_id == f"sha256:{model_fingerprint(str(model.resolve()))}"
    assert vllm_cache_identity(str(model), 32) != ident
    other = _model_dir(tmp_path, "other", num_layers=3)
    assert vllm_cache_identity(str(other), BS).model_id != ident.model_id


def test_export_all_hands_out_every_block_or_none(model: Path, tmp_path: Path) -> None:
    """What a moved chunk's sources are read with: all of them for their tenant, or
    nothing (a missing block, another tenant)."""
    k, v = _kv(3)
    ident = vllm_cache_identity(str(model), BS, "native")
    store = ConnectorStore(ident, _config(tmp_path, codec="native"))
    keys = _keys(ident.digest(), 3)
    store.save(k, v, keys, "default", [BlockLabel("axioms", fmt="native")] * 3)
    parts = store.export_all(keys, "default")
    assert parts is not None and sorted(p for _, at, _ in parts for p in at) == [0, 1, 2]
    assert store.export_all(keys, "other-tenant") is None
    assert store.export_all([*keys[:2], b"\0" * 32], "default") is None


def test_save_then_read_roundtrip_tq4_and_native(model: Path, tmp_path: Path) -> None:
    k, v = _kv(3)
    for codec in ("tq4", "native"):
        ident = vllm_cache_identity(str(model), BS, codec)
        store = ConnectorStore(ident, _config(tmp_path, codec=codec))
        keys = _keys(ident.digest(), 3)
        labels = [BlockLabel("axioms", fmt=codec)] * 3  # the planner sets the format
        result = store.save(k, v, keys, "default", labels)
        assert result.stored == keys and result.failed == [] and result.removed == []
        assert store.save(k, v, keys, "default", labels).stored == []
        assert store.read(keys, "other-tenant") is None
        got = store.read([*keys[:2], b"\0" * 32], "default")
        assert got is not None
        k2, v2 = got
        assert k2.shape == (LAYERS, 2, BS, HEADS, DIM)
        if codec == "native":
            assert torch.equal(k2, k[:, :2]) and torch.equal(v2, v[:, :2])
        else:
            cos = torch.nn.functional.cosine_similarity(k2.reshape(-1, DIM),
                                                        k[:, :2].reshape(-1, DIM), dim=-1)
            assert float(cos.mean()) > 0.99
        assert store.cache.metadata.get(store.cache.lookup(keys[:1], "default")[0]).tier \
            is Tier.HOST  # CPU: stored blocks live in the DDR tier


def _overfill(store: ConnectorStore, digest: bytes) -> tuple[list[bytes], list[bytes], Any]:
    """Fill the 8-block tier with 4 axioms blocks, then 4 chat blocks, then save 2 more:
    (axioms keys, chat keys, the last save's result)."""
    k, v = _kv(4)
    axioms = _keys(digest, 4, offset=0)
    chat = _keys(digest, 4, offset=1000)
    store.save(k, v, axioms, "default", [BlockLabel("axioms", 1.0)] * 4)
    store.save(k, v, chat, "default", [BlockLabel("user_turn", 0.1)] * 4)
    fresh = _keys(digest, 2, offset=5000)
    result = store.save(k[:, :2], v[:, :2], fresh, "default", [BlockLabel("memories")] * 2)
    assert result.stored == fresh
    return axioms, chat, result


def test_full_tier_evicts_by_semantic_priority_and_reports_it(model: Path,
                                                              tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    store = ConnectorStore(ident, _config(tmp_path))  # 8 host blocks
    axioms, chat, result = _overfill(store, ident.digest())
    assert set(result.removed) <= set(chat) and len(result.removed) == 2  # chat goes first
    assert all(store.read([key], "default") is not None for key in axioms)


def test_lru_eviction_drops_the_least_recent_blocks_whatever_their_layer(
        model: Path, tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    store = ConnectorStore(ident, _config(tmp_path, eviction="lru"))  # 8 host blocks
    assert store.cache.config.eviction_policy == "lru"
    axioms, chat, result = _overfill(store, ident.digest())
    # the oldest blocks go, axioms or not (semantic eviction drops the chat instead)
    assert set(result.removed) <= set(axioms) and len(result.removed) == 2
    assert all(store.read([key], "default") is not None for key in chat)


def test_an_unknown_eviction_policy_is_refused_in_one_line(tmp_path: Path) -> None:
    from gpu_cache.metadata import EVICTION_POLICIES
    from integrations.vllm.config import EVICTION_POLICIES as NAMED
    from integrations.vllm.config import ConnectorConfigError

    assert sorted(NAMED) == sorted(EVICTION_POLICIES)
    with pytest.raises(ConnectorConfigError, match="eviction must be one of semantic, lru, "
                                                   "got 'fifo'"):
        _config(tmp_path, eviction="fifo")


def test_recovery_job_refuses_foreign_sessions_and_skips_corrupt_blocks(
        model: Path, tmp_path: Path) -> None:
    ident = vllm_cache_identity(str(model), BS)
    config = _config(tmp_path)
    writer = ConnectorStore(ident, config)
    writer.open_shadow(restored=False)
    keys = _keys(ident.digest(), 4)
    writer.save(*_kv(4), keys, "default", [BlockLabel("rules")] * 4)
    writer.close()

    # a session shadowed for another block size, with this server's keys
    foreign = ConnectorStore(vllm_cache_identity(str(model), 32),
                             ConnectorConfig(block_size=32, host_blocks=4,
                                             shadow_url=config.shadow_url, session_id="foreign",
                                             local_store="", shadow_on_save=False))
    foreign.open_shadow(restored=False)
    foreign.close()
    manifest_path = tmp_path / "shadow" / "vllm" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    record = manifest["blocks"][2]
    blob = tmp_path / "shadow" / manifest["segments"][0]["files"]["v_norms"]
    data = bytearray(blob.read_bytes())
    data[record["offsets"]["v_norms"]] ^= 0x55
    blob.write_bytes(bytes(data))

    summary = recover_for_vllm(str(model), config)
    assert "block_size" in summary["errors"]["foreign"]  # refused, named why
    assert summary["session_ids"] == ["vllm"]
    assert summary["skipped"] == 1 and "checksum" in summary["skipped_blocks"][0]["reason"]
    assert summary["snapshot_blocks"] == 3
    # the scheduler seeds its index from the snapshot; the chain breaks at block 2
    assert set(local_session_keys(config.local_store, ident)) == {keys[0], keys[1], keys[3]}

    server = ConnectorStore(ident, config)
    report = server.restore_local()
    assert report is not None and report.blocks == 3
    assert server.read(keys, "default")[0].shape[1] == 2  # type: ignore[index]

    # a snapshot for another identity is refused by the connector itself
    other = ConnectorStore(vllm_cache_identity(str(model), BS, "tq4", model_id="other"), config)
    assert other.restore_local() is None and len(other.cache.metadata) == 0
    assert local_session_keys(config.local_store, other.identity) == []


def test_shadow_manifest_lists_the_stored_blocks_read_only(model: Path, tmp_path: Path) -> None:
    from integrations.vllm.store import shadow_manifest

    ident = vllm_cache_identity(str(model), BS)
    config = _config(tmp_path, device_blocks=8)
    assert shadow_manifest(config) is None  # nothing shadowed yet (no directory either)
    assert shadow_manifest(ConnectorConfig(block_size=BS, shadow_url="")) is None
    store = ConnectorStore(ident, config)
    store.open_shadow(restored=False)
    assert shadow_manifest(config) is None  # a shadow store, no committed manifest
    k, v = _kv(3)
    keys = _keys(ident.digest(), 3, tenant="acme")
    labels = [BlockLabel("axioms", 1.0, True), BlockLabel("memories", 0.4),
              BlockLabel("user_turn", 0.3)]
    store.save(k, v, keys, "acme", labels)
    store.shadow_now()
    manifest = shadow_manifest(config)
    assert manifest is not None
    got = {bytes.fromhex(r.key): (r.source_layer, r.importance, r.tenant, r.pinned)
           for r in manifest.blocks if r.key is not None}
    assert got == {keys[0]: ("axioms", 1.0, "acme", True),
                   keys[1]: ("memories", 0.4, "acme", False),
                   keys[2]: ("user_turn", 0.3, "acme", False)}
    assert shadow_manifest(config) == manifest  # reading changed nothing
    store.close()
