"""CacheAwareContextPipeline on the real engine: reuse, pins, ordering, reports, errors."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import pytest

from contextkit.engine.engine import CacheFullError, Engine
from contextkit.pipeline.pipeline import CacheAwareContextPipeline, cache_aware
from contextkit.prompt.layers import LayerConfig, LayerSpec
from contextkit.prompt.markup import PromptFormatError, StructuredPrompt, parse_marked
from gpu_cache.config import PinConfig

pytestmark = pytest.mark.slow

AXIOMS = ["Tell the truth about what you checked.", "Never delete data without a yes."]
IDENTITY = ["You are Atlas, the platform team's SRE assistant."]
CAPS = [f"tool metrics_query_{i}(service, window): p95, p99 and error rate for a service."
        for i in range(12)]
NEURONS = [f"When p95 rises after a deploy, compare pool wait time in region {i}."
           for i in range(6)]


def layered(turn: int, *, axioms: list[str] | None = None) -> dict[str, Any]:
    return {
        "axioms": axioms or AXIOMS,
        "identity": IDENTITY,
        "capabilities": CAPS,
        "system_state": [f"checkout-api: p95 {700 + 13 * turn} ms, 5xx {1.2 + turn / 10:.2f}%",
                         f"queue orders-events: lag {2000 - 90 * turn} msgs"],
        "current_time": [f"Now: 17:{10 + 2 * turn:02d} CET, turn {turn + 1}."],
        "neurons": NEURONS,
        "affect": ["Calm and focused."],
        "awareness": ["The user is an experienced on-call engineer."],
    }


def marked(turn: int) -> str:
    out = []
    for layer, lines in layered(turn).items():
        out += [f"[{layer.upper()}]", *lines, f"[/{layer.upper()}]"]
    return "\n".join(out)


def keys_of(engine: Engine) -> list[tuple[int, bytes | None]]:
    return sorted((m.block_id, m.key) for m in engine.cache.metadata.all())


def test_without_a_cache_everything_passes_through() -> None:
    pipeline = CacheAwareContextPipeline()

    def build(turn: int) -> str:
        return marked(turn)

    wrapped = pipeline.wrap(build)
    assert wrapped(3) == build(3)
    structured = parse_marked(marked(1), LayerConfig())

    @cache_aware(pipeline)
    def build2() -> StructuredPrompt:
        return structured

    assert build2() is structured
    assert pipeline.attached is False
    assert pipeline.cached_blocks() == []
    assert pipeline.pinned_blocks() == []
    assert pipeline.blocks_by_layer() == {}
    assert pipeline.last_report() is None
    assert pipeline.volatility() == {}
    assert pipeline.assemble("hi") == ([], [], 0)
    assert pipeline.budget(LayerConfig().get("neurons")) == 1600
    with pytest.raises(RuntimeError, match="no engine"):
        pipeline.generate("hi")


def test_reuse_pins_metadata_and_report(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=256, host=256)
    pipeline = CacheAwareContextPipeline(engine)
    build = pipeline.wrap(marked)
    history: list[tuple[str, str]] = []
    reports = []
    for turn in range(4):
        text = build(turn)
        assert text.startswith("[AXIOMS]") and "[/CAPABILITIES]" in text
        result = pipeline.generate(f"Turn {turn}: is checkout still slow?", history=history,
                                   max_new_tokens=4)
        history += [("user", f"Turn {turn}: is checkout still slow?"), ("assistant", result.text)]
        reports.append(result.report)
    first, second, last = reports[0], reports[1], reports[-1]
    assert first.prefix_broken_by == "first_call" and first.reused_tokens == 0
    assert first.trailing_layers == ["system_state", "current_time", "affect", "awareness"]
    assert second.changed_layers == ["system_state", "current_time"]
    assert second.stable_hash == first.stable_hash and not second.stable_changed
    # The volatile layers follow the conversation: everything before them is reused.
    stable_tokens = sum(first.layer_tokens[x] for x in ("axioms", "identity", "capabilities"))
    assert second.reused_tokens >= stable_tokens
    assert second.computed_tokens < first.computed_tokens / 2
    # affect/awareness never change: after three calls they move before the conversation.
    assert last.trailing_layers == ["system_state", "current_time"]
    assert last.layer_order[-2:] == ["affect", "awareness"]
    assert last.prefix_broken_by == "system_state"
    assert last.reused_tokens + last.computed_tokens == last.prompt_tokens
    # The stable prefix is pinned, tagged with its layers, and in the device tier.
    pinned = pipeline.pinned_blocks()
    assert pinned and last.pinned_blocks == len(pinned)
    metas = [engine.cache.metadata.get(b) for b in pinned]
    assert {m.source_layer for m in metas} <= {"axioms", "identity", "capabilities"}
    assert all(m.pinned and m.tier.value == "device" for m in metas)
    by_layer = pipeline.blocks_by_layer()
    assert by_layer["capabilities"] >= 3 and by_layer["system_state"] >= 1
    assert sum(last.blocks_per_tier.values()) == len(engine.cache.metadata.all())
    ranges = sorted(m.token_range for m in metas)
    assert ranges[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(ranges))


def test_volatility_is_learned(fresh: Callable[..., Engine]) -> None:
    pipeline = CacheAwareContextPipeline(fresh("tq4"))
    for turn in range(3):
        layers = layered(0)
        layers["neurons"] = [*NEURONS, f"Fresh insight number {turn}."]  # changes every call
        pipeline.build(layers)
    report = pipeline.last_report()
    assert report is not None
    assert "neurons" in report.trailing_layers
    assert pipeline.volatility()["neurons"] > 0.5
    assert pipeline.volatility()["affect"] < 0.5  # flagged volatile, never changed


def test_changed_axioms_change_the_hash_and_move_the_pins(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4")
    pipeline = CacheAwareContextPipeline(engine)
    pipeline.build(layered(0))
    pipeline.generate("hello", max_new_tokens=1)
    old = pipeline.pinned_blocks()
    pipeline.build(layered(1, axioms=["A different first principle.", *AXIOMS]))
    result = pipeline.generate("hello", max_new_tokens=1)
    assert result.report.stable_changed and result.report.prefix_broken_by == "axioms"
    assert result.report.reused_tokens == 0
    new = pipeline.pinned_blocks()
    assert new and not set(new) & set(old)
    assert all(not engine.cache.metadata.get(b).pinned for b in old if b in engine.cache.metadata)


def test_expanded_budgets_only_with_a_cache(fresh: Callable[..., Engine]) -> None:
    config = LayerConfig([LayerSpec("axioms", 20, 60, stable=True),
                          LayerSpec("system_state", 20, 60, volatile=True)])
    lines = [f"service-{i}: 3/3 ready, p95 {100 + i} ms" for i in range(12)]
    raw = {"axioms": AXIOMS, "system_state": lines}
    plain = CacheAwareContextPipeline(layers=config)
    assert plain.wrap(lambda: raw)() is raw  # no cache: untouched, original budgets
    engine = fresh("tq4")
    pipeline = CacheAwareContextPipeline(engine, layers=config)
    built = pipeline.build(raw)
    state = next(s for s in (*built.main, *built.trailing) if s.layer == "system_state")
    kept = len(state.lines)
    assert 20 < engine.count_tokens("\n".join(x.text for x in state.lines)) <= 60
    assert 0 < kept < len(lines) and built.report.spilled_lines == len(lines) - kept
    spilled = pipeline.spillover.drain()
    assert [s.text for s in spilled] == [x for x in lines if x not in
                                         {y.text for y in state.lines}]


def test_bad_prompts_fail_clearly_and_lose_nothing(fresh: Callable[..., Engine]) -> None:
    # A small device tier: half of it may hold the (18-block) stable prefix's pins.
    engine = fresh("tq4", device=48, host=16, pins=PinConfig(tenant_share=0.5))
    pipeline = CacheAwareContextPipeline(engine)
    build = pipeline.wrap(lambda text: text)
    build(marked(0))
    pipeline.generate("hi", max_new_tokens=1)
    before = keys_of(engine)
    with pytest.raises(PromptFormatError, match="unknown layer marker"):
        build("[AXIOMS]\nok\n[/AXIOMS]\n[MOOD]\nx\n[/MOOD]")
    with pytest.raises(PromptFormatError, match="never closed"):
        build("[AXIOMS]\nok")
    with pytest.raises(PromptFormatError, match="returned int"):
        build(42)
    with pytest.raises(ValueError, match="budgets must be > 0"):
        LayerSpec("axioms", 0, 10)
    huge = layered(0)
    huge["neurons"] = [f"Heuristic {i}: check pool wait, then GC pauses, then DNS." for i in
                       range(80)]
    build(huge)
    with pytest.raises(CacheFullError, match="device tier"):
        pipeline.generate("hi", max_new_tokens=1)
    assert keys_of(engine) == before
    with pytest.raises(ValueError, match="invalid tenant"):
        pipeline.build(marked(0), tenant="../etc/passwd")


def test_tenants_are_isolated(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4", device=256, host=64)
    pipeline = CacheAwareContextPipeline(engine)
    for tenant in ("acme", "globex"):
        pipeline.build(marked(0), tenant=tenant)
        result = pipeline.generate("status?", max_new_tokens=1, tenant=tenant)
        assert result.report.reused_tokens == 0
    acme = {m.block_id for m in pipeline.cached_blocks("acme")}
    globex = {m.block_id for m in pipeline.cached_blocks("globex")}
    assert acme and globex and not acme & globex
    assert set(pipeline.pinned_blocks("acme")) <= acme


def test_assembled_tokens_equal_the_chat_template(fresh: Callable[..., Engine]) -> None:
    engine = fresh("tq4")
    pipeline = CacheAwareContextPipeline(engine, trailing_message=False)
    built = pipeline.build(marked(2))
    history = [("user", "Is checkout slow?"), ("assistant", "Yes: p95 is 726 ms.")]
    ids, spans, stable_end = pipeline.assemble("And now?", history)
    messages = [{"role": "system", "content": built.text + "\n"}]
    messages += [{"role": r, "content": t} for r, t in history]
    messages.append({"role": "user", "content": "And now?"})
    want = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                tokenize=True)
    if not isinstance(want, list):
        want = want["input_ids"]
    assert ids == list(want)
    assert spans[0].source_layer == "axioms" and spans[0].start > 0
    assert 0 < stable_end < len(ids)
    assert engine.decode(ids[:stable_end]).rstrip().endswith("[/CAPABILITIES]")


def test_each_line_is_a_chunk_and_a_changed_layer_keeps_the_rest(
        fresh: Callable[..., Engine]) -> None:
    """Every line of a layer is its own span (a chunk by content); when a layer early
    in the prompt changes, the lines after it are moved in, not recomputed, and the
    report's token counts still add up."""
    from contextkit.pipeline.building import layer_spans

    engine = fresh("tq4", device=256, host=256)
    pipeline = CacheAwareContextPipeline(engine)

    def prompt(turn: int, identity: list[str]) -> dict[str, Any]:
        return {**layered(turn), "identity": identity}

    build = pipeline.wrap(prompt)
    build(0, IDENTITY)
    pipeline.generate("Is checkout still slow?", max_new_tokens=2)
    _, spans, _ = pipeline.assemble("Is checkout still slow?", [])
    caps = [s for s in spans if s.source_layer == "capabilities"]
    assert len(caps) == len(CAPS) + 2  # the opening tag, one span per line, the closing tag
    assert all(a.end == b.start for a, b in itertools.pairwise(caps))
    merged = layer_spans(spans)
    assert [s.source_layer for s in merged].count("capabilities") == 1
    assert sum(s.end - s.start for s in merged) == sum(s.end - s.start for s in spans)

    build(1, ["You are Atlas, the payments team's on-call assistant for checkout."])
    r = pipeline.generate("Is checkout still slow?", max_new_tokens=2).report
    assert r.prefix_broken_by == "identity"
    assert r.reused_chunks.get("capabilities") == len(CAPS)  # every line moved in
    assert r.chunk_reused_tokens > 0 and r.repaired_tokens > 0
    assert r.reused_tokens + r.chunk_reused_tokens + r.computed_tokens == r.prompt_tokens
    assert sum(r.reused_by_layer.values()) == r.reused_tokens + r.chunk_reused_tokens
    assert sum(r.computed_by_layer.values()) == r.computed_tokens
    assert r.reused_by_layer["capabilities"] > r.computed_by_layer.get("capabilities", 0)
