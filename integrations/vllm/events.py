"""KV events in vLLM's own format for what contextkit's tiers hold, so KV-aware routers
(vllm-router's ``kv_aware`` policy, Ray Serve's ``KVAwareRouter``, llm-d, Dynamo) count
blocks contextkit stores beside the ones in vLLM's paged cache.

vLLM publishes one ``KVEventBatch`` per step on its ``--kv-events-config`` publisher:
its own block pool's events, then the connector's :meth:`take_events`. Here, scheduler
side:

- a block the worker stored in the DDR tier (a save, or a chunk brought in from the
  shared tier) is a ``BlockStored`` with ``medium="CPU"`` (vLLM's name of host
  memory); once uploaded to the shared tier, another ``BlockStored`` with
  ``medium="STORAGE"``, ``locality="REMOTE"`` and ``ownership="contextkit-shared"``
  (vLLM's fields for a remote tier, which vllm-router credits as *external*; an
  unknown medium string would make it reject the whole batch);
- a block evicted from the DDR tier is a ``BlockRemoved`` (``medium="CPU"``).

Events carry vLLM's own block hashes (the request's ``block_hashes``, converted as
vLLM converts its own), token ids and, on a prompt's first block, the tenant's
``cache_salt`` in ``extra_keys`` as vLLM puts it there: a router that matches hashes
or tokens sees contextkit's blocks exactly as vLLM's own, and never one tenant's
blocks under another's salt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["MEDIUM_DDR", "MEDIUM_SHARED", "SHARED_LOCALITY", "SHARED_OWNERSHIP", "BlockEvents"]

#: vLLM's name of host memory (``vllm.distributed.kv_events.MEDIUM_CPU``): the DDR tier.
MEDIUM_DDR = "CPU"
#: The live shared tier: vLLM's storage medium, remote, owned by contextkit's tier.
MEDIUM_SHARED = "STORAGE"
SHARED_LOCALITY = "REMOTE"
SHARED_OWNERSHIP = "contextkit-shared"


@dataclass(slots=True)
class _Origin:
    hashes: Sequence[Any]  # the request's vLLM block hashes (bytes)
    token_ids: Sequence[int]
    index: int  # the block's index in the request
    salt: str | None


def _vllm_factories() -> tuple[Callable[..., Any], Callable[..., Any], Callable[[Any], Any]]:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return BlockStored, BlockRemoved, maybe_convert_block_hash


class BlockEvents:
    """Scheduler side: which vLLM block each contextkit key is, and the events due.

    Args:
        block_size: tokens per block.
        factories: ``(BlockStored, BlockRemoved, convert_hash)``; default: vLLM's.
    """

    def __init__(self, block_size: int,
                 factories: tuple[Callable[..., Any], Callable[..., Any],
                                  Callable[[Any], Any]] | None = None) -> None:
        self.block_size = block_size
        self._stored_cls, self._removed_cls, self._convert = factories or _vllm_factories()
        #: planned or held key -> its request's block (until it is dropped or fails)
        self._origin: dict[bytes, _Origin] = {}
        self._held: dict[bytes, Any] = {}  # key held in DDR -> its converted vLLM hash
        self._pending: list[Any] = []

    def planned(self, keys: Sequence[bytes], first_block: int, block_hashes: Sequence[Any],
                token_ids: Sequence[int], salt: str | None) -> None:
        """Keys a save or load will store, blocks ``first_block ..`` of a request."""
        for i, key in enumerate(keys):
            b = first_block + i
            if b < len(block_hashes):
                self._origin[key] = _Origin(block_hashes, token_ids, b, salt)

    def stored(self, keys: Iterable[bytes], medium: str = MEDIUM_DDR) -> None:
        """The worker holds ``keys`` now in ``medium`` (the DDR tier, or uploaded to the
        shared tier): one event per run of consecutive blocks."""
        origins = []
        for key in keys:
            origin = self._origin.get(key)
            if origin is None:
                continue
            if medium == MEDIUM_DDR:
                if key in self._held:
                    continue
                self._held[key] = self._convert(origin.hashes[origin.index])
            origins.append(origin)
        for run in _runs(origins):
            self._pending.append(self._event(run, medium))

    def removed(self, keys: Iterable[bytes]) -> None:
        """The DDR tier dropped ``keys``."""
        keys = list(keys)
        for key in keys:
            self._origin.pop(key, None)
        hashes = [self._held.pop(key) for key in keys if key in self._held]
        if hashes:
            self._pending.append(self._removed_cls(block_hashes=hashes, medium=MEDIUM_DDR))

    def failed(self, keys: Iterable[bytes]) -> None:
        """Saves that did not make it: nothing to announce."""
        for key in keys:
            self._origin.pop(key, None)

    def take(self) -> list[Any]:
        events, self._pending = self._pending, []
        return events

    def _event(self, run: list[_Origin], medium: str) -> Any:
        first, bs = run[0], self.block_size
        start, end = first.index, run[-1].index + 1
        extra = None
        if start == 0 and first.salt:
            # vLLM's extra keys of a prompt's first block hold the salt (and only the
            # first block's); one entry per block of the event
            extra = [(first.salt,)] + [None] * (end - start - 1)
        where = ({"locality": SHARED_LOCALITY, "ownership": SHARED_OWNERSHIP}
                 if medium == MEDIUM_SHARED else {})
        return self._stored_cls(
            block_hashes=[self._convert(first.hashes[i]) for i in range(start, end)],
            parent_block_hash=self._convert(first.hashes[start - 1]) if start else None,
            token_ids=list(first.token_ids[start * bs:end * bs]), block_size=bs,
            lora_id=None, medium=medium, lora_name=None, extra_keys=extra, **where)


def _runs(origins: list[_Origin]) -> list[list[_Origin]]:
    """Consecutive blocks of one request, grouped (an event holds one chain)."""
    runs: list[list[_Origin]] = []
    for o in sorted(origins, key=lambda o: (id(o.hashes), o.index)):
        last = runs[-1][-1] if runs else None
        if last is not None and last.hashes is o.hashes and last.index + 1 == o.index:
            runs[-1].append(o)
        else:
            runs.append([o])
    return runs
