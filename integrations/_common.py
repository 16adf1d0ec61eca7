"""What the LangChain and LlamaIndex integrations share.

- :class:`EngineChat` runs a chat conversation on the contextkit engine: through the
  pipeline's layout when the system prompt was built by the pipeline (layer-tagged
  blocks, pinned stable prefix, volatile layers after the history), otherwise
  through the model's own chat template. Stop strings and token streaming included.
- :class:`CallLog` is the telemetry both frameworks' handlers write: one
  :class:`ModelCall` per model call, with the usage and prompt-cache figures that
  the provider reported (engine, Anthropic or OpenAI shapes).
- :func:`split_system_text` splits a layered system prompt into the stable prefix,
  the changing layers and the trailing volatile layers: separate content blocks, so
  that providers' own prompt caches can cache the stable one.

Nothing here imports LangChain or LlamaIndex.
"""

from __future__ import annotations

import asyncio
import queue
import statistics
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from contextkit.engine.engine import Engine, GenerationResult
from contextkit.engine.sampling import SamplingParams
from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport
from contextkit.prompt.markup import coerce_prompt, has_markers, render_marked

__all__ = [
    "CallLog",
    "ChatRun",
    "ContextWindowError",
    "EngineChat",
    "LogView",
    "ModelCall",
    "SystemParts",
    "layers_in",
    "split_system_text",
    "unknown_setting",
    "usage_from",
]

Conversation = Sequence[tuple[str, str]]


# ---------------------------------------------------------------------------- system text
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


def unknown_setting(name: str, known: Sequence[str], who: str,
                    refused: Mapping[str, str] | None = None) -> str:
    """The one-line error for a setting ``who`` does not take: why it is refused, or the
    nearest known name and the list of known ones."""
    import difflib

    if refused and name in refused:
        return f"setting {name!r} is refused: {refused[name]}"
    near = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else ""
    return f"unknown setting {name!r}{hint}; {who} takes {', '.join(sorted(known))}"


# ---------------------------------------------------------------------------- running
_SHORTEN = "shorten the prompt or the reply, or give the engine more num_device_blocks"


class ContextWindowError(ValueError):
    """A prompt plus its reply is longer than one request can hold on the engine
    (:attr:`~contextkit.engine.engine.Engine.context_tokens`); nothing ran."""


@dataclass
class ChatRun:
    """One finished generation on the engine."""

    text: str
    generation: GenerationResult
    report: CallReport | None
    finish_reason: str  # "stop" (EOS or a stop string) or "length"

    def usage(self) -> dict[str, Any]:
        """Token usage in LangChain's ``UsageMetadata`` shape (cache read = reused)."""
        g = self.generation
        out = len(g.token_ids)
        return {"input_tokens": g.prompt_tokens, "output_tokens": out,
                "total_tokens": g.prompt_tokens + out,
                "input_token_details": {"cache_read": g.reused_tokens,
                                        "cache_creation": g.computed_tokens}}

    def metadata(self, model_name: str) -> dict[str, Any]:
        """Provider-style response metadata with the engine's telemetry."""
        g = self.generation
        meta: dict[str, Any] = {
            "model_name": model_name, "finish_reason": self.finish_reason,
            "ttft_ms": round(g.ttft_ms, 3), "total_ms": round(g.total_ms, 3),
            "reused_tokens": g.reused_tokens, "computed_tokens": g.computed_tokens,
            "kv_reuse_ratio": round(g.kv_reuse_ratio, 6), "kv_format": g.kv_format,
            "blocks_per_tier": dict(g.blocks_per_tier)}
        if self.report is not None:
            meta["contextkit"] = self.report.to_dict()
        return meta


class _TextStream:
    """Incremental detokenization with stop strings (never emits part of a stop)."""

    def __init__(self, decode: Callable[[Sequence[int]], str], stop: Sequence[str]) -> None:
        self.decode = decode
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""
        self.stopped = False

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.decode(self.ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for more
            return ""
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            safe = cut
        else:
            self.text = text
            safe = len(text) - self._held(text)
        delta = text[self.sent:safe] if safe > self.sent else ""
        self.sent = max(self.sent, safe)
        return delta

    def _held(self, text: str) -> int:
        """Length of the longest tail of ``text`` that could start a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if s.startswith(text[-k:]):
                    best = k
                    break
        return best

    def rest(self) -> str:
        delta = self.text[self.sent:]
        self.sent = len(self.text)
        return delta


class EngineChat:
    """Run chat messages on a contextkit :class:`~contextkit.engine.engine.Engine`.

    Args:
        engine: the embedded engine.
        pipeline: the pipeline that builds the layered system prompt (optional).
        tenant: default tenant (blocks are never shared across tenants); ``None``:
            the pipeline's rule at each call (its innermost ``tenant_scope``, else its
            default tenant), or ``"default"`` without a pipeline.
    """

    def __init__(self, engine: Engine, pipeline: CacheAwareContextPipeline | None = None,
                 tenant: str | None = None, too_long_hint: str = "") -> None:
        if pipeline is not None and pipeline.engine is not None and pipeline.engine is not engine:
            raise ValueError("the pipeline is attached to another engine; build it with "
                             "CacheAwareContextPipeline(engine) for the same engine")
        self.engine = engine
        self.pipeline = pipeline
        self.tenant = tenant
        #: What a :class:`ContextWindowError` adds on what to change (per framework).
        self.too_long_hint = too_long_hint

    def resolve_tenant(self, tenant: str | None = None) -> str:
        """The tenant of a call: ``tenant``, else this runner's, else the pipeline's rule."""
        if tenant or self.tenant:
            return str(tenant or self.tenant)
        return self.pipeline.resolve_tenant() if self.pipeline is not None else "default"

    @property
    def model_name(self) -> str:
        return str(getattr(self.engine, "model_id", "contextkit"))

    @property
    def context_tokens(self) -> int:
        """The longest prompt plus reply one request can hold (see
        :attr:`Engine.context_tokens <contextkit.engine.engine.Engine.context_tokens>`)."""
        return int(self.engine.context_tokens)

    def prompt_ids(self, messages: Conversation) -> list[int]:
        """The prompt ids of ``messages`` through the model's chat template (with the
        assistant header): what a call without a pipeline-built system prompt sends."""
        return self._template(messages)

    def run(self, messages: Conversation, *, built: BuiltPrompt | None = None,
            tenant: str | None = None, max_new_tokens: int = 128,
            stop: Sequence[str] = (), on_text: Callable[[str], None] | None = None,
            cancel: threading.Event | None = None, sampling: SamplingParams | None = None,
            timeout: float | None = None) -> ChatRun:
        """Generate the assistant's reply to ``messages`` (``(role, text)`` pairs).

        With ``built`` (the pipeline built the system prompt), the first system
        message is replaced by the pipeline's layout; the last user message is the
        current turn, anything after it (tool rounds) follows it. ``sampling`` picks
        the tokens (default greedy); ``timeout`` (seconds) bounds the whole call,
        checked after each token.

        Raises:
            ValueError: an unknown role, or no messages.
            CacheFullError: the prompt does not fit the device tier (nothing lost).
            TimeoutError: ``timeout`` passed before the reply was finished.
        """
        if not messages:
            raise ValueError("no messages to answer")
        stream = _TextStream(self.engine.decode, stop)
        deadline = None if timeout is None else time.monotonic() + timeout
        late = threading.Event()

        def on_token(token: int) -> bool:
            delta = stream.push(token)
            if delta and on_text is not None:
                on_text(delta)
            if deadline is not None and time.monotonic() > deadline:
                late.set()
            return stream.stopped or late.is_set() or (cancel is not None and cancel.is_set())

        report: CallReport | None = None
        if built is not None and self.pipeline is not None:
            rest = list(messages[1:]) if messages[0][0] == "system" else list(messages)
            last_user = max((i for i, (role, _) in enumerate(rest) if role == "user"),
                            default=None)
            if last_user is None:
                history, user, after = rest, None, []
            else:
                history, user, after = rest[:last_user], rest[last_user][1], rest[last_user + 1:]
            res = self.pipeline.generate(user, history=history, after=after, built=built,
                                         max_new_tokens=max_new_tokens,
                                         tenant=tenant or built.report.tenant,
                                         on_token=on_token, sampling=sampling)
            generation, report = res.generation, res.report
        else:
            ids = self._template(messages)
            window = self.context_tokens
            if len(ids) + max_new_tokens > window:
                raise ContextWindowError(
                    f"the prompt is {len(ids)} tokens and the reply may take {max_new_tokens}, "
                    f"more than the {window} tokens one request can hold on this engine "
                    f"(its model's positions or device tier, whichever is fewer): "
                    f"{self.too_long_hint or _SHORTEN}")
            generation = self.engine.generate(ids, max_new_tokens=max_new_tokens,
                                              tenant=self.resolve_tenant(tenant),
                                              on_token=on_token, sampling=sampling)
        made = generation.token_ids
        cut_short = not stream.stopped and len(made) < max_new_tokens and not (
            made and made[-1] in self.engine.stop_ids)
        if late.is_set() and cut_short:
            raise TimeoutError(f"the reply was not finished within timeout={timeout} s "
                               f"({len(made)} tokens generated); raise the timeout or lower "
                               "max_tokens")
        tail = stream.rest()
        if tail and on_text is not None:
            on_text(tail)
        ended = stream.stopped or (bool(generation.token_ids)
                                   and generation.token_ids[-1] in self.engine.stop_ids)
        return ChatRun(stream.text, generation, report, "stop" if ended else "length")

    def stream(self, messages: Conversation, **kwargs: Any) -> Iterator[str | ChatRun]:
        """Like :meth:`run`, yielding text deltas as they decode, then the :class:`ChatRun`.

        The engine runs on a worker thread; closing the iterator early stops the
        generation after the current token.
        """
        q: queue.Queue[tuple[str, Any]] = queue.Queue()
        cancel = threading.Event()

        def work() -> None:
            try:
                q.put(("done", self.run(messages, on_text=lambda t: q.put(("text", t)),
                                        cancel=cancel, **kwargs)))
            except BaseException as exc:  # handed to the consumer
                q.put(("error", exc))

        worker = threading.Thread(target=work, name="contextkit-stream", daemon=True)
        worker.start()
        try:
            while True:
                kind, value = q.get()
                if kind == "text":
                    yield value
                elif kind == "done":
                    yield value
                    return
                else:
                    raise value
        finally:
            cancel.set()
            worker.join()

    async def astream(self, messages: Conversation, **kwargs: Any
                      ) -> AsyncIterator[str | ChatRun]:
        """:meth:`stream` for asyncio: the engine runs on a worker thread, the event loop
        only receives the deltas. Cancelling the task (or closing the iterator) stops
        the generation after the current token; the loop never waits for the engine."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()

        def put(kind: str, value: Any) -> None:
            try:
                loop.call_soon_threadsafe(q.put_nowait, (kind, value))
            except RuntimeError:  # the loop is closed: nobody is listening any more
                cancel.set()

        def work() -> None:
            try:
                put("done", self.run(messages, on_text=lambda t: put("text", t),
                                     cancel=cancel, **kwargs))
            except BaseException as exc:  # handed to the consumer
                put("error", exc)

        threading.Thread(target=work, name="contextkit-astream", daemon=True).start()
        try:
            while True:
                kind, value = await q.get()
                if kind == "error":
                    raise value
                yield value
                if kind == "done":
                    return
        finally:
            cancel.set()

    async def arun(self, messages: Conversation, **kwargs: Any) -> ChatRun:
        """:meth:`run` off the event loop (cancellable: see :meth:`astream`)."""
        items = self.astream(messages, **kwargs)
        try:
            async for item in items:
                if isinstance(item, ChatRun):
                    return item
        finally:
            await items.aclose()  # type: ignore[attr-defined]  # stops the engine when cancelled
        raise AssertionError("astream ended without a ChatRun")  # pragma: no cover

    def _template(self, messages: Conversation) -> list[int]:
        tok = self.engine.tokenizer
        chat = [{"role": role, "content": text} for role, text in messages]
        ids = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return [int(t) for t in ids]


# ---------------------------------------------------------------------------- telemetry
def _get(obj: Any, key: str) -> Any:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def usage_from(obj: Any) -> dict[str, int]:
    """Normalize a usage report to input/output/cache_read/cache_creation tokens.

    Understands LangChain's ``UsageMetadata`` (``input_token_details``), Anthropic's
    usage (``cache_read_input_tokens``, ``cache_creation_input_tokens``) and
    OpenAI's (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``), as
    mappings or objects. Missing figures are left out.
    """
    if obj is None:
        return {}
    out: dict[str, int] = {}

    def put(name: str, *values: Any) -> None:
        for v in values:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[name] = int(v)
                return

    put("input_tokens", _get(obj, "input_tokens"), _get(obj, "prompt_tokens"))
    put("output_tokens", _get(obj, "output_tokens"), _get(obj, "completion_tokens"))
    details = _get(obj, "input_token_details")
    put("cache_read_tokens", _get(details, "cache_read"), _get(obj, "cache_read_input_tokens"),
        _get(_get(obj, "prompt_tokens_details"), "cached_tokens"))
    put("cache_creation_tokens", _get(details, "cache_creation"),
        _get(obj, "cache_creation_input_tokens"))
    return out


@dataclass
class ModelCall:
    """One model call seen by a telemetry handler."""

    run_id: str
    framework: str
    model: str | None = None
    tenant: str | None = None
    started_at: float = 0.0
    latency_ms: float | None = None
    messages: int = 0
    system_chars: int = 0
    layers: list[str] = field(default_factory=list)
    #: the system message's content blocks: characters and whether each has a
    #: provider cache breakpoint
    content_blocks: list[dict[str, Any]] = field(default_factory=list)
    stable_hash: str | None = None
    prefix_broken_by: str | None = None
    input_tokens: int | None = None
    output_tokens: int | None = None
    cache_read_tokens: int | None = None
    cache_creation_tokens: int | None = None
    ttft_ms: float | None = None
    kv_reuse_ratio: float | None = None
    error: str | None = None
    done: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class CallLog:
    """Thread-safe log of :class:`ModelCall` records, with a summary.

    Args:
        sink: called with each finished record (e.g. to export metrics).
        max_records: oldest records are dropped beyond this.
    """

    def __init__(self, sink: Callable[[ModelCall], None] | None = None,
                 max_records: int = 10_000) -> None:
        self.sink = sink
        self.max_records = max_records
        self._records: list[ModelCall] = []
        self._open: dict[str, tuple[ModelCall, float]] = {}
        self._lock = threading.Lock()

    def start(self, run_id: str, framework: str, **fields: Any) -> ModelCall:
        rec = ModelCall(run_id=str(run_id), framework=framework, started_at=time.time(),
                        **fields)
        with self._lock:
            self._open[rec.run_id] = (rec, time.perf_counter())
            self._records.append(rec)
            del self._records[:-self.max_records]
        return rec

    def end(self, run_id: str, *, error: str | None = None, **fields: Any) -> ModelCall | None:
        """Finish a record (unknown run ids are ignored: observing never raises)."""
        with self._lock:
            entry = self._open.pop(str(run_id), None)
        if entry is None:
            return None
        rec, t0 = entry
        rec.latency_ms = (time.perf_counter() - t0) * 1000
        for key, value in fields.items():
            if value is not None and hasattr(rec, key):
                setattr(rec, key, value)
        rec.error = error
        rec.done = True
        if self.sink is not None:
            self.sink(rec)
        return rec

    def is_open(self, run_id: str) -> bool:
        """Whether ``run_id`` was started and not ended yet."""
        with self._lock:
            return str(run_id) in self._open

    @property
    def records(self) -> list[ModelCall]:
        with self._lock:
            return list(self._records)

    def summary(self) -> dict[str, Any]:
        """Totals over finished calls: tokens, cache reads, hit ratio, TTFT p50."""
        done = [r for r in self.records if r.done]
        total_in = sum(r.input_tokens or 0 for r in done)
        read = sum(r.cache_read_tokens or 0 for r in done)
        ttfts = [r.ttft_ms for r in done if r.ttft_ms is not None]
        return {
            "calls": len(done), "errors": sum(1 for r in done if r.error),
            "input_tokens": total_in, "output_tokens": sum(r.output_tokens or 0 for r in done),
            "cache_read_tokens": read,
            "cache_creation_tokens": sum(r.cache_creation_tokens or 0 for r in done),
            "cache_hit_ratio": read / total_in if total_in else 0.0,
            "ttft_ms_p50": statistics.median(ttfts) if ttfts else None,
        }


class LogView:
    """``records`` and ``summary()`` of a handler's :class:`CallLog` (``self.log``)."""

    log: CallLog

    @property
    def records(self) -> list[ModelCall]:
        """Every call seen so far (oldest first)."""
        return self.log.records

    def summary(self) -> dict[str, Any]:
        """See :meth:`CallLog.summary`."""
        return self.log.summary()
