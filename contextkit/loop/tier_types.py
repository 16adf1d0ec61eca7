"""The vocabulary of the context tier manager: tiers, items, decisions, settings, reports.

Plain value types shared by :class:`contextkit.loop.tiers.ContextTierManager` and
:class:`contextkit.loop.tiers.TierCacheBridge`; their public import path is
:mod:`contextkit.loop.tiers`, which re-exports every name here.
"""

from __future__ import annotations

import enum
import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

__all__ = [
    "KINDS",
    "KIND_CODE",
    "ActReport",
    "Action",
    "BlockSkip",
    "ContextTier",
    "CycleMetrics",
    "CycleReport",
    "Decision",
    "ItemKind",
    "PrefetchReport",
    "SegmentInfo",
    "ThresholdPolicy",
    "ThresholdSuggestion",
    "Thresholds",
    "TierItem",
    "TierManagerConfig",
]


class ContextTier(enum.IntEnum):
    """Where an item stands in the context (not where its bytes are)."""

    PROMPT = 0  # in the prompt; KV in the device tier
    WORKING = 1  # working memory; KV in the host (DDR) tier
    ARCHIVE = 2  # archived; no KV kept


class ItemKind(enum.Enum):
    """What an item is."""

    SPILLED_LINE = "spilled_line"
    MEMORY = "memory"
    RESERVATION = "reservation"
    SEGMENT = "segment"


#: Item kinds in code order: a table row stores ``KIND_CODE[kind]``, read back by index.
KINDS = tuple(ItemKind)
KIND_CODE = {kind: code for code, kind in enumerate(KINDS)}


class Action(enum.Enum):
    """A tier change. Promote: one tier up; demote: 0 -> 1; archive: 1 -> 2."""

    PROMOTE = "promote"
    DEMOTE = "demote"
    ARCHIVE = "archive"


@dataclass(frozen=True, slots=True)
class Thresholds:
    """Score thresholds, ``0 <= archive < demote < promote <= 1``."""

    promote: float = 0.6
    demote: float = 0.35
    archive: float = 0.15

    def __post_init__(self) -> None:
        if not 0.0 <= self.archive < self.demote < self.promote <= 1.0:
            raise ValueError(f"thresholds must satisfy 0 <= archive < demote < promote <= 1, "
                             f"got {self}")


@dataclass(frozen=True, slots=True)
class ThresholdPolicy:
    """How DDR occupancy moves the thresholds (one ``step`` per cycle).

    Below ``low_water`` the host tier has room: the promotion threshold drops (so
    more items come back from the archive into working memory) and the demotion
    and archive thresholds relax toward their configured values. Above
    ``high_water`` the demotion threshold rises, and the archive threshold with it
    so that working memory sheds blocks from DDR; the promotion threshold relaxes
    toward its configured value. In between nothing changes.
    """

    low_water: float = 0.5
    high_water: float = 0.8
    step: float = 0.05
    min_promote: float = 0.3
    max_demote: float = 0.55
    min_gap: float = 0.05

    def __post_init__(self) -> None:
        if not 0.0 <= self.low_water < self.high_water <= 1.0 or self.step <= 0:
            raise ValueError(f"need 0 <= low_water < high_water <= 1 and step > 0, got {self}")

    def suggest(self, current: Thresholds, base: Thresholds,
                host_occupancy: float) -> tuple[Thresholds, str] | None:
        """The thresholds for the next cycle and why, or None inside the band."""
        gap, step = self.min_gap, self.step
        if host_occupancy < self.low_water:
            archive = (current.archive if current.archive <= base.archive
                       else max(base.archive, current.archive - step))
            demote = (current.demote if current.demote <= base.demote
                      else max(base.demote, current.demote - step, archive + gap))
            promote = min(current.promote, max(self.min_promote, demote + gap,
                                               current.promote - step))
            why = f"host tier {host_occupancy:.0%} full < {self.low_water:.0%}: lower promotion"
        elif host_occupancy > self.high_water:
            promote = (current.promote if current.promote >= base.promote
                       else min(base.promote, current.promote + step))
            demote = max(current.demote, min(self.max_demote, promote - gap,
                                             current.demote + step))
            archive = max(current.archive, min(demote - gap, current.archive + step))
            why = f"host tier {host_occupancy:.0%} full > {self.high_water:.0%}: raise demotion"
        else:
            return None
        return Thresholds(round(promote, 6), round(demote, 6), round(archive, 6)), why


@dataclass(frozen=True, slots=True)
class ThresholdSuggestion:
    """Thresholds the bridge suggested after a cycle, and whether they were applied."""

    host_occupancy: float
    before: Thresholds
    after: Thresholds
    reason: str
    applied: bool


@dataclass(frozen=True, slots=True)
class TierManagerConfig:
    """Settings of a :class:`ContextTierManager`; defaults live here only.

    Args:
        interval_s: seconds between scheduled cycles.
        misfire_grace_s: how late a scheduled cycle may still run.
        frequency_weight: weight of the access-frequency term of the score (the three
            weights sum to 1).
        recency_weight: weight of the recency term.
        relevance_weight: weight of the relevance term.
        recency_half_life_s: idle time that halves the recency term.
        frequency_half_life_s: time that halves the access count.
        frequency_scale: access count that gives ``1 - 1/e`` of the frequency term.
        thresholds: initial (and base) thresholds.
        max_prompt_items: most items in tier 0 (``None``: no limit).
        max_moves_per_cycle: most decisions per cycle, largest margins first.
        max_spill_drain: most spilled lines taken per cycle.
        spilled_line_tier: tier of newly spilled lines.
        history: cycles kept by :meth:`ContextTierManager.metrics`.
        protect_horizon: :meth:`ContextTierManager.prefetch` never archives blocks of
            agents due within this many steps (0: only the prefetched agent's).
        lookahead_weight: weight of the due term Orient adds with a look-ahead set:
            ``lookahead_weight / steps`` for an item of an agent due in ``steps``.
    """

    interval_s: float = 60.0
    misfire_grace_s: float = 30.0
    frequency_weight: float = 0.4
    recency_weight: float = 0.35
    relevance_weight: float = 0.25
    recency_half_life_s: float = 600.0
    frequency_half_life_s: float = 1800.0
    frequency_scale: float = 3.0
    thresholds: Thresholds = field(default_factory=Thresholds)
    max_prompt_items: int | None = None
    max_moves_per_cycle: int | None = 10_000
    max_spill_drain: int = 10_000
    spilled_line_tier: ContextTier = ContextTier.WORKING
    history: int = 256
    protect_horizon: int = 2
    lookahead_weight: float = 0.5

    def __post_init__(self) -> None:
        numbers = {name: value for name, value in asdict(self).items()
                   if isinstance(value, float) and name != "thresholds"}
        bad = {name: value for name, value in numbers.items() if not math.isfinite(value)}
        if bad:
            raise ValueError(f"tier manager settings must be finite numbers, got {bad}")
        if self.misfire_grace_s < 0:
            raise ValueError(f"misfire_grace_s must be >= 0, got {self.misfire_grace_s}")
        weights = (self.frequency_weight, self.recency_weight, self.relevance_weight)
        if min(weights) < 0 or not math.isclose(sum(weights), 1.0, abs_tol=1e-6):
            raise ValueError(f"score weights must be >= 0 and sum to 1, got {weights}")
        if min(self.interval_s, self.recency_half_life_s, self.frequency_half_life_s,
               self.frequency_scale) <= 0:
            raise ValueError("interval_s, half-lives and frequency_scale must be > 0")
        if self.history < 1 or self.max_spill_drain < 0:
            raise ValueError("history must be >= 1 and max_spill_drain >= 0")
        if self.protect_horizon < 0 or self.lookahead_weight < 0:
            raise ValueError(f"protect_horizon and lookahead_weight must be >= 0, got "
                             f"{self.protect_horizon} and {self.lookahead_weight}")


@dataclass(frozen=True, slots=True)
class TierItem:
    """A snapshot of one item."""

    item_id: str
    kind: ItemKind
    tier: ContextTier
    tenant: str
    block_ids: tuple[int, ...]
    relevance: float
    frequency: float
    last_access: float
    score: float
    payload: object = None


class Decision(NamedTuple):
    """One tier change decided by a cycle (a named tuple: cycles make thousands)."""

    item_id: str
    kind: ItemKind
    action: Action
    from_tier: ContextTier
    to_tier: ContextTier
    score: float
    threshold: float
    block_ids: tuple[int, ...] = ()
    tenant: str = "default"
    payload: object = None

    @property
    def reason(self) -> str:
        op = ">=" if self.action is Action.PROMOTE else "<"
        return (f"{self.action.value} {self.item_id} tier {int(self.from_tier)}->"
                f"{int(self.to_tier)}: score {self.score:.3f} {op} {self.action.value} "
                f"threshold {self.threshold:.3f}")


@dataclass(frozen=True, slots=True)
class BlockSkip:
    """A block the bridge left alone. ``reason``: pinned, in_use, gone, tier_full, error."""

    block_id: int
    item_id: str
    action: Action
    reason: str
    detail: str = ""


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """Payload of a :attr:`ItemKind.SEGMENT` item: its prompt layer and its agents.

    ``agents`` are the agents whose latest registered call holds the segment's blocks
    (replaced, never mutated, when that changes); an empty set means no agent's
    current prompt uses it any more.
    """

    layer: str
    agents: frozenset[str] = frozenset()


@dataclass(slots=True)
class PrefetchReport:
    """What :meth:`ContextTierManager.prefetch` did before an agent's turn.

    ``warmed``, ``spilled`` and ``removed`` are block ids moved host -> device, device
    -> host, and freed from the host tier; ``bytes_moved`` counts every block the
    cache copied meanwhile (evictions the warm caused included). ``started_at`` and
    ``finished_at`` are :func:`time.perf_counter` stamps.
    """

    agent: str
    warmed: list[int] = field(default_factory=list)
    spilled: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    bytes_moved: int = 0
    duration_s: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    skipped: list[BlockSkip] = field(default_factory=list)  # pinned, in_use, tier_full

    @property
    def num_blocks_moved(self) -> int:
        return len(self.warmed) + len(self.spilled)


@dataclass(slots=True)
class ActReport:
    """What the bridge did with one cycle's decisions."""

    warmed: list[int] = field(default_factory=list)
    spilled: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    gone: list[int] = field(default_factory=list)  # freed by someone else meanwhile
    skipped: list[BlockSkip] = field(default_factory=list)
    reservations: list[str] = field(default_factory=list)
    bytes_moved: int = 0
    bytes_freed: int = 0


@dataclass(frozen=True, slots=True)
class CycleMetrics:
    """Measurements of one OODA cycle (JSON-able through :meth:`to_dict`)."""

    cycle: int
    started_at: float
    duration_s: float
    phase_ms: dict[str, float]
    num_items: int
    items_by_tier: dict[str, int]
    actions: dict[str, int]
    blocks_moved: dict[str, int]
    blocks_skipped: dict[str, int]
    bytes_moved: int
    bytes_freed: int
    spilled_lines: int
    accesses_observed: int
    host_occupancy: float | None
    device_occupancy: float | None
    thresholds_before: Thresholds
    thresholds_after: Thresholds
    threshold_reason: str = ""
    #: Prefetches since the previous cycle: ``calls``, ``warmed``, ``spilled``,
    #: ``removed`` (blocks); empty when none ran.
    prefetch: dict[str, int] = field(default_factory=dict)

    @property
    def num_blocks_moved(self) -> int:
        return sum(self.blocks_moved.values())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True, slots=True)
class CycleReport:
    """Everything one cycle produced: metrics, decisions, the bridge's report."""

    metrics: CycleMetrics
    decisions: tuple[Decision, ...]
    act: ActReport
    suggestion: ThresholdSuggestion | None

