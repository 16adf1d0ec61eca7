"""Layered prompts: structured sections or ``[LAYER]...[/LAYER]`` strings, and budgets.

A user's ``build_system_message`` may return either form; both become a
:class:`StructuredPrompt`. :func:`synthesize_for_budget` is the deterministic
extractive compressor that fits a layer into its token budget, keeping the most
important lines in their original order and spilling the rest.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Real

from contextkit.prompt.layers import LayerConfig, shown

__all__ = [
    "PromptFormatError",
    "PromptLine",
    "PromptSection",
    "SpilledLine",
    "SpilloverQueue",
    "StructuredPrompt",
    "coerce_prompt",
    "has_markers",
    "parse_marked",
    "render_marked",
    "synthesize_for_budget",
]

_MARKER = re.compile(r"^\s*\[(/?)([A-Za-z][A-Za-z0-9_]*)\]\s*$")


class PromptFormatError(ValueError):
    """A prompt that cannot be read as layers; the message says where and why."""


@dataclass(frozen=True, slots=True)
class PromptLine:
    """One line of a layer with its importance (0-1) for budget compression."""

    text: str
    importance: float = 0.5

    def __post_init__(self) -> None:
        if not isinstance(self.text, str):
            raise PromptFormatError(f"the text must be a str, got {shown(self.text)}")
        if isinstance(self.importance, bool) or not isinstance(self.importance, Real):
            raise PromptFormatError(f"importance must be a number in [0, 1], got "
                                    f"{shown(self.importance)} for line {self.text[:40]!r}")
        object.__setattr__(self, "importance", float(self.importance))
        if not 0.0 <= self.importance <= 1.0:
            raise PromptFormatError(f"importance must be within [0, 1], got {self.importance} "
                                    f"for line {self.text[:40]!r}")
        if "\n" in self.text:
            raise PromptFormatError(f"a PromptLine holds one line; split {self.text[:40]!r} "
                                    "on newlines")


@dataclass(frozen=True, slots=True)
class PromptSection:
    """The lines of one layer, in order."""

    layer: str
    lines: tuple[PromptLine, ...]


@dataclass(frozen=True, slots=True)
class StructuredPrompt:
    """A system prompt as ordered layer sections."""

    sections: tuple[PromptSection, ...]

    def section(self, layer: str) -> PromptSection | None:
        return next((s for s in self.sections if s.layer == layer), None)


def parse_marked(text: str, config: LayerConfig) -> StructuredPrompt:
    """Read a ``[LAYER]...[/LAYER]`` string (markers on their own lines).

    Every line belongs to exactly one layer; lines get importance 0.5.

    Raises:
        PromptFormatError: an unknown layer marker, an unbalanced or nested marker, a
            layer given twice, or text outside any layer (with its line number).
    """
    sections: list[PromptSection] = []
    seen: set[str] = set()
    current: str | None = None
    opened_at = 0
    lines: list[PromptLine] = []
    for number, raw in enumerate(text.splitlines(), start=1):
        match = _MARKER.match(raw)
        if match is None:
            if current is None:
                if raw.strip():
                    raise PromptFormatError(
                        f"line {number} is outside any layer: {raw.strip()[:60]!r}; wrap it "
                        "in a [LAYER]...[/LAYER] block")
                continue
            lines.append(PromptLine(raw))
            continue
        closing, name = match.group(1) == "/", match.group(2)
        if name.lower() not in config:
            known = ", ".join(f"[{s.name.upper()}]" for s in config)
            raise PromptFormatError(f"line {number}: unknown layer marker [{'/' if closing else ''}"
                                    f"{name}]; known: {known}")
        layer = config.get(name).name
        if not closing:
            if current is not None:
                raise PromptFormatError(f"line {number}: [{name}] opens inside [{current.upper()}]"
                                        f" (opened on line {opened_at}); close it first")
            if layer in seen:
                raise PromptFormatError(f"line {number}: layer {layer!r} appears twice; merge "
                                        "its blocks")
            current, opened_at, lines = layer, number, []
            continue
        if current != layer:
            where = f"inside [{current.upper()}]" if current else "with no open layer"
            raise PromptFormatError(f"line {number}: [/{name}] closes {where}; markers must "
                                    "balance")
        sections.append(PromptSection(layer, tuple(lines)))
        seen.add(layer)
        current = None
    if current is not None:
        raise PromptFormatError(f"[{current.upper()}] opened on line {opened_at} is never "
                                f"closed; add [/{current.upper()}]")
    return StructuredPrompt(tuple(sections))


def has_markers(text: str, config: LayerConfig) -> bool:
    """Whether ``text`` contains at least one known ``[LAYER]`` marker line.

    Plain system prompts (no markers) are passed through untouched by the
    integrations; marked ones go through the pipeline.
    """
    for raw in text.splitlines():
        match = _MARKER.match(raw)
        if match is not None and match.group(2).lower() in config:
            return True
    return False


def render_marked(prompt: StructuredPrompt) -> str:
    """The marker-string form of a prompt (inverse of :func:`parse_marked`)."""
    out: list[str] = []
    for section in prompt.sections:
        tag = section.layer.upper()
        out.append(f"[{tag}]")
        out.extend(line.text for line in section.lines)
        out.append(f"[/{tag}]")
    return "\n".join(out)


LineLike = str | PromptLine | tuple[str, float]

_LINE_FORMS = "a str, a (str, importance) pair or a PromptLine"


def _line(item: object) -> PromptLine:
    if isinstance(item, PromptLine):
        return item
    if isinstance(item, str):
        return PromptLine(item)
    if not isinstance(item, tuple):
        raise PromptFormatError(f"expected {_LINE_FORMS}, got {shown(item)}")
    if len(item) != 2:
        raise PromptFormatError(f"expected {_LINE_FORMS}, got a tuple of {len(item)}")
    text, importance = item
    return PromptLine(text, importance)


def _section(layer: str, items: object) -> PromptSection:
    """One layer of a ``{layer: lines}`` mapping, each error naming layer and line."""
    if isinstance(items, str):
        return PromptSection(layer, tuple(PromptLine(t) for t in items.splitlines()))
    if isinstance(items, (bytes, bytearray, Mapping)) or not isinstance(items, Iterable):
        raise PromptFormatError(f"layer {layer!r}: expected a string or a list of lines, "
                                f"got {type(items).__name__} (each line {_LINE_FORMS})")
    lines = []
    for number, item in enumerate(items, start=1):
        try:
            lines.append(_line(item))
        except PromptFormatError as exc:
            raise PromptFormatError(f"layer {layer!r}, line {number}: {exc}") from None
    return PromptSection(layer, tuple(lines))


def _unknown_layer(layer: str, config: LayerConfig) -> PromptFormatError:
    known = ", ".join(s.name for s in config)
    return PromptFormatError(f"unknown layer {layer!r}; known layers: {known}")


def coerce_prompt(value: object, config: LayerConfig) -> StructuredPrompt:
    """Accept what ``build_system_message`` returns and make a StructuredPrompt.

    Accepted: a :class:`StructuredPrompt`; a marker string; a mapping
    ``{layer: [line | (text, importance) | PromptLine, ...] | str}``.

    Raises:
        PromptFormatError: anything else, unknown layers (names the known ones), or a
            malformed layer or line (names the layer, the line number and what was
            expected).
    """
    if isinstance(value, StructuredPrompt):
        for section in value.sections:
            if section.layer not in config:
                raise _unknown_layer(section.layer, config)
        return value
    if isinstance(value, str):
        return parse_marked(value, config)
    if isinstance(value, Mapping):
        sections = []
        for layer, items in value.items():
            if not isinstance(layer, str):
                raise PromptFormatError(f"layer names must be str, got {shown(layer)}; use "
                                        "the layer's name, e.g. {'memories': [...]}")
            if layer not in config:
                raise _unknown_layer(layer, config)
            name = config.get(layer).name
            sections.append(_section(name, items))
        return StructuredPrompt(tuple(sections))
    raise PromptFormatError(
        f"build_system_message returned {type(value).__name__}; return a string with "
        "[LAYER]...[/LAYER] markers, a {layer: lines} mapping, or a StructuredPrompt")


@dataclass(frozen=True, slots=True)
class SpilledLine:
    """A line that did not fit its layer's budget."""

    layer: str
    text: str
    importance: float
    spilled_at: float


@dataclass
class SpilloverQueue:
    """Bounded, thread-safe queue of spilled lines; the tier manager drains it."""

    maxlen: int = 10_000
    _items: deque[SpilledLine] = field(init=False)
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    dropped: int = 0

    def __post_init__(self) -> None:
        self._items = deque(maxlen=self.maxlen)

    def put(self, lines: Iterable[SpilledLine]) -> None:
        with self._lock:
            for line in lines:
                if len(self._items) == self.maxlen:
                    self.dropped += 1  # the oldest falls off
                self._items.append(line)

    def drain(self, limit: int | None = None) -> list[SpilledLine]:
        """Take up to ``limit`` lines (all by default), oldest first."""
        with self._lock:
            count = len(self._items) if limit is None else min(limit, len(self._items))
            return [self._items.popleft() for _ in range(count)]

    def __len__(self) -> int:
        return len(self._items)


def synthesize_for_budget(
    lines: Sequence[PromptLine],
    budget: int,
    count_tokens: Callable[[str], int],
    *,
    layer: str = "",
    spillover: SpilloverQueue | None = None,
) -> tuple[list[PromptLine], list[PromptLine]]:
    """Keep the most important lines that fit ``budget`` tokens, in original order.

    Lines are considered by importance (ties: earlier first); each is kept if it fits
    the tokens left (one extra token per line for its newline), otherwise spilled.
    Deterministic, so the same input always yields the same text and prefix hash.

    Returns:
        ``(kept, spilled)``, both in original order. Spilled lines also go to
        ``spillover`` when given.

    Raises:
        ValueError: ``budget <= 0``.
    """
    if budget <= 0:
        raise ValueError(f"budget must be > 0 tokens, got {budget}; give every layer a "
                         "positive budget")
    order = sorted(range(len(lines)), key=lambda i: (-lines[i].importance, i))
    left = budget
    keep: set[int] = set()
    for i in order:
        cost = count_tokens(lines[i].text) + 1
        if cost <= left:
            keep.add(i)
            left -= cost
    kept = [line for i, line in enumerate(lines) if i in keep]
    spilled = [line for i, line in enumerate(lines) if i not in keep]
    if spillover is not None and spilled:
        now = time.time()
        spillover.put(SpilledLine(layer, s.text, s.importance, now) for s in spilled)
    return kept, spilled
