"""What the pipeline calls around a turn, and what those calls may use of it: the
Protocols the loop above implements (:class:`TurnHooks`: the pipeline's
``reservations=``) and reaches the pipeline through (:class:`TurnPipeline`), so the
pipeline never imports the loop.

:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` implements
:class:`TurnPipeline`; :class:`~contextkit.loop.reservations.MemoryReservations`
implements :class:`TurnHooks`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from contextkit.engine.engine import Engine
    from contextkit.engine.types import TokenSpan
    from contextkit.pipeline.registration import SegmentRegistry
    from contextkit.pipeline.reports import BuiltPrompt
    from contextkit.prompt.layers import LayerConfig

__all__ = ["TurnHooks", "TurnPipeline"]


class TurnPipeline(Protocol):
    """The pipeline as a turn hook sees it: its engine, layers and tier registry, a
    turn's token layout, and side-effect-free builds."""

    @property
    def engine(self) -> Engine | None:
        """The embedded engine (``None``: none, the hooks have nothing to prefill)."""
        ...

    @property
    def config(self) -> LayerConfig:
        """The pipeline's layers."""
        ...

    @property
    def tiers(self) -> SegmentRegistry | None:
        """The tier manager the pipeline registers its calls with, if any."""
        ...

    def assemble(self, user_message: str | None, history: Sequence[tuple[str, str]] = (), *,
                 tenant: str | None = None, built: BuiltPrompt | None = None,
                 user_order: bool = False, after: Sequence[tuple[str, str]] = (),
                 ) -> tuple[list[int], list[TokenSpan], int]:
        """A chat turn's token ids, layer spans and the stable prefix's end."""
        ...

    def preview(self, raw: object, *, tenant: str | None = None,
                changed: Sequence[str] | None = None) -> BuiltPrompt:
        """What a build of ``raw`` would return now, without its side effects."""
        ...


class TurnHooks(Protocol):
    """Work around an engine turn (the pipeline's ``reservations=``):
    :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.generate` calls
    :meth:`before_turn` before the engine runs and :meth:`after_reply` after."""

    def before_turn(self, built: BuiltPrompt, *, tenant: str) -> str | None:
        """Stop background work before the turn; returns the key of the reservation the
        turn's prompt hits (``CallReport.reservation_hit``), or ``None``."""
        ...

    def after_reply(self, pipeline: TurnPipeline, history: Sequence[tuple[str, str]], *,
                    tenant: str, built: BuiltPrompt) -> Any:
        """Queue work for the next turn; ``history`` includes the exchange just finished."""
        ...
