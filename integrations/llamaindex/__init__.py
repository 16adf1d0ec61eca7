"""LlamaIndex: an LLM on the engine, an instrumentation event handler, a legacy callback.

Adopting contextkit in a LlamaIndex chat engine::

    from llama_index.core.chat_engine import SimpleChatEngine
    from llama_index.core.instrumentation import get_dispatcher
    from contextkit import CacheAwareContextPipeline, Engine
    from integrations.llamaindex import ContextKitEventHandler, ContextKitLLM

    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    llm = ContextKitLLM(engine, pipeline=pipeline, build_system_message=build_system_message)
    handler = ContextKitEventHandler()
    get_dispatcher().add_event_handler(handler)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory())
    chat.chat("What changed since the deploy?")

- :class:`ContextKitLLM` runs chat messages on the embedded engine. A system
  message with ``[LAYER]`` markers (or the output of ``build_system_message``,
  called on every chat) goes through the pipeline: budgets, volatility order,
  layer-tagged blocks, pinned stable prefix. Responses carry OpenAI-shaped usage
  in ``raw["usage"]`` (``prompt_tokens_details.cached_tokens`` = reused tokens).
- :class:`ContextKitOpenAILike` wraps an OpenAI-compatible LLM (``OpenAILike(
  is_chat_model=True)`` or ``OpenAI``) pointed at a vLLM server: with a pipeline
  attached to the served model (:class:`~contextkit.pipeline.served.model.ServedModel`) it lays each
  chat out as the embedded engine does (volatile layers in a trailing system message
  after the history), sends the request fields of contextkit's vLLM connector in
  ``extra_body`` (layer, importance and pin of every token range, ``cache_salt`` = the
  tenant) and records the server's usage in the call's report.
- :class:`ContextKitEventHandler` (instrumentation: the chat and completion start and end
  events) and :class:`ContextKitLlamaCallbackHandler` (legacy ``CBEventType.LLM``)
  record layers, usage and cache reads of every call, for any LLM.

The modules: ``llm`` (:class:`ContextKitLLM`: what it supports and refuses),
``openai_like`` (:class:`ContextKitOpenAILike`), ``handlers`` (the two handlers); every
name is importable from ``integrations.llamaindex``.

Requires the ``llamaindex`` extra (``pip install 'contextkit[llamaindex]'``).
"""

from __future__ import annotations

from contextkit.config.errors import require

require("llama_index.core", "llamaindex")

from integrations.llamaindex.handlers import (  # noqa: E402
    ContextKitEventHandler,
    ContextKitLlamaCallbackHandler,
)
from integrations.llamaindex.llm import ContextKitLLM  # noqa: E402
from integrations.llamaindex.openai_like import ContextKitOpenAILike  # noqa: E402

__all__ = [
    "ContextKitEventHandler",
    "ContextKitLLM",
    "ContextKitLlamaCallbackHandler",
    "ContextKitOpenAILike",
]
