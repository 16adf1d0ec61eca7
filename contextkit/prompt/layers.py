"""Prompt layers: names, budgets, and how each maps onto cache semantics.

The ten default layers of an agent's system prompt (plus ``partner``), their token
budgets with and without a tiered cache attached, which of them form the stable
prefix that is pinned, and which change on every call (volatile).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

__all__ = ["DEFAULT_LAYERS", "LAYER_NAME", "LayerConfig", "LayerSpec", "UnknownLayerError",
           "check_layer_name", "shown"]

#: The one rule for layer names, aliases and sources: 1-64 ASCII letters, digits and
#: ``_``, starting with a letter. A name is written as the marker ``[NAME]`` (upper
#: case, :mod:`contextkit.prompt.markup`) and a source is stored as the ``source_layer``
#: label of cache blocks and shadow manifests, so whatever a layer is called can be
#: written and read back everywhere (every such name is a valid shadow label).
LAYER_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_RULE = ("names are 1-64 ASCII letters, digits and '_', starting with a letter (written "
         "as the marker [NAME], stored as a block label)")


def check_layer_name(value: object, what: str) -> str:
    """Return ``value`` if it follows :data:`LAYER_NAME`; ``what`` names it in the error.

    Raises:
        ValueError: one line naming ``what``, the value and the rule.
    """
    if not isinstance(value, str) or not LAYER_NAME.fullmatch(value):
        raise ValueError(f"{what} must be a str of letters, digits and '_', got "
                         f"{shown(value)}; {_RULE}")
    return value


class UnknownLayerError(KeyError):
    """A layer name that the configuration does not define."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown layer"


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """One prompt layer.

    Names, aliases and sources follow one rule, :data:`LAYER_NAME`.

    Args:
        name: canonical name, used in markers as ``[NAME]...[/NAME]`` (upper case).
        budget: token budget without a tiered cache (cloud APIs, Ollama).
        expanded_budget: token budget when a tiered cache is attached.
        stable: part of the stable prefix (hashed, pinned, computed once).
        volatile: changes on most calls; ordered after slower layers.
        source: the cache metadata ``source_layer`` (eviction priority) of its blocks.
        aliases: other names accepted for this layer.
    """

    name: str
    budget: int
    expanded_budget: int
    stable: bool = False
    volatile: bool = False
    source: str = ""
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        check_layer_name(self.name, "layer name")
        for budget in ("budget", "expanded_budget"):
            value = getattr(self, budget)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"layer {self.name!r}: {budget} must be a positive int "
                                 f"(tokens), got {shown(value)}")
        for flag in ("stable", "volatile"):
            if not isinstance(getattr(self, flag), bool):
                raise ValueError(f"layer {self.name!r}: {flag} must be a bool, got "
                                 f"{shown(getattr(self, flag))}")
        if not isinstance(self.source, str):
            raise ValueError(f"layer {self.name!r}: source must be a str, got "
                             f"{shown(self.source)}")
        if self.source:
            check_layer_name(self.source, f"layer {self.name!r}: source")
        if isinstance(self.aliases, list):
            object.__setattr__(self, "aliases", tuple(self.aliases))
        if not isinstance(self.aliases, tuple) or not all(
                isinstance(a, str) for a in self.aliases):
            raise ValueError(f"layer {self.name!r}: aliases must be a tuple of names, got "
                             f"{shown(self.aliases)}")
        for alias in self.aliases:
            check_layer_name(alias, f"layer {self.name!r}: alias")
        if self.budget <= 0 or self.expanded_budget <= 0:
            raise ValueError(f"layer {self.name!r}: budgets must be > 0 tokens, got "
                             f"{self.budget} and {self.expanded_budget}")
        if not self.source:
            object.__setattr__(self, "source", self.name)

    def budget_for(self, expanded: bool) -> int:
        return self.expanded_budget if expanded else self.budget


def shown(value: object) -> str:
    """``type repr`` of a bad value, short enough for a one-line error."""
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


DEFAULT_LAYERS: tuple[LayerSpec, ...] = (
    LayerSpec("axioms", 200, 200, stable=True),
    LayerSpec("identity", 300, 300, stable=True),
    LayerSpec("system_knowledge", 600, 600, stable=True, source="rules", aliases=("rules",)),
    LayerSpec("capabilities", 1500, 1500, stable=True),
    LayerSpec("system_state", 800, 2000, volatile=True),
    LayerSpec("current_time", 80, 80, volatile=True),
    LayerSpec("neurons", 1600, 8000),
    LayerSpec("memories", 1100, 6000),
    LayerSpec("affect", 250, 250, volatile=True),
    LayerSpec("awareness", 400, 1200, volatile=True),
    LayerSpec("partner", 2000, 4000),
)


class LayerConfig:
    """An ordered set of layers with name and alias lookup.

    Args:
        layers: the layers in the user's order (default :data:`DEFAULT_LAYERS`).

    Raises:
        ValueError: an item that is not a LayerSpec, or a name or alias used twice.
    """

    def __init__(self, layers: Iterable[LayerSpec] = DEFAULT_LAYERS) -> None:
        self.layers = tuple(layers)
        for spec in self.layers:
            if not isinstance(spec, LayerSpec):
                raise ValueError(f"layers must be LayerSpec objects, got {shown(spec)}")
        self._by_name: dict[str, LayerSpec] = {}
        for spec in self.layers:
            for name in (spec.name, *spec.aliases):
                key = name.lower()
                if key in self._by_name:
                    raise ValueError(f"layer name {name!r} is defined twice; names and aliases "
                                     "must be unique")
                self._by_name[key] = spec
        if not self.layers:
            raise ValueError("a layer configuration needs at least one layer")

    def __iter__(self) -> Iterator[LayerSpec]:
        return iter(self.layers)

    def __len__(self) -> int:
        return len(self.layers)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name.lower() in self._by_name

    def get(self, name: str) -> LayerSpec:
        """The layer called ``name`` (case-insensitive; aliases accepted)."""
        try:
            return self._by_name[name.lower() if isinstance(name, str) else name]
        except KeyError:
            known = ", ".join(s.name for s in self.layers)
            raise UnknownLayerError(f"unknown layer {name!r}; known layers: {known} (add a "
                                    "LayerSpec to the LayerConfig to define it)") from None

    def with_budgets(self, **budgets: int) -> LayerConfig:
        """A copy with the (non-expanded and expanded) budget of some layers replaced."""
        specs = []
        for spec in self.layers:
            if spec.name in budgets:
                value = budgets[spec.name]
                spec = replace(spec, budget=value, expanded_budget=max(value,
                                                                        spec.expanded_budget))
            specs.append(spec)
        unknown = set(budgets) - {s.name for s in self.layers}
        if unknown:
            raise UnknownLayerError(f"unknown layers {sorted(unknown)}")
        return LayerConfig(specs)
