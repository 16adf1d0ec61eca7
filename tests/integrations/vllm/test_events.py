"""The connector's KV events (no vLLM: event classes with vLLM's fields stand in)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from integrations.vllm.events import MEDIUM_DDR, MEDIUM_SHARED, BlockEvents

BS = 4


@dataclass
class Stored:  # vllm.distributed.kv_events.BlockStored's fields
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass
class Removed:
    block_hashes: list[Any]
    medium: str | None


def _convert(h: bytes) -> int:  # vLLM's default: the low 64 bits as an int
    return int.from_bytes(h, "big") & (2**64 - 1)


def _events() -> BlockEvents:
    return BlockEvents(BS, (Stored, Removed, _convert))


def _request(n: int, salt: str) -> tuple[list[bytes], list[int]]:
    hashes = [hashlib.sha256(f"{salt}/{i}".encode()).digest() for i in range(n)]
    return hashes, list(range(100, 100 + n * BS + 2))


def test_stored_blocks_are_announced_with_vllm_hashes_tokens_and_the_salt() -> None:
    ev = _events()
    hashes, tokens = _request(4, "acme")
    keys = [b"k%d" % i for i in range(4)]
    ev.planned(keys, 0, hashes, tokens, "acme")
    ev.stored(keys[:3])
    (event,) = ev.take()
    assert event.block_hashes == [_convert(h) for h in hashes[:3]]
    assert event.parent_block_hash is None and event.medium == MEDIUM_DDR
    assert event.token_ids == tokens[:3 * BS] and event.block_size == BS
    assert event.extra_keys == [("acme",), None, None]  # the salt, on the first block only
    ev.stored([keys[3]])  # a later save: the chain continues from block 2
    (event,) = ev.take()
    assert event.parent_block_hash == _convert(hashes[2]) and event.extra_keys is None


def test_uploads_are_announced_as_shared_and_evictions_removed() -> None:
    ev = _events()
    hashes, tokens = _request(4, "acme")
    keys = [b"k%d" % i for i in range(4)]
    ev.planned(keys, 0, hashes, tokens, "acme")
    ev.stored(keys)
    ev.stored(keys, MEDIUM_SHARED)
    ev.removed(keys[2:])
    ddr, shared, removed = ev.take()
    assert shared.block_hashes == ddr.block_hashes
    # a remote tier as vLLM's fields say it (vllm-router: "external" credit)
    assert (shared.medium, shared.locality, shared.ownership) == (
        "STORAGE", "REMOTE", "contextkit-shared")
    assert (ddr.medium, ddr.locality) == ("CPU", None)
    assert removed.block_hashes == [_convert(h) for h in hashes[2:]]
    assert removed.medium == MEDIUM_DDR
    ev.removed(keys[2:])  # announced once
    ev.stored(keys[:2])  # held already: not again
    assert ev.take() == []


def test_two_tenants_same_tokens_are_two_chains() -> None:
    ev = _events()
    (ha, tokens), (hb, _) = _request(2, "acme"), _request(2, "globex")
    ev.planned([b"a0", b"a1"], 0, ha, tokens, "acme")
    ev.planned([b"b0", b"b1"], 0, hb, tokens, "globex")
    ev.stored([b"a0", b"a1", b"b0", b"b1"])
    events = ev.take()
    assert len(events) == 2
    assert {e.extra_keys[0][0] for e in events} == {"acme", "globex"}
    assert not set(events[0].block_hashes) & set(events[1].block_hashes)


def test_failed_saves_are_not_announced() -> None:
    ev = _events()
    hashes, tokens = _request(2, "acme")
    ev.planned([b"k0", b"k1"], 0, hashes, tokens, None)
    ev.failed([b"k0", b"k1"])
    ev.stored([b"k0", b"k1"])
    assert ev.take() == []
