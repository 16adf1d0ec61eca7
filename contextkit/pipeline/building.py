"""A pipeline's prompts: budgets, change rates and layer order applied to what
``build_system_message`` returned (:class:`PromptBuilder`), and a chat turn's token
layout (:func:`assemble_turn`). :class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline`
owns a builder; its ``build``, ``preview`` and ``assemble`` delegate here."""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from contextkit.engine.types import TokenSpan
from contextkit.pipeline.reports import BuiltPrompt, CallReport
from contextkit.pipeline.tenancy import TenantViews
from contextkit.prompt.chatml import ChatML
from contextkit.prompt.layers import LayerConfig
from contextkit.prompt.markup import (
    PromptSection,
    SpilloverQueue,
    coerce_prompt,
    synthesize_for_budget,
)
from contextkit.prompt.ordering import BOUNDARY, first_difference, order_sections, section_text

if TYPE_CHECKING:
    from contextkit.metrics import ContextkitMetrics

logger = logging.getLogger("contextkit.pipeline.pipeline")

#: Token ids of a text (the engine's or the served model's tokenizer).
Encode = Callable[[str], list[int]]

_ROLES = ("user", "assistant", "system", "tool")


class PromptBuilder:
    """Builds a pipeline's prompts for its tenants (see
    :meth:`CacheAwareContextPipeline.build`).

    Args:
        config: the pipeline's layers.
        encode: the attached tokenizer (``None`` in pass-through mode, which builds
            nothing).
        tenants: the pipeline's tenants, whose change rates and last builds a build
            reads and (committed) updates, under their lock.
        spillover: where over-budget lines of a committed build go.
        expanded: apply the expanded layer budgets (a cache is attached).
        reorder, trailing_message, alpha: the pipeline's ``reorder``,
            ``trailing_message`` and ``volatility_alpha``.
        metrics: where committed builds are recorded (``None`` from it: nowhere).
    """

    def __init__(self, config: LayerConfig, encode: Encode | None, tenants: TenantViews,
                 spillover: SpilloverQueue, *, expanded: bool, reorder: bool,
                 trailing_message: bool, alpha: float,
                 metrics: Callable[[], ContextkitMetrics | None]) -> None:
        self.config = config
        self.encode = encode
        self.tenants = tenants
        self.spillover = spillover
        self.expanded = expanded
        self.reorder = reorder
        self.trailing_message = trailing_message
        self.alpha = alpha
        self.metrics = metrics
        self._spill_warned: set[str] = set()
        self._warn_lock = threading.Lock()

    def _count_tokens(self, text: str) -> int:
        return len(self._encode(text))

    def _encode(self, text: str) -> list[int]:
        assert self.encode is not None
        return self.encode(text)

    def build(self, raw: object, tenant: str, *, commit: bool,
              changed: Sequence[str] | None = None) -> BuiltPrompt:
        """``raw`` built for ``tenant``; ``commit``: record it (the tenant's change rates,
        last build, spilled lines and metrics), else a preview without side effects."""
        prompt = coerce_prompt(raw, self.config)
        count = self._count_tokens
        sections: list[PromptSection] = []
        spilled: dict[str, int] = {}
        layer_tokens: dict[str, int] = {}
        for section in prompt.sections:
            spec = self.config.get(section.layer)
            budget = spec.budget_for(self.expanded)
            kept, over = synthesize_for_budget(section.lines, budget, count, layer=spec.name,
                                               spillover=self.spillover if commit else None)
            if over and commit:
                spilled[spec.name] = spilled.get(spec.name, 0) + len(over)
                self._warn_spill(spec.name, len(over), len(section.lines), budget)
            sections.append(PromptSection(spec.name, tuple(kept)))
            layer_tokens[spec.name] = count("\n".join(line.text for line in kept))
        with self.tenants.lock:
            state = self.tenants.state(tenant) if commit else self.tenants.peek(tenant)
            # Each section is rendered and tokenized once per call; the hash, the
            # change report and assemble() all reuse these ids.
            texts = {s.layer: section_text(s) for s in sections}
            section_ids = {layer: tuple(self._encode(t)) for layer, t in texts.items()}
            pieces = {s.layer: _line_pieces(s, section_ids[s.layer], self._encode)
                      for s in sections}
            first = state.calls == 0
            diff = [name for name, text in texts.items()
                    if first or state.last_texts.get(name) != text]
            rates = dict(state.rates)
            if not first:
                for name in texts:
                    hit = 1.0 if name in (diff if changed is None else changed) else 0.0
                    rates[name] = (1 - self.alpha) * rates[name] + self.alpha * hit
            main, trailing = order_sections(sections, rates, self.config, reorder=self.reorder,
                                            trailing_message=self.trailing_message)
            stable_ids = self._encode(ChatML.open("system"))
            stable_layers: list[str] = []
            for sec in main:
                if not self.config.get(sec.layer).stable:
                    break
                stable_ids += section_ids[sec.layer]
                stable_layers.append(sec.layer)
            stable_hash = hashlib.sha256(
                struct.pack(f"<{len(stable_ids)}i", *stable_ids)).hexdigest()
            # The boundary between the main and the trailing message is a segment
            # too: a layer moving across it changes the token layout.
            segments = [*((sec.layer, section_ids[sec.layer]) for sec in main),
                        (BOUNDARY, ()),
                        *((sec.layer, section_ids[sec.layer]) for sec in trailing)]
            broken = first_difference(state.last_segments, segments) if not first \
                else "first_call"
            report = CallReport(
                call=state.calls + 1, tenant=tenant, stable_hash=stable_hash,
                stable_changed=not first and stable_hash != state.stable_hash,
                changed_layers=diff, prefix_broken_by=broken,
                layer_order=[s.layer for s in main], trailing_layers=[s.layer for s in trailing],
                layer_tokens=layer_tokens, spilled_lines=sum(spilled.values()),
                spilled_by_layer=spilled)
            # Sections end with a newline; the returned text does not.
            text = "".join(texts[sec.layer] for sec in (*main, *trailing))[:-1]
            built = BuiltPrompt(tuple(main), tuple(trailing), text, report, section_ids,
                                texts, tuple(stable_layers), pieces)
            if not commit:
                return built
            state.rates = rates
            state.calls += 1
            state.last_texts = texts
            state.last_segments = segments
            state.stable_hash = stable_hash
            state.last = built
        metrics = self.metrics()
        if metrics is not None:
            metrics.record_build(report)
        return built

    def _warn_spill(self, layer: str, spilled: int, lines: int, budget: int) -> None:
        """Warn the first time a layer spills (the report counts every call)."""
        with self._warn_lock:
            if layer in self._spill_warned:
                return
            self._spill_warned.add(layer)
        logger.warning(
            "layer %s: %d of its %d lines are over its budget of %d tokens and were "
            "spilled (left out of the prompt; see CallReport.spilled_by_layer). Shorten "
            "the layer or raise its budget (LayerConfig.with_budgets); this warning is "
            "given once per layer", layer, spilled, lines, budget)


def section_pieces(layer: str, lines: Sequence[str]) -> list[str]:
    """The texts a layer's section is made of, in order: its opening tag, each line with
    its newline, its closing tag."""
    tag = layer.upper()
    return [f"[{tag}]\n", *(text + "\n" for text in lines), f"[/{tag}]\n"]


def _line_pieces(section: PromptSection, ids: Sequence[int],
                 encode: Encode) -> tuple[int, ...]:
    """Token counts of a section's pieces (its opening tag, each line, its closing
    tag, each with its newline) when tokenizing them apart gives the section's own ids
    (so each line is a chunk by content: :mod:`contextkit.engine.chunks`); ``()``
    otherwise."""
    texts = section_pieces(section.layer, [line.text for line in section.lines])
    out: list[int] = []
    pos = 0
    for text in texts:
        piece = encode(text)
        if tuple(ids[pos : pos + len(piece)]) != tuple(piece):
            return ()
        out.append(len(piece))
        pos += len(piece)
    return tuple(out) if pos == len(ids) else ()


def layer_spans(spans: Sequence[TokenSpan]) -> list[TokenSpan]:
    """``spans`` with each run of touching spans of one label (a layer's lines) merged:
    one span per layer and per turn, as the served path labels a request."""
    out: list[TokenSpan] = []
    for span in sorted(spans, key=lambda s: s.start):
        last = out[-1] if out else None
        if (last is not None and last.end == span.start and span.source_layer != "user_turn"
                and last.source_layer == span.source_layer):
            out[-1] = TokenSpan(last.start, span.end, last.source_layer,
                                max(last.importance, span.importance))
        else:
            out.append(span)
    return out


def assemble_turn(built: BuiltPrompt, config: LayerConfig, encode: Encode,
                  user_message: str | None, history: Sequence[tuple[str, str]] = (), *,
                  user_order: bool = False, after: Sequence[tuple[str, str]] = (),
                  ) -> tuple[list[int], list[TokenSpan], int]:
    """Token ids of a chat turn, the layer spans, and where the stable prefix ends (see
    :meth:`CacheAwareContextPipeline.assemble`).

    Raises:
        ValueError: a message role other than user, assistant, system or tool.
    """
    main, trailing = list(built.main), list(built.trailing)
    if user_order:
        order = {spec.name: i for i, spec in enumerate(config)}
        main, trailing = sorted(main + trailing, key=lambda s: order[s.layer]), []
    ids: list[int] = []
    spans: list[TokenSpan] = []
    stable_end = 0
    in_stable = True

    def add(text: str, layer: str | None = None, importance: float = 0.5,
            piece: Sequence[int] | None = None) -> None:
        piece = encode(text) if piece is None else piece
        if layer is not None:
            spans.append(TokenSpan(len(ids), len(ids) + len(piece), layer, importance))
        ids.extend(piece)

    def add_system(sections: Sequence[PromptSection]) -> None:
        nonlocal stable_end, in_stable
        add(ChatML.open("system"))
        for s in sections:
            spec = config.get(s.layer)
            imp = max((line.importance for line in s.lines), default=0.5)
            section = built.section_ids[s.layer]
            at = 0
            # one span per line where the lines tokenize apart (each is a chunk by
            # content), else one for the section; the same label either way
            for size in built.section_pieces.get(s.layer) or (len(section),):
                add("", spec.source, imp, piece=section[at : at + size])
                at += size
            if in_stable and spec.stable:
                stable_end = len(ids)
            else:
                in_stable = False
        add(ChatML.close())

    def add_turns(turns: Sequence[tuple[str, str]]) -> None:
        for role, text in turns:
            if role not in _ROLES:
                raise ValueError(f"message role must be one of {', '.join(_ROLES)}, "
                                 f"got {role!r}")
            add(ChatML.open(role))
            add(text + ChatML.close(), "user_turn", 0.3)

    add_system(main)
    in_stable = False
    add_turns(history)
    if trailing:
        add_system(trailing)
    if user_message is not None:
        add_turns([("user", user_message)])
    add_turns(after)
    add(ChatML.open("assistant"))
    return ids, spans, stable_end
