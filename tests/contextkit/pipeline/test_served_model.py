"""A pipeline attached to a served model (vLLM's OpenAI server), without vLLM: the
server's prompt ids, the token ranges of every layer and message, pins, tenant, usage.

What the range tests assert (the rule of ``request_fields``): a span owns the tokens
whose first character lies between the end of the previous span's text and the end of
its own text. So the spans tile the prompt from token 0, and the ids of a span decode to
exactly the chat markup before its text followed by its text: the section's
``[LAYER]...[/LAYER]`` text (with its newline when the message has one there) or the
message's content. The only difference allowed is at a boundary where one BPE token
holds characters of two texts; that token belongs to the text holding its first
character (tested on its own below).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import shutil
import struct
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from contextkit.engine.engine import Engine
from contextkit.metrics import ContextkitMetrics
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from contextkit.pipeline.served.model import LabelRangeError, RenderedPrompt, ServedModel
from contextkit.pipeline.served.wire import PARAMS_KEY, WireSpan
from contextkit.prompt.layers import LayerConfig, LayerSpec
from gpu_cache import InvalidNameError
from gpu_cache.metadata import PINNABLE_SOURCES

DATA = Path(__file__).parent / "data" / "vllm_chat_prompts.json"
START, END = "<|im_start|>", "<|im_end|>"
STABLE = {"axioms", "identity", "system_knowledge", "capabilities"}


@pytest.fixture(scope="module")
def served() -> ServedModel:
    return ServedModel.packaged(name="smol")


def layered(turn: int) -> dict[str, Any]:
    return {
        "axioms": ["Tell the truth about what you checked.", "Never delete data without a yes."],
        "identity": ["You are Zoé, l'assistante SRE — 日本語 OK ✓ 🎉."],
        "system_knowledge": ["Deploys go through the canary first."],
        "capabilities": [f"tool metrics_query_{i}(service, window): p95 and p99."
                         for i in range(4)],
        "system_state": [f"checkout-api: p95 {700 + 13 * turn} ms"],
        "current_time": [f"Now: 17:{10 + 2 * turn:02d} CET, turn {turn + 1}."],
        "memories": ["The user prefers short answers."],
        "affect": ["Calm."],
    }


def conversation() -> list[dict[str, Any]]:
    """History with a tool round, list-of-parts content and non-ASCII text, then the
    current user turn and its tool round."""
    return [
        {"role": "user", "content": "Quelle heure est-il à Tōkyō? 🕒"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_time", "arguments": "{\"tz\": \"Asia/Tokyo\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1",
         "content": [{"type": "text", "text": "01:12"}, {"type": "text", "text": "JST ✓"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Il est 01:12 à Tōkyō."}]},
        {"role": "user", "content": [{"type": "text", "text": "Et la p95?"},
                                     {"type": "text", "text": "Merci — ありがとう"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_2", "type": "function",
             "function": {"name": "metrics_query_0", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "p95 739 ms"},
    ]


def flat(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p["text"] for p in content)


def recipe_ids(served: ServedModel, messages: list[dict[str, Any]]) -> tuple[str, list[int]]:
    """vLLM's rendering written out again from the research notes, independently of
    ServedModel (string content format, tool call arguments as dicts)."""
    conv = []
    for m in messages:
        d: dict[str, Any] = {"role": m["role"], "content": flat(m.get("content"))}
        if m.get("tool_calls"):
            d["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"] or "{}")}} for c in m["tool_calls"]]
        conv.append(d)
    text = served.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    return text, served.tokenizer(text, add_special_tokens=False)["input_ids"]


def decode(served: ServedModel, ids: list[int]) -> str:
    return str(served.tokenizer.decode(ids, skip_special_tokens=False,
                                       clean_up_tokenization_spaces=False))


def spans_of(fields: dict[str, Any]) -> list[WireSpan]:
    """The request's spans, read as the connector reads them."""
    sent = fields["kv_transfer_params"][PARAMS_KEY]["spans"]
    spans = [WireSpan.decode(s) for s in sent]
    assert [s.encode() for s in spans] == sent  # each one whole, pinned flag included
    return spans


def expected_pieces(pipeline: CacheAwareContextPipeline, messages: list[dict[str, Any]]
                    ) -> list[tuple[str, str]]:
    """(source layer, exact text) of every span for ChatML, from the built sections
    and the messages: the markup before a text is part of its span."""
    built = pipeline.last_built()
    assert built is not None
    by_text = {built.section_texts[s.layer]: s.layer for s in (*built.main, *built.trailing)}
    out: list[tuple[str, str]] = []
    close = ""
    for m in messages:
        head = f"{close}{START}{m['role']}\n"
        if m["role"] == "system" and m["content"]:
            rest = m["content"] + "\n"
            while rest:
                text = next(t for t in by_text if rest.startswith(t))
                rest = rest[len(text):]
                piece = text if rest else text[:-1]
                out.append((pipeline.config.get(by_text[text]).source, head + piece))
                head = ""
        else:
            out.append(("user_turn", head + flat(m.get("content"))))
        close = f"{END}\n"
    return out


# ---------------------------------------------------------------------- rendering
def test_render_reproduces_the_vllm_servers_prompt_ids(served: ServedModel) -> None:
    cases = json.loads(DATA.read_text())["cases"]
    assert set(cases) == {"basic", "parts", "two_system", "no_system", "tools", "nonascii",
                          "empty_named"}
    for name, case in cases.items():
        rendered = served.render(case["messages"], case["tools"])
        assert rendered.text == case["text"], name
        assert rendered.token_ids == case["ids"], name
        assert len(rendered.offsets) == len(rendered.token_ids)
    # No system message: the template injects its default one before the user turn.
    assert cases["no_system"]["text"].startswith(
        f"{START}system\nYou are a helpful AI assistant named SmolLM")
    spans = served.content_spans(cases["no_system"]["messages"])
    text = served.render(cases["no_system"]["messages"]).text
    assert [text[a:b] for a, b in spans] == ["Hello"]
    assert text[:spans[0][0]].endswith(f"{END}\n{START}user\n")


def test_content_spans_and_token_ranges(served: ServedModel) -> None:
    messages = [{"role": "system", "content": [{"type": "text", "text": "A — é"},
                                               {"type": "text", "text": "B 🎉"}]},
                *conversation()]
    rendered = served.render(messages)
    text, ids = recipe_ids(served, messages)
    assert (rendered.text, rendered.token_ids) == (text, ids)
    spans = served.content_spans(messages, rendered=rendered)
    assert [rendered.text[a:b] for a, b in spans] == [flat(m.get("content")) for m in messages]
    a, b = spans[0]
    start, end = rendered.token_range(a, b)
    # vLLM drops a system text's Claude Code billing header line (it changes per call).
    header = "x-anthropic-billing-header"
    billed: list[dict[str, Any]] = [
        {"role": "system", "content": f"{header}: cch=1\nStable."},
        {"role": "system", "content": [{"type": "text", "text": f"{header}: cch=2"},
                                       {"type": "text", "text": "B"}]},
        {"role": "user", "content": f"{header}: kept"}]
    assert served.render(billed).text.startswith(
        f"{START}system\nStable.{END}\n{START}system\nB{END}\n{START}user\n"
        "x-anthropic-billing-header: kept")
    assert decode(served, ids[start:end]) == "A — é\nB 🎉"
    assert rendered.token_range(a, a) == (start, start)
    assert rendered.first_token_at(len(rendered.text)) == len(ids)


def test_messages_that_cannot_be_rendered_exactly_are_refused(served: ServedModel) -> None:
    bad = [
        ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
         "non-text content part"),
        ([{"role": "developer", "content": "x"}], "send it as 'system'"),
        ([{"content": "x"}], "string 'role'"),
        ("hello", "list of OpenAI-format message dicts"),
        ([{"role": "assistant", "content": None, "tool_calls": [{"type": "web"}]}],
         "not a function call"),
    ]
    for messages, match in bad:
        with pytest.raises(LabelRangeError, match=match) as info:
            served.render(messages)  # type: ignore[arg-type]
        assert "\n" not in str(info.value)


def test_a_model_directory_without_a_chat_template_is_refused(
        served: ServedModel, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(served.model_dir / name, tmp_path / name)
    with pytest.raises(ValueError, match="no chat template"):
        ServedModel(tmp_path)
    # vLLM gives a template that loops over content parts its "openai" content format.
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}"
        "{% endfor %}")
    with pytest.raises(ValueError, match="'openai' content format"):
        ServedModel(tmp_path)
    # A template that allows one leading system message only refuses the trailing one.
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
        "{{ raise_exception('System message must be first') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    strict = ServedModel(tmp_path)
    two = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
           {"role": "system", "content": "T"}]
    with pytest.raises(LabelRangeError, match=r"System message must be first.*"
                                              r"trailing_message=False") as info:
        strict.render(two)
    assert "\n" not in str(info.value)
    assert strict.render(two[:2]).text == "system: S\nuser: U\n"
    with pytest.raises(FileNotFoundError, match="no model directory"):
        ServedModel(tmp_path / "missing")
    with pytest.raises(LabelRangeError, match="needs the server's URL"):
        served.verify([{"role": "user", "content": "x"}])


# ---------------------------------------------------------------------- request fields
def served_pipeline(served: ServedModel, **kw: Any) -> CacheAwareContextPipeline:
    return CacheAwareContextPipeline(served=served, metrics=False, **kw)


def test_every_span_decodes_to_its_layer_or_message(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    for turn in range(4):
        pipeline.build(layered(turn))
    built = pipeline.last_built()
    assert built is not None and built.trailing  # time and state follow the conversation
    messages = pipeline.openai_messages(conversation())
    roles = [m["role"] for m in messages]
    assert roles == ["system", "user", "assistant", "tool", "assistant", "system", "user",
                     "assistant", "tool"]
    assert messages[0]["content"] == "".join(
        built.section_texts[s.layer] for s in built.main)[:-1]
    assert messages[5]["content"] == "".join(
        built.section_texts[s.layer] for s in built.trailing)[:-1]
    fields = pipeline.request_fields(messages)
    rendered = served.render(messages)
    ids = rendered.token_ids
    assert (rendered.text, ids) == recipe_ids(served, messages)
    spans = spans_of(fields)
    # The spans tile the prompt from token 0; after the last one only the markup that
    # closes it and the generation prompt are left.
    assert spans[0].start == 0
    assert all(s.end == t.start for s, t in itertools.pairwise(spans))
    want = expected_pieces(pipeline, messages)
    assert [(s.source_layer, decode(served, ids[s.start:s.end])) for s in spans] == want
    assert decode(served, ids[spans[-1].end:]) == f"{END}\n{START}assistant\n"
    # Importance as the engine labels it: a section's highest line, turns 0.3.
    for span in spans:
        assert span.importance == (0.3 if span.source_layer == "user_turn" else 0.5)


def test_pins_only_on_the_stable_prefix(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    pipeline.build(layered(0))
    fields = pipeline.request_fields(pipeline.openai_messages([{"role": "user", "content": "hi"}]))
    spans = spans_of(fields)
    assert fields["kv_transfer_params"]["contextkit"]["pin"] is True
    pinned = [s.source_layer for s in spans if s.pinned]
    assert pinned == ["axioms", "identity", "rules", "capabilities"]
    assert set(pinned) <= PINNABLE_SOURCES
    assert all(s.pinned is False for s in spans if s.source_layer not in pinned)

    off = served_pipeline(served, pin_stable=False)
    off.build(layered(0))
    fields = off.request_fields(off.openai_messages([{"role": "user", "content": "hi"}]))
    assert fields["kv_transfer_params"]["contextkit"]["pin"] is False
    assert all(s.pinned is False for s in spans_of(fields))

    # In the user's order a stable layer after a changing one is not in the stable
    # prefix (its blocks' keys change with the layer before it): not pinned.
    config = LayerConfig([LayerSpec("axioms", 200, 200, stable=True),
                          LayerSpec("current_time", 80, 80, volatile=True),
                          LayerSpec("identity", 300, 300, stable=True)])
    plain = served_pipeline(served, layers=config, reorder=False)
    plain.build({"axioms": ["a"], "current_time": ["t"], "identity": ["i"]})
    fields = plain.request_fields(plain.openai_messages([{"role": "user", "content": "hi"}]))
    assert [(s.source_layer, s.pinned) for s in spans_of(fields)] == [
        ("axioms", True), ("current_time", False), ("identity", False), ("user_turn", False)]


def test_tenant_is_the_cache_salt(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    for tenant in ("acme", "globex"):
        pipeline.build(layered(0), tenant=tenant)
    with pipeline.tenant_scope("globex"):
        messages = pipeline.openai_messages([{"role": "user", "content": "hi"}])
        fields = pipeline.request_fields(messages)
    assert fields["cache_salt"] == "globex"
    acme = pipeline.request_fields(messages, tenant="acme")
    assert acme["cache_salt"] == "acme"
    built = pipeline.last_built("acme")
    assert built is not None
    assert pipeline.request_fields(messages, built=built)["cache_salt"] == "acme"
    with pytest.raises(ValueError, match="built for tenant 'acme'"):
        pipeline.request_fields(messages, tenant="globex", built=built)
    with pytest.raises(RuntimeError, match="no system prompt built for tenant 'initech'"):
        pipeline.request_fields(messages, tenant="initech")
    # gpu_cache's rule allows '@'; vLLM refuses it in a cache_salt.
    pipeline.build(layered(0), tenant="ops@acme")
    with pytest.raises(InvalidNameError, match="cache_salt") as info:
        pipeline.request_fields(messages, tenant="ops@acme")
    assert "\n" not in str(info.value)


def test_prompt_hash_and_count_are_the_rendered_ids(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    pipeline.build(layered(1))
    messages = pipeline.openai_messages(conversation())
    params = pipeline.request_fields(messages)["kv_transfer_params"]["contextkit"]
    _, ids = recipe_ids(served, messages)
    assert params["prompt_tokens"] == len(ids)
    assert params["prompt_sha256"] == hashlib.sha256(
        struct.pack(f"<{len(ids)}i", *ids)).hexdigest()
    json.dumps(params)  # plain JSON all the way (it travels to the engine core)


def test_a_section_missing_from_the_messages_is_refused(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    pipeline.build(layered(0))
    messages = pipeline.openai_messages([{"role": "user", "content": "hi"}])
    edited = copy.deepcopy(messages)
    edited[0]["content"] = edited[0]["content"].replace("canary", "Canary")
    with pytest.raises(LabelRangeError, match=r"SYSTEM_KNOWLEDGE.*openai_messages") as info:
        pipeline.request_fields(edited)
    assert "\n" not in str(info.value)
    # Without any system message (the template injects its own) nothing can be labelled.
    with pytest.raises(LabelRangeError, match="not in the messages verbatim"):
        pipeline.request_fields([{"role": "user", "content": "hi"}])


def test_sections_found_anywhere_verbatim(served: ServedModel) -> None:
    """Any message list holding the built sections verbatim is labelled: here the whole
    prompt is in the first user message (no system message: the template injects its
    default one, whose markup belongs to the first span), and a BPE token merges the
    last section's ``]`` with the ``)`` after it."""
    pipeline = served_pipeline(served, trailing_message=False)
    built = pipeline.build(layered(0))
    messages = [{"role": "user", "content": "(" + built.text + ") ok"},
                {"role": "assistant", "content": "yes"}]
    fields = pipeline.request_fields(messages)
    rendered = served.render(messages)
    spans = spans_of(fields)
    texts = [decode(served, rendered.token_ids[s.start:s.end]) for s in spans]
    assert texts[0] == (f"{START}system\nYou are a helpful AI assistant named SmolLM, trained "
                        f"by Hugging Face{END}\n{START}user\n(" + built.section_texts["axioms"])
    order = [s.layer for s in built.main]
    for text, layer in zip(texts[1:-2], order[1:-1], strict=True):
        assert text == built.section_texts[layer]
    last = built.section_texts[order[-1]][:-1]
    assert texts[-2] == last + ")"  # the token "])" starts in the section: it is its
    assert texts[-1] == f" ok{END}\n{START}assistant\nyes"
    assert [s.source_layer for s in spans] == [pipeline.config.get(x).source
                                               for x in order] + ["user_turn"]


# ---------------------------------------------------------------------- the pipeline
@pytest.mark.slow  # loads the engine
def test_served_pipeline_builds_as_the_engine_pipeline(
        served: ServedModel, fresh: Callable[..., Engine]) -> None:
    config = LayerConfig([LayerSpec("axioms", 20, 60, stable=True),
                          LayerSpec("identity", 300, 300, stable=True),
                          LayerSpec("system_state", 10, 40, volatile=True),
                          LayerSpec("current_time", 80, 80, volatile=True),
                          LayerSpec("memories", 8, 30),
                          LayerSpec("affect", 50, 50, volatile=True)])
    engine_pipeline = CacheAwareContextPipeline(fresh("tq4"), layers=config, metrics=False)
    served_pipe = CacheAwareContextPipeline(served=served, layers=config, metrics=False)
    assert served_pipe.attached and served_pipe.budget(config.get("memories")) == 30
    lines = [f"service-{i}: 3/3 ready, p95 {100 + i} ms" for i in range(12)]
    for turn in range(6):
        raw = {"axioms": ["Tell the truth.", "Never delete data without a yes."],
               "identity": ["You are Atlas."],
               "system_state": lines[turn:],
               "current_time": [f"17:{turn:02d}"],
               "memories": [f"fact {i}: the user likes tea number {i}" for i in range(turn + 3)],
               "affect": ["Calm."] if turn < 3 else ["Tense."]}
        a = engine_pipeline.build(raw, tenant="acme")
        b = served_pipe.wrap(lambda r: r)(raw)
        assert isinstance(b, str)
        built = served_pipe.last_built()
        assert built is not None
        assert b == a.text == built.text
        assert built.report.to_dict() == {**a.report.to_dict(), "tenant": "default"}
        assert built.section_ids == a.section_ids
        assert built.stable_layers == a.stable_layers
        assert built.report.spilled_lines > 0  # expanded budgets, still over
    assert served_pipe.volatility() == engine_pipeline.volatility("acme")
    # The learned order moved layers after the conversation.
    assert built is not None and built.report.trailing_layers


@pytest.mark.slow  # loads the engine
def test_engine_and_served_are_exclusive(served: ServedModel,
                                         fresh: Callable[..., Engine]) -> None:
    with pytest.raises(ValueError, match="not both"):
        CacheAwareContextPipeline(fresh("tq4"), served=served)
    with pytest.raises(ValueError, match="ServedModel"):
        CacheAwareContextPipeline(served="http://localhost:8000")  # type: ignore[arg-type]


def test_no_local_cache_with_a_served_model(served: ServedModel) -> None:
    pipeline = served_pipeline(served)
    pipeline.build(layered(0))
    assert pipeline.last_report() is not None
    assert pipeline.cached_blocks() == [] and pipeline.pinned_blocks() == []
    assert pipeline.blocks_by_layer() == {}
    assert pipeline.assemble("hi") == ([], [], 0)
    with pytest.raises(RuntimeError, match="request_fields"):
        pipeline.generate("hi")
    plain = CacheAwareContextPipeline(metrics=False)
    with pytest.raises(RuntimeError, match="served model"):
        plain.request_fields([{"role": "user", "content": "hi"}])


def test_record_usage_fills_the_report(served: ServedModel) -> None:
    registry = CollectorRegistry()
    pipeline = CacheAwareContextPipeline(served=served,
                                         metrics=ContextkitMetrics(registry=registry))
    pipeline.build(layered(0), tenant="acme")
    messages = pipeline.openai_messages([{"role": "user", "content": "hi"}], tenant="acme")
    params = pipeline.request_fields(messages, tenant="acme")["kv_transfer_params"]["contextkit"]
    n = params["prompt_tokens"]
    report = pipeline.record_usage("acme", n, 64)
    assert report is pipeline.last_report("acme")
    assert (report.prompt_tokens, report.reused_tokens, report.computed_tokens) == (n, 64, n - 64)
    assert report.kv_reuse_ratio == pytest.approx(64 / n)
    assert sum(report.reused_by_layer.values()) == 64
    assert sum(report.computed_by_layer.values()) == n - 64
    assert report.reused_by_layer["axioms"] > 0 and report.computed_by_layer["user_turn"] > 0
    assert registry.get_sample_value("contextkit_pipeline_prompt_tokens_total",
                                     {"layer": "axioms", "kind": "reused"}) == \
        report.reused_by_layer["axioms"]
    # Usage of a request whose fields were not computed here: totals, no layer split.
    other = pipeline.record_usage(report, n + 5, 0)
    assert other.computed_tokens == n + 5 and other.reused_by_layer == {} == \
        other.computed_by_layer
    for args, match in (((n, n + 1), "exceeds"), ((-1, 0), "int >= 0"),
                        ((n, True), "int >= 0")):
        with pytest.raises(ValueError, match=match):
            pipeline.record_usage(report, *args)
    with pytest.raises(RuntimeError, match="no call for tenant 'initech'"):
        pipeline.record_usage("initech", 10, 0)


def test_rendered_prompt_ranges() -> None:
    rendered = RenderedPrompt("ab cd", [1, 2, 3], [(0, 2), (2, 5), (2, 5)])
    assert rendered.token_range(0, 1) == (0, 1)
    assert rendered.token_range(1, 3) == (0, 3)
    assert rendered.token_range(3, 5) == (1, 3)
    assert rendered.first_token_at(1) == 1 and rendered.first_token_at(2) == 1


class ModelsServer:
    """A real HTTP server answering ``GET /v1/models`` as vLLM's OpenAI server does."""

    def __init__(self, cards: list[dict[str, Any]]) -> None:
        cards_json = json.dumps({"object": "list", "data": cards}).encode()

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                found = self.path.rstrip("/") == "/v1/models"
                self.send_response(200 if found else 404)
                self.send_header("Content-Type", "application/json")
                body = cards_json if found else b"{}"
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def card(name: str, root: str) -> dict[str, Any]:
    return {"id": name, "object": "model", "created": 0, "owned_by": "vllm", "root": root,
            "parent": None, "max_model_len": 8192}


def test_from_server_reads_the_served_name_and_directory(served: ServedModel,
                                                         tmp_path: Path) -> None:
    one = ModelsServer([card("smol", str(served.model_dir))])
    two = ModelsServer([card("a", str(served.model_dir)), card("b", "/nowhere/model")])
    try:
        model = ServedModel.from_server(one.url + "/v1")
        assert (model.name, model.model_dir, model.base_url) == (
            "smol", served.model_dir, one.url + "/v1")
        messages = [{"role": "user", "content": "hi"}]
        assert model.render(messages) == served.render(messages)
        with pytest.raises(LabelRangeError, match="serves 2 models"):
            ServedModel.from_server(two.url)
        assert ServedModel.from_server(two.url, name="a").name == "a"
        with pytest.raises(LabelRangeError, match="not a directory here; pass model_dir="):
            ServedModel.from_server(two.url, name="b")
        assert ServedModel.from_server(two.url, name="b",
                                       model_dir=served.model_dir).name == "b"
        with pytest.raises(LabelRangeError, match="does not serve 'c'"):
            ServedModel.from_server(two.url, name="c")
    finally:
        one.close()
        two.close()
    with pytest.raises(LabelRangeError, match="is the server up") as info:
        ServedModel.from_server(one.url, timeout=2)
    assert "\n" not in str(info.value)


def test_from_config_attaches_a_served_model(served: ServedModel) -> None:
    pipeline = CacheAwareContextPipeline.from_config(served=served, pipeline={"tenant": "acme"},
                                                     metrics={"enabled": False})
    assert pipeline.engine is None and pipeline.served is served and pipeline.tenant == "acme"
    built = pipeline.build(layered(0))
    assert built.report.tenant == "acme"
    fields = pipeline.request_fields(pipeline.openai_messages([{"role": "user", "content": "x"}]))
    assert fields["cache_salt"] == "acme"


def test_volatile_from_is_where_the_next_call_stops_sharing_the_prompt(
        served: ServedModel) -> None:
    """The request names the first token of its trailing message of volatile layers;
    the agent's next call (its history grown by this turn, the volatile layers
    changed) shares no token of the prompt from there on."""
    pipeline = served_pipeline(served)
    history = [{"role": "user", "content": "Et la p95?"}]
    prompts = []
    for turn in range(4):
        pipeline.build(layered(turn))
        messages = pipeline.openai_messages(history)
        fields = pipeline.request_fields(messages)
        ids = served.render(messages).token_ids
        tail = fields["kv_transfer_params"][PARAMS_KEY]["volatile_from"]
        built = pipeline.last_built()
        assert built is not None and built.trailing
        first = next(s for s in spans_of(fields)
                     if s.source_layer == pipeline.config.get(built.trailing[0].layer).source)
        # the trailing message's first section, at its text (its span starts at the
        # message's markup, which the next call begins to share)
        assert first.start <= tail < first.end
        assert decode(served, ids[tail:]).startswith(
            built.section_texts[built.trailing[0].layer][:10])
        prompts.append((ids, tail, [s.layer for s in built.trailing]))
        history = [*history, {"role": "assistant", "content": f"p95 is {700 + turn} ms."},
                   {"role": "user", "content": f"And now ({turn})?"}]
    for (ids, tail, layers), (later, _, later_layers) in itertools.pairwise(prompts):
        shared = next((i for i, (a, b) in enumerate(zip(ids, later, strict=False)) if a != b),
                      min(len(ids), len(later)))
        assert shared <= tail, (shared, tail)
        if layers == later_layers:  # (the order moves a layer that stopped changing)
            # it shares all that comes before, up to the trailing message's markup
            assert shared >= tail - 8, (shared, tail)
    assert prompts[-1][2] == prompts[-2][2]  # the last two calls are such a pair

    # without a trailing message there is no tail to name
    single = served_pipeline(served, trailing_message=False)
    single.build(layered(0))
    fields = single.request_fields(single.openai_messages(history))
    assert "volatile_from" not in fields["kv_transfer_params"][PARAMS_KEY]


def test_reuse_chunks_opts_the_requests_in_through_their_salt(served: ServedModel) -> None:
    pipeline = served_pipeline(served, tenant="acme", reuse_chunks=True)
    pipeline.build(layered(0))
    fields = pipeline.request_fields(pipeline.openai_messages([{"role": "user",
                                                                "content": "hi"}]))
    assert fields["cache_salt"] == "acme#ck-chunks"
    plain = served_pipeline(served, tenant="acme")
    plain.build(layered(0))
    messages = plain.openai_messages([{"role": "user", "content": "hi"}])
    assert plain.request_fields(messages)["cache_salt"] == "acme"
