"""The prompt room: what an agent's layered system prompt is made of.

Owns the layers and their budgets (``layers``), structured prompts and the
``[LAYER]...[/LAYER]`` markup with the budget compressor (``markup``), the cache-friendly
order of layers (``ordering``) and the ChatML pieces token ranges are assembled from
(``chatml``). Pure Python, no torch: the pipeline, the loop and the integrations build
on it; it imports nothing of contextkit but :mod:`contextkit.config`.
"""

from __future__ import annotations

from contextkit.prompt.layers import DEFAULT_LAYERS, LayerConfig, LayerSpec, UnknownLayerError
from contextkit.prompt.markup import (
    PromptFormatError,
    PromptLine,
    PromptSection,
    SpilledLine,
    SpilloverQueue,
    StructuredPrompt,
    coerce_prompt,
    has_markers,
    parse_marked,
    render_marked,
    synthesize_for_budget,
)

__all__ = [
    "DEFAULT_LAYERS",
    "LayerConfig",
    "LayerSpec",
    "PromptFormatError",
    "PromptLine",
    "PromptSection",
    "SpilledLine",
    "SpilloverQueue",
    "StructuredPrompt",
    "UnknownLayerError",
    "coerce_prompt",
    "has_markers",
    "parse_marked",
    "render_marked",
    "synthesize_for_budget",
]
