"""Layers, prompt parsing and the budget compressor (real SmolLM2 tokenizer)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine.models import load_tokenizer
from contextkit.prompt.layers import DEFAULT_LAYERS, LayerConfig, LayerSpec, UnknownLayerError
from contextkit.prompt.markup import (
    PromptFormatError,
    PromptLine,
    SpilloverQueue,
    StructuredPrompt,
    coerce_prompt,
    parse_marked,
    render_marked,
    synthesize_for_budget,
)

CONFIG = LayerConfig()


@pytest.fixture(scope="module")
def count_tokens() -> Callable[[str], int]:
    tokenizer = load_tokenizer()
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_default_layers_and_budgets_follow_the_spec() -> None:
    names = [s.name for s in DEFAULT_LAYERS]
    assert names == ["axioms", "identity", "system_knowledge", "capabilities", "system_state",
                     "current_time", "neurons", "memories", "affect", "awareness", "partner"]
    assert sum(s.budget for s in DEFAULT_LAYERS if s.name != "partner") == 6830
    assert CONFIG.get("neurons").budget_for(expanded=True) == 8000
    assert CONFIG.get("RULES") is CONFIG.get("system_knowledge")
    assert CONFIG.get("rules").source == "rules"
    assert [s.name for s in CONFIG if s.stable] == ["axioms", "identity", "system_knowledge",
                                                    "capabilities"]
    with pytest.raises(UnknownLayerError, match="known layers"):
        CONFIG.get("soul_food")
    with pytest.raises(ValueError, match="> 0"):
        LayerSpec("x", 0, 10)
    with pytest.raises(ValueError, match="twice"):
        LayerConfig([LayerSpec("a", 1, 1), LayerSpec("b", 1, 1, aliases=("a",))])
    assert CONFIG.with_budgets(memories=50).get("memories").budget == 50


BAD_SPECS = [
    ({"name": 5}, r"layer name must be a str of letters, digits and '_', got int 5"),
    ({"name": "my layer"}, r"layer name must be a str of letters, digits and '_'"),
    ({"budget": "5"}, r"layer 'notes': budget must be a positive int \(tokens\), got str '5'"),
    ({"budget": 1.5}, r"layer 'notes': budget must be a positive int \(tokens\), got float"),
    ({"expanded_budget": True}, r"layer 'notes': expanded_budget must be a positive int"),
    ({"stable": "yes"}, r"layer 'notes': stable must be a bool, got str 'yes'"),
    ({"source": 3}, r"layer 'notes': source must be a str, got int 3"),
    ({"aliases": "notes2"}, r"layer 'notes': aliases must be a tuple of names, got str"),
    ({"aliases": ("ok", 7)}, r"layer 'notes': aliases must be a tuple of names, got tuple"),
]


@pytest.mark.parametrize(("change", "match"), BAD_SPECS, ids=[repr(c)[:30] for c, _ in BAD_SPECS])
def test_layer_specs_check_their_types(change: dict[str, object], match: str) -> None:
    fields: dict[str, object] = {"name": "notes", "budget": 100, "expanded_budget": 200,
                                 **change}
    with pytest.raises(ValueError, match=match):
        LayerSpec(**fields)  # type: ignore[arg-type]


def test_layer_configs_check_their_items_and_lookups() -> None:
    with pytest.raises(ValueError, match=r"layers must be LayerSpec objects, got str 'axioms'"):
        LayerConfig(["axioms"])  # type: ignore[list-item]
    with pytest.raises(UnknownLayerError, match="unknown layer 5; known layers"):
        CONFIG.get(5)  # type: ignore[arg-type]
    assert LayerSpec("notes", 10, 20, aliases=["memo"]).aliases == ("memo",)  # type: ignore[arg-type]


MARKED = """[AXIOMS]
Never reveal secrets.
[/AXIOMS]
[RULES]
Answer briefly.
Cite sources.
[/RULES]
[CURRENT_TIME]
2026-11-21 21:00 UTC
[/CURRENT_TIME]"""


def test_marker_strings_round_trip() -> None:
    prompt = parse_marked(MARKED, CONFIG)
    assert [s.layer for s in prompt.sections] == ["axioms", "system_knowledge", "current_time"]
    assert [line.text for line in prompt.section("system_knowledge").lines] == [
        "Answer briefly.", "Cite sources."]
    again = parse_marked(render_marked(prompt), CONFIG)
    assert again == prompt


@pytest.mark.parametrize("text,match", [
    ("[AXIOMS]\nx\n[/AXIOMS]\n[FOO]\ny\n[/FOO]", r"line 4: unknown layer marker \[FOO\]"),
    ("[AXIOMS]\nx\n[IDENTITY]\n", r"line 3: \[IDENTITY\] opens inside \[AXIOMS\]"),
    ("[AXIOMS]\nx\n[/IDENTITY]", r"line 3: \[/IDENTITY\] closes inside \[AXIOMS\]"),
    ("[AXIOMS]\nx\n", r"\[AXIOMS\] opened on line 1 is never closed"),
    ("loose text\n[AXIOMS]\nx\n[/AXIOMS]", r"line 1 is outside any layer"),
    ("[AXIOMS]\nx\n[/AXIOMS]\n[AXIOMS]\ny\n[/AXIOMS]", r"appears twice"),
], ids=["unknown", "nested", "mismatched", "unclosed", "outside", "twice"])
def test_bad_markers_say_where_and_what_to_do(text: str, match: str) -> None:
    with pytest.raises(PromptFormatError, match=match):
        parse_marked(text, CONFIG)


def test_structured_prompts_are_accepted_in_several_shapes() -> None:
    prompt = coerce_prompt({"axioms": ["Never reveal secrets."],
                            "memories": [("met Dana", 0.9), PromptLine("likes tea", 0.2)],
                            "identity": "I am Ada.\nI help."}, CONFIG)
    assert isinstance(prompt, StructuredPrompt)
    assert prompt.section("memories").lines[0] == PromptLine("met Dana", 0.9)
    assert [line.text for line in prompt.section("identity").lines] == ["I am Ada.", "I help."]
    assert coerce_prompt(prompt, CONFIG) is prompt
    assert coerce_prompt(MARKED, CONFIG) == parse_marked(MARKED, CONFIG)
    with pytest.raises(PromptFormatError, match="unknown layer 'mood'"):
        coerce_prompt({"mood": ["x"]}, CONFIG)
    with pytest.raises(PromptFormatError, match="returned int"):
        coerce_prompt(42, CONFIG)
    with pytest.raises(PromptFormatError, match="within"):
        PromptLine("x", 1.5)


BAD_STRUCTURES = [
    ({"axioms": 5}, r"layer 'axioms': expected a string or a list of lines, got int"),
    ({"axioms": None}, r"layer 'axioms': expected a string or a list of lines, got NoneType"),
    ({"axioms": b"raw"}, r"layer 'axioms': expected a string or a list of lines, got bytes"),
    ({"axioms": {"a": 1}}, r"layer 'axioms': expected a string or a list of lines, got dict"),
    ({5: ["x"]}, r"layer names must be str, got int 5"),
    ({("axioms",): ["x"]}, r"layer names must be str, got tuple"),
    ({"axioms": [5]}, r"layer 'axioms', line 1: expected a str, a \(str, importance\) pair "
                      r"or a PromptLine, got int"),
    ({"axioms": ["ok", ("a", 0.5, 1)]}, r"layer 'axioms', line 2: expected .* got a tuple of 3"),
    ({"axioms": [(5, 0.5)]}, r"layer 'axioms', line 1: the text must be a str, got int"),
    ({"axioms": [("a", "high")]}, r"layer 'axioms', line 1: importance must be a number in "
                                  r"\[0, 1\], got str 'high'"),
    ({"axioms": [("a", None)]}, r"layer 'axioms', line 1: importance must be a number"),
    ({"memories": [("a", 1.5)]}, r"layer 'memories', line 1: importance must be within \[0, 1\]"),
    ({"memories": [("a", -0.1)]}, r"layer 'memories', line 1: importance must be within"),
    ({"memories": [("a", float("nan"))]}, r"layer 'memories', line 1: importance must be within"),
    ({"memories": [("a\nb", 0.5)]}, r"layer 'memories', line 1: a PromptLine holds one line"),
]


@pytest.mark.parametrize(("value", "match"), BAD_STRUCTURES,
                         ids=[repr(v)[:40] for v, _ in BAD_STRUCTURES])
def test_malformed_structured_prompts_name_the_layer_and_what_was_expected(
        value: object, match: str) -> None:
    with pytest.raises(PromptFormatError, match=match) as exc:
        coerce_prompt(value, CONFIG)
    assert "\n" not in str(exc.value)


def test_prompt_lines_and_sections_check_their_types() -> None:
    with pytest.raises(PromptFormatError, match="text must be a str, got int"):
        PromptLine(5)  # type: ignore[arg-type]
    with pytest.raises(PromptFormatError, match="importance must be a number"):
        PromptLine("x", "0.5")  # type: ignore[arg-type]
    with pytest.raises(PromptFormatError, match="importance must be a number"):
        PromptLine("x", True)
    assert PromptLine("x", 1).importance == 1
    from contextkit.prompt.markup import PromptSection

    unknown = StructuredPrompt((PromptSection("mood", (PromptLine("x"),)),))
    with pytest.raises(PromptFormatError, match="unknown layer 'mood'; known layers"):
        coerce_prompt(unknown, CONFIG)


def test_synthesize_keeps_important_lines_in_order_within_budget(
        count_tokens: Callable[[str], int]) -> None:
    lines = [PromptLine(f"fact number {i} about the deployment of service {i}", imp)
             for i, imp in enumerate([0.1, 0.9, 0.5, 0.9, 0.3, 0.7])]
    cost = [count_tokens(line.text) + 1 for line in lines]
    budget = cost[1] + cost[3] + cost[5]  # exactly the three most important
    queue = SpilloverQueue()
    kept, spilled = synthesize_for_budget(lines, budget, count_tokens, layer="neurons",
                                          spillover=queue)
    assert kept == [lines[1], lines[3], lines[5]]
    assert spilled == [lines[0], lines[2], lines[4]]
    assert sum(count_tokens(line.text) + 1 for line in kept) <= budget
    drained = queue.drain()
    assert [d.text for d in drained] == [s.text for s in spilled]
    assert {d.layer for d in drained} == {"neurons"} and len(queue) == 0
    # deterministic: the same input gives the same output
    assert synthesize_for_budget(lines, budget, count_tokens)[0] == kept
    # a long important line that does not fit does not block smaller ones
    big = [PromptLine("word " * 400, 1.0), *lines]
    kept_big, _ = synthesize_for_budget(big, budget, count_tokens)
    assert big[0] not in kept_big and kept_big == kept
    with pytest.raises(ValueError, match="budget must be > 0"):
        synthesize_for_budget(lines, 0, count_tokens)


def test_spillover_queue_is_bounded_and_counts_what_it_drops() -> None:
    from contextkit.prompt.markup import SpilledLine

    queue = SpilloverQueue(maxlen=3)
    queue.put(SpilledLine("memories", str(i), 0.5, 0.0) for i in range(5))
    assert queue.dropped == 2 and [s.text for s in queue.drain(2)] == ["2", "3"]
    assert [s.text for s in queue.drain()] == ["4"]
