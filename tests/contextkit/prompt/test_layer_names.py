"""Issue 33, item 5: one rule for layer names, aliases and sources, so that every layer
the API accepts can be written in markers and read back from a shadow manifest."""

from __future__ import annotations

import pytest

from contextkit.prompt.layers import LayerConfig, LayerSpec
from contextkit.prompt.markup import PromptFormatError, parse_marked, render_marked

BAD_NAMES = {"nul": "a\x00b", "newline": "a\nb", "zero-width": "a\u200bb",
             "unicode letters": "straße", "too long": "x" * 1025, "leading digit": "1x",
             "empty": "", "lone surrogate": "a\ud800"}


# An empty source is not a bad one: it means the layer's own name (tested below).
CASES = [(where, bad) for where in ("name", "source", "aliases") for bad in sorted(BAD_NAMES)
         if (where, bad) != ("source", "empty")]


@pytest.mark.parametrize(("where", "bad"), CASES)
def test_layer_names_sources_and_aliases_follow_one_rule(where: str, bad: str) -> None:
    value: object = BAD_NAMES[bad]
    if where == "aliases":
        value = ("ok", value)
    fields: dict[str, object] = {"name": "notes", "budget": 10, "expanded_budget": 10,
                                 where: value}
    with pytest.raises(ValueError, match=r"letters, digits and '_'.*starting with a letter"):
        LayerSpec(**fields)  # type: ignore[arg-type]


def test_an_empty_source_is_the_layers_own_name() -> None:
    assert LayerSpec("notes", 10, 10, source="").source == "notes"


def test_a_unicode_layer_name_is_refused_with_the_rule_not_a_marker_it_then_refuses() -> None:
    with pytest.raises(ValueError, match=r"'straße'.*ASCII"):
        LayerSpec("straße", 10, 10)


@pytest.mark.parametrize("name", ["notes", "Notes_2", "a", "x" * 64, "user_turn"])
def test_every_accepted_name_round_trips_through_markers_and_manifests(name: str) -> None:
    from shadow.manifest import validate_label

    config = LayerConfig([LayerSpec(name, 10, 10, source=name)])
    marked = f"[{name.upper()}]\nhello\n[/{name.upper()}]"
    prompt = parse_marked(marked, config)
    assert parse_marked(render_marked(prompt), config) == prompt
    assert validate_label(config.get(name).source, "source_layer") == name


def test_a_name_longer_than_64_characters_is_refused() -> None:
    with pytest.raises(ValueError, match="64"):
        LayerSpec("x" * 65, 10, 10)
    with pytest.raises(PromptFormatError, match="unknown layer marker"):
        parse_marked("[NOPE]\nx\n[/NOPE]", LayerConfig([LayerSpec("notes", 10, 10)]))
