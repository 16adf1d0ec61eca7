"""How :class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` orders layers and finds
the first segment that changed (used by its ``build`` and ``preview``)."""

from __future__ import annotations

from collections.abc import Sequence

from contextkit.prompt.layers import LayerConfig
from contextkit.prompt.markup import PromptSection, StructuredPrompt, render_marked

#: A layer is emitted in the trailing (volatile) message when its learned change
#: rate is at least this.
VOLATILE_THRESHOLD = 0.5

#: The segment between the main and the trailing message.
BOUNDARY = "<trailing message>"


def order_sections(sections: list[PromptSection], rates: dict[str, float],
                   config: LayerConfig, *, reorder: bool,
                   trailing_message: bool) -> tuple[list[PromptSection], list[PromptSection]]:
    """``(main, trailing)``: layers that change on most calls (by ``rates``) go last,
    least volatile first, into the trailing message when ``trailing_message``."""
    if not reorder:
        return sections, []
    index = {s.layer: i for i, s in enumerate(sections)}

    def volatile(s: PromptSection) -> bool:
        return not config.get(s.layer).stable and rates[s.layer] >= VOLATILE_THRESHOLD

    slow = [s for s in sections if not volatile(s)]
    fast = sorted((s for s in sections if volatile(s)),
                  key=lambda s: (round(rates[s.layer], 6), index[s.layer]))
    if trailing_message:
        return slow, fast
    return slow + fast, []


def section_text(section: PromptSection) -> str:
    """A section as ``[LAYER]...[/LAYER]`` text ending with a newline."""
    return render_marked(StructuredPrompt((section,))) + "\n"


def first_difference(old: Sequence[tuple[str, tuple[int, ...]]],
                     new: Sequence[tuple[str, tuple[int, ...]]]) -> str | None:
    """The first segment of ``new`` that differs from ``old`` (``None``: none)."""
    for i, (layer, ids) in enumerate(new):
        if i >= len(old) or old[i] != (layer, ids):
            if layer == BOUNDARY and i < len(old):
                return old[i][0]  # that layer moved into the trailing message
            return layer
    return None if len(old) == len(new) else "layer_removed"
