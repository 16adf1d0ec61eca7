"""Chunk reuse's bound in a bench run: vLLM computing only what no earlier prompt held.

The oracle of ``bench chunks-vllm`` and ``bench agents-vllm``. A cache that held every
prompt a tenant ever sent, and every span of them at every position, with no seam to
repair and nothing to place, leaves one thing to compute: past the longest prefix (in
whole blocks) an earlier prompt began with, the spans the tenant never sent before (a
new document, a changed layer, the last reply, the question). The oracle serves
exactly that on a stock vLLM server with room for every agent: the prompt is reordered
so what the cache holds comes first, warmed untimed into vLLM's prefix cache (rounded
up to whole blocks), and the new tokens after it are timed, at the prompt's full
length.

- :class:`KnownSpans`: what each tenant has sent, and the split of a prompt into what
  it holds and the rest;
- :func:`oracle_middleware`: the same for a LangChain agent, the innermost middleware
  of its chain (after ``ContextKitMiddleware``): it answers the model call itself from
  the request contextkit labelled, and says what it measured (:class:`OracleCall`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["BLOCK", "KnownSpans", "OracleCall", "oracle_middleware"]

#: vLLM's block in the benches: the oracle's warm prefix is rounded up to it.
BLOCK = 32


class KnownSpans:
    """What the oracle's cache holds for each tenant: every span it sent (label and
    tokens), wherever it was, and every prompt it sent, as a prefix."""

    def __init__(self) -> None:
        self.known: dict[str, set[tuple[str, tuple[int, ...]]]] = {}
        self.prompts: dict[str, list[tuple[int, ...]]] = {}

    def add(self, tenant: str, ids: list[int], spans: Sequence[tuple[int, int, str]]) -> None:
        known = self.known.setdefault(tenant, set())
        known.update((label, tuple(ids[a:b])) for a, b, label in spans)
        self.prompts.setdefault(tenant, []).append(tuple(ids))

    def prefix(self, tenant: str, ids: Sequence[int]) -> int:
        """The longest prefix of ``ids`` an earlier prompt of the tenant began with, in
        whole blocks (what a prefix cache holds, a changed span's first blocks too)."""
        longest = max((_shared(prompt, ids) for prompt in self.prompts.get(tenant, ())),
                      default=0)
        return longest // BLOCK * BLOCK

    def split(self, tenant: str, ids: list[int], spans: Sequence[tuple[int, int, str]]
              ) -> tuple[list[int], list[int]]:
        """The prompt's tokens the cache holds (its known prefix, then the known spans
        after it, in order), and the rest: the unknown spans past the prefix and any
        unlabelled text after the first of them."""
        known = self.known.get(tenant, set())
        at = self.prefix(tenant, ids)
        held: list[int] = list(ids[:at])
        new: list[int] = []
        first_new: int | None = None
        for a, b, label in sorted(spans):
            if b <= at:
                continue
            if a > at:  # unlabelled text between spans: new once something was
                (new if first_new is not None else held).extend(ids[at:a])
                at = a
            fresh = (label, tuple(ids[a:b])) not in known
            if fresh and first_new is None:
                first_new = at
            (new if fresh else held).extend(ids[at:b])
            at = b
        (new if first_new is not None else held).extend(ids[at:])
        return held, new

    def oracle_prompt(self, tenant: str, ids: list[int],
                      spans: Sequence[tuple[int, int, str]]
                      ) -> tuple[list[int], list[int], int]:
        """``(prompt, warm, held)``: the oracle's prompt (the held tokens, then the new
        ones), its prefix to warm untimed (the held tokens rounded up to whole blocks)
        and how many tokens the known spans held."""
        held, new = self.split(tenant, ids, spans)
        pad = -len(held) % BLOCK
        return held + new, held + new[:pad], len(held)


def _shared(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens ``a`` and ``b`` begin with alike."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))


@dataclass
class OracleCall:
    """What the oracle measured for one model call.

    Attributes:
        entered: ``time.perf_counter()`` at the middleware's entry: the caller's TTFT
            is from its own start to here, plus :attr:`server_ms`.
        server_ms: the timed one-token request.
        prompt_tokens, cached_tokens: the server's usage of it.
        held_tokens: the tokens the tenant's known spans held.
    """

    entered: float
    server_ms: float
    prompt_tokens: int
    cached_tokens: int
    held_tokens: int


def oracle_middleware(served: Any, srv: Any, known: KnownSpans, model: str) -> Any:
    """A LangChain ``AgentMiddleware`` that answers each model call with the oracle.

    It reads the request as ``ContextKitMiddleware`` left it (the system message, the
    messages and contextkit's labels in ``extra_body``), renders it to the server's
    prompt ids with ``served`` (:class:`~contextkit.pipeline.served.model.ServedModel`),
    and sends ``srv`` (a vLLM server with room for every agent, no connector) the
    oracle's prompt under the request's ``cache_salt``: first its warm prefix, untimed,
    then the whole of it, one token, timed. The call's reply is that one token (an
    agent's history comes from the run's transcript); ``last`` holds the
    :class:`OracleCall`.

    Raises (from the call):
        RuntimeError: the request carries no contextkit labels, or its labels were
            computed on another prompt than the one rendered here.
    """
    from langchain.agents.middleware import AgentMiddleware
    from langchain_core.messages import AIMessage

    from contextkit.pipeline.served.wire import decode_fingerprint, decode_spans, labels_entry
    from integrations.langchain.middleware import openai_payload_messages

    class Oracle(AgentMiddleware):
        def __init__(self) -> None:
            super().__init__()
            self.last: OracleCall | None = None

        @property
        def name(self) -> str:
            return "ChunkReuseOracle"

        def wrap_model_call(self, request: Any, handler: Any) -> Any:
            entered = time.perf_counter()
            extra = dict(request.model_settings.get("extra_body") or {})
            entry = labels_entry(extra.get("kv_transfer_params"))
            if not entry:
                raise RuntimeError("the oracle needs contextkit's labels on the request: put "
                                   "ContextKitMiddleware with a served pipeline before it")
            messages = [m for m in (request.system_message, *request.messages)
                        if m is not None]
            sent, tools = openai_payload_messages(request.model, messages, request.tools)
            ids = list(served.render(sent, tools).token_ids)
            count, _ = decode_fingerprint(entry)
            if count != len(ids):
                raise RuntimeError(f"the labels were computed on a {count}-token prompt, the "
                                   f"oracle rendered {len(ids)} tokens")
            spans = [(s.start, s.end, s.source_layer) for s in decode_spans(entry)[1]]
            tenant = str(extra.get("cache_salt") or "")
            prompt, warm, held = known.oracle_prompt(tenant, ids, spans)
            body = {"model": model, "temperature": 0, "max_tokens": 1, "cache_salt": tenant}
            if warm:
                srv.post("/v1/completions", {**body, "prompt": warm})
            sent_at = time.perf_counter()
            reply = srv.post("/v1/completions", {**body, "prompt": prompt})
            done = time.perf_counter()
            known.add(tenant, ids, spans)
            usage = reply.get("usage") or {}
            cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
            prompt_tokens = int(usage.get("prompt_tokens") or len(prompt))
            self.last = OracleCall(entered, 1000 * (done - sent_at), prompt_tokens, cached,
                                   held)
            return AIMessage(content=str(reply["choices"][0]["text"]), usage_metadata={
                "input_tokens": prompt_tokens, "output_tokens": 1,
                "total_tokens": prompt_tokens + 1,
                "input_token_details": {"cache_read": cached}})

    return Oracle()
