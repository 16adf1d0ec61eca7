"""Chat conversations on the contextkit engine, for the LangChain and LlamaIndex models.

:class:`EngineChat` runs one through the pipeline's layout when the system prompt was
built by the pipeline (layer-tagged blocks, pinned stable prefix, volatile layers after
the history), otherwise through the model's own chat template; stop strings, token
streaming, cancellation and timeouts included. :func:`unknown_setting` is the one-line
error both models give for a setting they do not take. Nothing here imports LangChain
or LlamaIndex.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from contextkit.engine.engine import Engine, GenerationResult
from contextkit.engine.sampling import SamplingParams
from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport

__all__ = ["ChatRun", "ContextWindowError", "Conversation", "EngineChat", "unknown_setting"]

Conversation = Sequence[tuple[str, str]]


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
