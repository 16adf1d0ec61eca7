"""A layered system prompt split where caching changes, for the framework integrations.

:func:`split_system_text` splits it into the stable prefix, the changing layers and the
trailing volatile layers: separate content blocks, so that providers' own prompt caches
can cache the stable one. :func:`layers_in` names the layers a text holds. Nothing here
imports LangChain or LlamaIndex.
"""

from __future__ import annotations

from dataclasses import dataclass

from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline
from contextkit.prompt.markup import coerce_prompt, has_markers, render_marked

__all__ = ["SystemParts", "layers_in", "split_system_text"]


@dataclass(frozen=True)
class SystemParts:
    """A system prompt split where caching changes.

    ``stable + changing + trailing`` is the whole text. ``built`` is the pipeline's
    result when a cache is attached (``None`` in pass-through mode).
    """

    stable: str
    changing: str
    trailing: str
    built: BuiltPrompt | None = None


def split_system_text(pipeline: CacheAwareContextPipeline, raw: object,
                      tenant: str | None = None) -> SystemParts:
    """Run what ``build_system_message`` returned through the pipeline and split it.

    Attached: :meth:`~CacheAwareContextPipeline.build` (budgets, volatility order)
    then :meth:`BuiltPrompt.parts`. Pass-through: the text is exactly what the
    function returned (a mapping or StructuredPrompt is rendered as markers), split
    after the leading stable layers.

    Raises:
        PromptFormatError: malformed markers or an unsupported return type.
    """
    if pipeline.attached:
        built = pipeline.build(raw, tenant=tenant)
        stable, changing, trailing = built.parts()
        return SystemParts(stable, changing, trailing, built)
    prompt = coerce_prompt(raw, pipeline.config)
    text = raw if isinstance(raw, str) else render_marked(prompt)
    lead = []
    for section in prompt.sections:
        if not pipeline.config.get(section.layer).stable:
            break
        lead.append(section)
    if not lead or len(lead) == len(prompt.sections):
        return SystemParts("", text, "")
    head = render_marked(type(prompt)(tuple(lead))) + "\n"
    if not text.startswith(head):  # unusual spacing in the user's string: one block
        return SystemParts("", text, "")
    return SystemParts(head, text[len(head):], "")


def layers_in(text: str, pipeline: CacheAwareContextPipeline | None = None) -> list[str]:
    """Layer names whose markers open in ``text`` (in order)."""
    from contextkit.prompt.layers import LayerConfig

    config = pipeline.config if pipeline is not None else LayerConfig()
    if not has_markers(text, config):
        return []
    out = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("[") and s.endswith("]") and not s.startswith("[/"):
            name = s[1:-1].lower()
            if name in config:
                out.append(config.get(name).name)
    return out
