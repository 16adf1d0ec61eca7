"""The agent replay workload: sizes (real SmolLM2 tokenizer), determinism, what changes when."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from contextkit.engine.models import load_tokenizer
from contextkit.prompt.layers import DEFAULT_LAYERS, LayerConfig
from contextkit.prompt.markup import StructuredPrompt, parse_marked, synthesize_for_budget
from contextkit.workloads.replay import REPLAY_LAYERS, AgentReplay

CONFIG = LayerConfig()
PER_TURN = ("system_state", "current_time")
STABLE = ("axioms", "identity", "system_knowledge", "capabilities", "neurons", "affect",
          "awareness")
EXPANDABLE = ("system_state", "neurons", "memories", "awareness")


@pytest.fixture(scope="module")
def count_tokens() -> Callable[[str], int]:
    tokenizer = load_tokenizer()
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


@pytest.fixture(scope="module")
def replay() -> AgentReplay:
    return AgentReplay()


@pytest.fixture(scope="module")
def prompts(replay: AgentReplay) -> list[StructuredPrompt]:
    return [replay.build_system_message(t) for t in range(replay.num_turns)]


def texts(prompt: StructuredPrompt, layer: str) -> list[str]:
    section = prompt.section(layer)
    assert section is not None, f"layer {layer} is missing"
    return [line.text for line in section.lines]


def layer_tokens(prompt: StructuredPrompt, layer: str, count: Callable[[str], int]) -> int:
    return count("\n".join(texts(prompt, layer)))


def topic_switches(replay: AgentReplay) -> list[int]:
    """Turns whose topic differs from the previous turn's."""
    return [t for t in range(1, replay.num_turns)
            if replay.turn(t).topic != replay.turn(t - 1).topic]


def test_layers_follow_the_default_order_without_partner() -> None:
    assert tuple(s.name for s in DEFAULT_LAYERS if s.name != "partner") == REPLAY_LAYERS
    assert len(REPLAY_LAYERS) == 10


def test_script_is_a_realistic_session_with_topic_runs_of_three_to_five(
        replay: AgentReplay) -> None:
    turns = replay.turns()
    assert [t.index for t in turns] == list(range(20))
    for t in turns:
        assert 10 <= len(t.user_message.split()) <= 40, t.user_message
    assert len({t.user_message for t in turns}) == 20
    runs: list[int] = []
    for i, t in enumerate(turns):
        if i and t.topic == turns[i - 1].topic:
            runs[-1] += 1
        else:
            runs.append(1)
    assert 5 <= len(runs) <= 7
    assert all(3 <= r <= 5 for r in runs), runs
    assert len({t.topic for t in turns}) == len(runs)  # no topic comes back


def test_invalid_arguments_and_turn_indices_are_refused(replay: AgentReplay) -> None:
    with pytest.raises(ValueError, match="turns"):
        AgentReplay(0)
    with pytest.raises(ValueError, match="scale"):
        AgentReplay(scale=0.0)
    for bad in (-1, 20):
        with pytest.raises(IndexError):
            replay.turn(bad)
        with pytest.raises(IndexError):
            replay.build_system_message(bad)


def test_same_seed_gives_identical_prompts_and_another_seed_another_state() -> None:
    a, b, other = AgentReplay(seed=7), AgentReplay(seed=7), AgentReplay(seed=8)
    assert [a.build_marked(t) for t in range(20)] == [b.build_marked(t) for t in range(20)]
    assert a.turns() == b.turns()
    assert a.memory_corpus() == b.memory_corpus()
    for t in range(20):
        assert texts(a.build_system_message(t), "system_state") != \
            texts(other.build_system_message(t), "system_state")
    assert a.memory_corpus() != other.memory_corpus()


def test_each_layer_fills_80_to_95_percent_of_its_budget_at_scale_1(
        prompts: list[StructuredPrompt], count_tokens: Callable[[str], int]) -> None:
    for turn, prompt in enumerate(prompts):
        assert [s.layer for s in prompt.sections] == list(REPLAY_LAYERS)
        total = 0
        for layer in REPLAY_LAYERS:
            budget = CONFIG.get(layer).budget
            used = layer_tokens(prompt, layer, count_tokens)
            assert 0.80 * budget <= used <= 0.95 * budget, (turn, layer, used, budget)
            total += used
        assert 5500 <= total <= 6500, (turn, total)


def test_default_budgets_keep_every_line_at_scale_1(
        prompts: list[StructuredPrompt], count_tokens: Callable[[str], int]) -> None:
    for prompt in (prompts[0], prompts[9], prompts[19]):
        for section in prompt.sections:
            kept, spilled = synthesize_for_budget(section.lines,
                                                  CONFIG.get(section.layer).budget, count_tokens)
            assert not spilled, section.layer
            assert len(kept) == len(section.lines)


def test_scale_5_overflows_the_expanded_budgets_for_trimming(
        prompts: list[StructuredPrompt], count_tokens: Callable[[str], int]) -> None:
    big = AgentReplay(scale=5.0).build_system_message(0)
    total = sum(layer_tokens(big, layer, count_tokens) for layer in REPLAY_LAYERS)
    assert 25_000 <= total <= 36_000, total
    for layer in REPLAY_LAYERS:
        if layer not in EXPANDABLE:
            assert texts(big, layer) == texts(prompts[0], layer), layer
            continue
        section = big.section(layer)
        assert section is not None
        expanded = CONFIG.get(layer).expanded_budget
        assert layer_tokens(big, layer, count_tokens) > expanded, layer
        kept, spilled = synthesize_for_budget(section.lines, expanded, count_tokens)
        assert spilled and kept, layer
        assert sum(count_tokens(line.text) + 1 for line in kept) <= expanded
        # the most important lines survive: what was kept outranks most of what spilled
        kept_mean = sum(line.importance for line in kept) / len(kept)
        spilled_mean = sum(line.importance for line in spilled) / len(spilled)
        assert kept_mean > spilled_mean, layer


def test_lines_are_single_lines_with_varied_importances(
        prompts: list[StructuredPrompt]) -> None:
    for prompt in prompts:
        for section in prompt.sections:
            assert section.lines, section.layer
            for line in section.lines:
                assert line.text.strip() and "\n" not in line.text and "\r" not in line.text
                assert 0.2 <= line.importance <= 1.0
    first = prompts[0]
    for layer in ("capabilities", "system_state", "neurons", "memories", "system_knowledge"):
        found = first.section(layer)
        assert found is not None
        importances = {line.importance for line in found.lines}
        assert len(importances) >= 5, layer
        assert min(importances) <= 0.45 and max(importances) >= 0.9, layer


def test_per_turn_layers_change_every_turn_and_stable_layers_never(
        prompts: list[StructuredPrompt]) -> None:
    for t in range(1, len(prompts)):
        for layer in PER_TURN:
            assert texts(prompts[t], layer) != texts(prompts[t - 1], layer), (t, layer)
    for layer in STABLE:
        first = texts(prompts[0], layer)
        assert all(texts(p, layer) == first for p in prompts), layer


def test_memories_change_only_at_topic_switches(replay: AgentReplay,
                                                 prompts: list[StructuredPrompt]) -> None:
    switches = topic_switches(replay)
    changed = [t for t in range(1, len(prompts))
               if texts(prompts[t], "memories") != texts(prompts[t - 1], "memories")]
    assert changed == switches
    assert 3 <= len(changed) <= 8
    corpus = set(replay.memory_corpus())
    assert all(set(texts(p, "memories")) <= corpus for p in prompts)


def test_changed_layers_match_the_actual_diffs(replay: AgentReplay,
                                               prompts: list[StructuredPrompt]) -> None:
    turns = replay.turns()
    assert turns[0].changed_layers == REPLAY_LAYERS
    for t in range(1, len(prompts)):
        actual = tuple(layer for layer in REPLAY_LAYERS
                       if texts(prompts[t], layer) != texts(prompts[t - 1], layer))
        assert turns[t].changed_layers == actual, t
        assert replay.turn(t) == turns[t]
        assert set(PER_TURN) <= set(actual)


def test_marked_string_round_trips_through_parse_marked(
        replay: AgentReplay, prompts: list[StructuredPrompt]) -> None:
    for t in (0, 5, 13, 19):
        marked = replay.build_marked(t)
        assert marked.startswith("[AXIOMS]\n") and marked.endswith("[/AWARENESS]")
        parsed = parse_marked(marked, CONFIG)
        assert [s.layer for s in parsed.sections] == list(REPLAY_LAYERS)
        for layer in REPLAY_LAYERS:
            assert texts(parsed, layer) == texts(prompts[t], layer), (t, layer)


def test_longer_sessions_cycle_the_script_and_keep_moving() -> None:
    long = AgentReplay(45, seed=3)
    turns = long.turns()
    assert len(turns) == long.num_turns == 45
    assert turns[20].user_message == turns[0].user_message
    assert turns[20].topic == turns[0].topic != turns[19].topic
    assert "memories" in turns[20].changed_layers
    assert all(set(PER_TURN) <= set(t.changed_layers) for t in turns[1:])
    short = AgentReplay(20, seed=3)
    assert long.build_marked(19) == short.build_marked(19)


def test_memory_graph_drives_memories_per_topic(
        tmp_path, count_tokens: Callable[[str], int]) -> None:
    from memory_graph import MemoryGraph, SentenceTransformerEmbedder

    # the packaged all-MiniLM-L6-v2
    graph = MemoryGraph(f"sqlite:///{tmp_path}/g.db",
                        embedder=SentenceTransformerEmbedder())
    replay = AgentReplay(memory_graph=graph, tenant="brightloom")
    corpus = replay.memory_corpus()
    assert 30 <= len(corpus) <= 100
    assert replay.seed_memory(graph) == len(corpus)
    assert replay.seed_memory(graph) == 0  # deterministic ids: nothing added twice
    assert graph.num_nodes("brightloom") == len(corpus)
    assert {e.edge_type for e in graph.edges()} == {"same_topic", "follow_up_of", "applies_to"}

    memories = [texts(replay.build_system_message(t), "memories") for t in range(20)]
    assert all(10 <= len(m) <= 40 and set(m) <= set(corpus) for m in memories)
    budget = CONFIG.get("memories").budget
    assert all(0.8 * budget <= count_tokens("\n".join(m)) <= 0.95 * budget for m in memories)
    changed = [t for t in range(1, 20) if memories[t] != memories[t - 1]]
    assert changed == topic_switches(replay)
    assert [t.changed_layers for t in replay.turns()][1:] == [
        ("system_state", "current_time", "memories") if t in changed
        else ("system_state", "current_time") for t in range(1, 20)]

    # a second replay on the same graph retrieves the same memories for every topic
    again = AgentReplay(memory_graph=graph, tenant="brightloom")
    for t in [0, *changed]:
        assert texts(again.build_system_message(t), "memories") == memories[t]
    graph.close()


def test_memory_candidates_predict_from_the_conversation_so_far(tmp_path) -> None:
    from contextkit.loop.reservations import MemoryCandidate
    from memory_graph import MemoryGraph, SentenceTransformerEmbedder

    graph = MemoryGraph(f"sqlite:///{tmp_path}/g.db",
                        embedder=SentenceTransformerEmbedder())
    replay = AgentReplay(memory_graph=graph, tenant="brightloom")
    replay.seed_memory(graph)
    assert AgentReplay().memory_candidates([("user", "checkout latency")]) == []  # scripted
    assert replay.memory_candidates([]) == []
    turns = replay.turns()
    history: list[tuple[str, str]] = []
    predicted: dict[int, list[MemoryCandidate]] = {}
    for t in range(19):
        replay.build_system_message(t)
        history += [("user", turns[t].user_message), ("assistant", "")]
        if turns[t + 1].topic != turns[t].topic:
            predicted[t + 1] = replay.memory_candidates(history, k=2)
    assert sorted(predicted) == topic_switches(replay)
    again = AgentReplay(memory_graph=graph, tenant="brightloom")
    for t, candidates in predicted.items():
        assert 1 <= len(candidates) <= 2
        assert turns[t - 1].topic not in [c.key for c in candidates]  # the current topic
        assert candidates[0].score >= candidates[-1].score > 0
        for c in candidates:  # the layer exactly as the replay will build it for that topic
            assert c.node_ids and all(n.startswith("replay:brightloom:0:") for n in c.node_ids)
            first = next(i for i, turn in enumerate(turns) if turn.topic == c.key)
            assert [text for text, _ in c.lines] == \
                texts(again.build_system_message(first), "memories")
    # measured (last 3 user messages, hops=1): the next topic is the best candidate at 3
    # of the 5 switches; the switch to the incident summary and the "different topic"
    # cost question are not predictable from the conversation
    assert {t: cands[0].key for t, cands in predicted.items()} == {
        4: "deploy", 7: "rollback", 11: "deploy", 14: "latency", 17: "capacity"}
    # the prediction reads the history it is given, nothing else
    other = AgentReplay(memory_graph=graph, tenant="brightloom")
    other.build_system_message(6)
    window = history[:14]
    assert [c.key for c in other.memory_candidates(window)] == \
        [c.key for c in predicted[7]]
    graph.close()
