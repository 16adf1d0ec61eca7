"""What the pipeline returns: built prompts, per-call reports and results
(re-exported by :mod:`contextkit.pipeline.pipeline`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from contextkit.engine.types import GenerationResult, TokenSpan
from contextkit.metrics import ContextkitMetrics
from contextkit.metrics import resolve as resolve_metrics
from contextkit.prompt.markup import PromptSection

__all__ = ["BuiltPrompt", "CallReport", "LazyMetrics", "PipelineResult", "fill_report",
           "tokens_by_layer"]

#: Reports' and metrics' name for prompt tokens of the chat markup (in no layer's span).
_TEMPLATE = "template"


@dataclass
class CallReport:
    """What one pipeline call did to the cache.

    Attributes:
        call: 1-based call number for the tenant.
        stable_hash: SHA-256 (hex) of the stable prefix's tokens.
        stable_changed: the stable prefix differs from the previous call's.
        changed_layers: layers whose text differs from the previous call (all on the
            first call).
        prefix_broken_by: the first segment, in emitted order, that differs from the
            previous call ("first_call" on the first; ``None`` when nothing changed).
        layer_order: main-message layers in emitted order; trailing_layers: layers
            emitted after the conversation.
        layer_tokens: tokens per layer after budgets.
        spilled_lines: lines over their layer's budget, left out of the prompt (they
            go to the pipeline's spillover queue); spilled_by_layer: the same per layer
            (only layers that spilled). The first spill of each layer is also logged as
            a warning, and every spilled line is counted in the metric
            ``contextkit_pipeline_spilled_lines_total{layer}``.
        reused_tokens, computed_tokens, kv_reuse_ratio, ttft_ms, total_ms: from the
            engine (zero until :meth:`CacheAwareContextPipeline.generate` runs); on a
            served model the first three (and ``prompt_tokens``) come from the server's
            usage through :meth:`CacheAwareContextPipeline.record_usage`, and the timings
            stay zero.
        decode_tps: the engine's decode tokens/s (tokens after the first over the time
            after the first); ``None`` for a one-token reply and on a served model.
        blocks_per_tier: this tenant's blocks per cache tier; pinned_blocks: this
            tenant's pinned blocks; blocks_by_layer: this tenant's cached blocks per
            source layer (other tenants' blocks are never counted); all three stay
            empty on a served model, whose blocks are the vLLM connector's.
        chunk_reused_tokens, repaired_tokens: past the cached prefix, tokens whose K/V
            were moved in from chunks cached elsewhere and not recomputed, and those
            recomputed to repair the seams (:mod:`contextkit.engine.chunks`; the first
            are not in ``computed_tokens``); reused_chunks: how many chunks of each
            label were reused.
        reused_by_layer, computed_by_layer: the prompt's reused (prefix and moved
            chunks) and computed tokens per source layer (``user_turn`` for the
            conversation, ``template`` for the chat markup); they sum to
            ``reused_tokens + chunk_reused_tokens`` and ``computed_tokens``.
        pin_state: what happened to the stable prefix's pins: ``"pinned"``,
            ``"unpinned"`` (served without pins: the cap of all tenants' pins was
            reached, or the prefix fills no whole block; ``pin_reason`` says which)
            or ``"off"`` (``pin_stable=False``, before ``generate``, or on a served
            model, where the connector pins the spans flagged by ``request_fields``).
        tier_items: tier-manager items this call's blocks registered or touched (0
            when the pipeline has no ``tiers=``).
        reservation_hit: the key of the memory reservation this call's memories layer
            hit (its blocks prefilled in the background after the previous reply), or
            ``None`` (no ``reservations=``, or no reservation matched).
        served_fields: on a served model, whether the request carried contextkit's
            fields: ``"sent"`` (``kv_transfer_params`` labels and ``cache_salt``),
            ``"plain"`` (the layout only: the server refused them, or
            ``ServedModel(extra_fields=False)``); ``""`` elsewhere.
    """

    call: int
    tenant: str
    stable_hash: str
    stable_changed: bool
    changed_layers: list[str]
    prefix_broken_by: str | None
    layer_order: list[str]
    trailing_layers: list[str]
    layer_tokens: dict[str, int]
    spilled_lines: int
    spilled_by_layer: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    kv_reuse_ratio: float = 0.0
    ttft_ms: float = 0.0
    total_ms: float = 0.0
    decode_tps: float | None = None
    blocks_per_tier: dict[str, int] = field(default_factory=dict)
    pinned_blocks: int = 0
    blocks_by_layer: dict[str, int] = field(default_factory=dict)
    chunk_reused_tokens: int = 0
    repaired_tokens: int = 0
    reused_chunks: dict[str, int] = field(default_factory=dict)
    reused_by_layer: dict[str, int] = field(default_factory=dict)
    computed_by_layer: dict[str, int] = field(default_factory=dict)
    pin_state: str = "off"
    pin_reason: str = ""
    tier_items: int = 0
    reservation_hit: str | None = None
    served_fields: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class BuiltPrompt:
    """A system prompt after budgets and ordering.

    Attributes:
        main: sections of the main system message, in emitted order.
        trailing: sections emitted after the conversation (volatile layers).
        text: the whole system prompt as ``[LAYER]...[/LAYER]`` text (main, then
            trailing): what the wrapped ``build_system_message`` returns.
        report: the call's report (engine fields filled by ``generate``).
        section_ids: token ids of each section's text, by layer.
        section_texts: each section's ``[LAYER]...[/LAYER]`` text, by layer.
        stable_layers: the leading main sections that form the stable prefix.
        section_pieces: per layer, the token counts of its opening tag, each line and
            its closing tag, where tokenizing them apart gives the section's ids
            (absent: they do not); the turn's spans then label each line apart.
    """

    main: tuple[PromptSection, ...]
    trailing: tuple[PromptSection, ...]
    text: str
    report: CallReport
    section_ids: dict[str, tuple[int, ...]]
    section_texts: dict[str, str] = field(default_factory=dict)
    stable_layers: tuple[str, ...] = ()
    section_pieces: dict[str, tuple[int, ...]] = field(default_factory=dict)

    def num_spans(self, sections: Sequence[PromptSection]) -> int:
        """How many spans :func:`~contextkit.pipeline.building.assemble_turn` labels
        ``sections`` with (one per line where the lines tokenize apart, else one)."""
        return sum(len(self.section_pieces.get(s.layer) or (1,)) for s in sections)

    def parts(self) -> tuple[str, str, str]:
        """``(stable, changing, trailing)``: the text split where caching changes.

        ``stable`` is the pinned prefix (the stable layers), ``changing`` the rest of
        the main system message, ``trailing`` the volatile layers. Their
        concatenation is :attr:`text`; any part may be empty. Providers with prompt
        caching get ``stable`` as its own content block with a cache breakpoint.
        """
        n = len(self.stable_layers)
        pieces = ["".join(self.section_texts[s.layer] for s in group)
                  for group in (self.main[:n], self.main[n:], self.trailing)]
        # Sections end with a newline; the whole text does not.
        for i in (2, 1, 0):
            if pieces[i]:
                pieces[i] = pieces[i][:-1]
                break
        return pieces[0], pieces[1], pieces[2]


@dataclass(frozen=True)
class TurnPlan:
    """What a turn would reuse and allocate, known before it runs
    (:meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.plan_turn`).

    Attributes:
        agent: the pipeline's agent (the tenant when it names none).
        tenant: whose blocks the turn reads.
        prompt_tokens: tokens of the assembled prompt.
        reuse_block_ids: cached blocks (either tier) holding the prompt's longest
            cached prefix, in prompt order: what a prefetch should bring to the device.
        need_blocks: blocks the turn will newly allocate (prompt and reply beyond
            that prefix): the device room a prefetch should make.
    """

    agent: str
    tenant: str
    prompt_tokens: int
    reuse_block_ids: tuple[int, ...]
    need_blocks: int


@dataclass
class PipelineResult:
    """A reply with the engine's telemetry and the call report."""

    text: str
    generation: GenerationResult
    report: CallReport


def tokens_by_layer(spans: Sequence[TokenSpan], prompt_tokens: int, reused: int,
                     moved: dict[int, int] | None = None) -> tuple[dict[str, int], dict[str, int]]:
    """Split a prompt's reused (the first ``reused``, plus ``moved[start]`` tokens of
    the span starting there) and computed tokens by the source layer of their span;
    tokens in no span are the chat markup (``template``)."""
    reused_by: dict[str, int] = {}
    computed_by: dict[str, int] = {}
    moved = moved or {}

    def add(layer: str, start: int, end: int) -> None:
        hit = max(0, min(end, reused) - start) + moved.get(start, 0)
        if hit:
            reused_by[layer] = reused_by.get(layer, 0) + hit
        if end - start - hit:
            computed_by[layer] = computed_by.get(layer, 0) + end - start - hit

    pos = 0
    for span in sorted(spans, key=lambda s: s.start):
        if span.start > pos:
            add(_TEMPLATE, pos, span.start)
        add(span.source_layer, span.start, span.end)
        pos = max(pos, span.end)
    if prompt_tokens > pos:
        add(_TEMPLATE, pos, prompt_tokens)
    return reused_by, computed_by


def fill_report(report: CallReport, result: GenerationResult, spans: Sequence[TokenSpan],
                reservation_hit: str | None = None) -> None:
    """Copy the engine's figures of one call into its report."""
    report.prompt_tokens = result.prompt_tokens
    report.reused_tokens = result.reused_tokens
    report.computed_tokens = result.computed_tokens
    report.kv_reuse_ratio = result.kv_reuse_ratio
    report.ttft_ms = result.ttft_ms
    report.total_ms = result.total_ms
    report.decode_tps = result.decode_tps
    report.blocks_per_tier = dict(result.blocks_per_tier)
    report.chunk_reused_tokens = result.chunk_reused_tokens
    report.repaired_tokens = result.repaired_tokens
    report.reused_chunks = {}
    for label in result.reused_chunks:
        report.reused_chunks[label] = report.reused_chunks.get(label, 0) + 1
    report.reused_by_layer, report.computed_by_layer = tokens_by_layer(
        spans, result.prompt_tokens, result.reused_tokens,
        dict(zip(result.reused_chunk_starts, result.reused_chunk_tokens, strict=True)))
    report.reservation_hit = reservation_hit


class LazyMetrics:
    """Where a pipeline's figures go, resolved on first use: ``metrics=`` at
    construction (default: :func:`contextkit.metrics.default_metrics`; ``False``:
    nowhere). Shared by the pipeline and the parts that record for it."""

    def __init__(self, arg: ContextkitMetrics | bool | None) -> None:
        self._arg = arg
        self._metrics: ContextkitMetrics | None = None

    def get(self) -> ContextkitMetrics | None:
        if self._metrics is None and self._arg is not False:
            self._metrics = resolve_metrics(self._arg)
            if self._metrics is None:
                self._arg = False
        return self._metrics
