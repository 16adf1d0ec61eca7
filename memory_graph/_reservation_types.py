"""Value types of :class:`memory_graph.reserver.GraphBlockReserver` (re-exported there)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

__all__ = [
    "ACTIVE_STATES",
    "WARMABLE_STATES",
    "NodeBlocks",
    "PrefillFn",
    "ReservationResult",
    "ReservationState",
    "ReserverConfig",
    "ReserverStats",
]


class ReservationState(enum.Enum):
    """Where a reservation is in its life."""

    RESERVED = "reserved"  # every node got host blocks
    PARTIAL = "partial"  # some nodes got host blocks; see reason
    EMPTY = "empty"  # no node got blocks; see reason (nothing is held)
    WARMED = "warmed"  # blocks promoted to the device tier
    RELEASED = "released"  # blocks freed by release()
    EXPIRED = "expired"  # not warmed in time; blocks freed


#: States whose reservation still holds its blocks (until consumed or released).
ACTIVE_STATES = frozenset({ReservationState.RESERVED, ReservationState.PARTIAL,
                           ReservationState.WARMED})
#: States a warm can promote from.
WARMABLE_STATES = frozenset({ReservationState.RESERVED, ReservationState.PARTIAL})


class PrefillFn(Protocol):
    """Computes KV of ``texts[i]`` into host blocks ``block_ids[i]`` (in order)."""

    def __call__(self, texts: list[str], block_ids: list[list[int]]) -> None: ...


@dataclass(frozen=True, slots=True)
class NodeBlocks:
    """The blocks reserved for one node; block ``j`` covers tokens ``[j*bs, (j+1)*bs)``."""

    node_id: str
    block_ids: tuple[int, ...]
    num_tokens: int


@dataclass(frozen=True, slots=True)
class ReservationResult:
    """A snapshot of one reservation.

    Attributes:
        reservation_id: handle for :meth:`GraphBlockReserver.warm_reservation` / ``release``.
        tenant: owner.
        node_ids: nodes that got blocks, in reservation order.
        block_ids: all their blocks, node by node.
        estimated_tokens: tokens of the reserved nodes (real tokenizer counts).
        expires_at: clock time after which an unwarmed reservation expires.
        state: see :class:`ReservationState`.
        reason: why the reservation is partial/empty, or why an operation did nothing.
        spans: per-node blocks and token counts.
        skipped_node_ids: nodes that did not fit.
        num_bytes: bytes of the reserved blocks (all layers, K and V).
        prefilled: the background prefill finished for these blocks (always true
            for :meth:`~memory_graph.reserver.GraphBlockReserver.adopt`).
        key: the caller's name for what the reservation holds (e.g. a topic); ``""``
            for :meth:`~memory_graph.reserver.GraphBlockReserver.reserve`.
    """

    reservation_id: str
    tenant: str
    node_ids: tuple[str, ...]
    block_ids: tuple[int, ...]
    estimated_tokens: int
    expires_at: float
    state: ReservationState
    reason: str = ""
    spans: tuple[NodeBlocks, ...] = ()
    skipped_node_ids: tuple[str, ...] = ()
    num_bytes: int = 0
    prefilled: bool = False
    key: str = ""


@dataclass(frozen=True, slots=True)
class ReserverConfig:
    """Settings of a :class:`GraphBlockReserver`.

    Args:
        ttl_s: seconds an unwarmed reservation lives.
        source_layer: source layer written into the blocks' metadata.
        max_blocks_per_reservation: cap on blocks one reservation may hold
            (``None``: as many as the host tier can give).
        prefill_workers: background threads running the prefill callable.
        keep_finished: finished (released, expired, empty) reservations remembered
            for :meth:`GraphBlockReserver.get`; older ones are forgotten.
    """

    ttl_s: float = 30.0
    source_layer: str = "memories"
    max_blocks_per_reservation: int | None = None
    prefill_workers: int = 1
    keep_finished: int = 1024

    def __post_init__(self) -> None:
        if self.ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")
        if self.max_blocks_per_reservation is not None and self.max_blocks_per_reservation < 0:
            raise ValueError("max_blocks_per_reservation must be >= 0 or None")
        if self.prefill_workers < 1 or self.keep_finished < 0:
            raise ValueError("prefill_workers must be >= 1 and keep_finished >= 0, got "
                             f"{self.prefill_workers} and {self.keep_finished}")


@dataclass(frozen=True, slots=True)
class ReserverStats:
    """Counters since the reserver was created (``hit_rate`` = warmed / reserved)."""

    reserved: int
    partial: int
    empty: int
    warmed: int
    released: int
    expired: int
    active: int
    blocks_held: int
    bytes_held: int
    bytes_reserved: int
    bytes_warmed: int
    prefills_done: int
    prefills_failed: int
    hit_rate: float
