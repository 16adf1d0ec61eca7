"""LangChain 1.x: agent middleware, a telemetry callback, and a chat model on the engine.

Adopting contextkit in a ``create_agent`` agent::

    from langchain.agents import create_agent
    from contextkit import CacheAwareContextPipeline, Engine
    from integrations.langchain import (ContextKitCallbackHandler, ContextKitChatModel,
                                        ContextKitMiddleware)

    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    agent = create_agent(
        ContextKitChatModel(engine=engine, pipeline=pipeline),   # or any chat model
        tools=[],
        middleware=[ContextKitMiddleware(pipeline, build_system_message)],
    )
    handler = ContextKitCallbackHandler()
    agent.invoke({"messages": [("user", "hi")]}, config={"callbacks": [handler]})

- :class:`ContextKitMiddleware` (``wrap_model_call``) builds the system message
  through the pipeline each model call and overrides the request's system message
  with it: the stable prefix, the changing layers and the volatile layers are
  separate content blocks, the stable one with a ``cache_control`` breakpoint, so
  providers' prompt caches (Anthropic) benefit as well as contextkit's engine.
  For an OpenAI-compatible chat model (``ChatOpenAI`` and its subclasses, or any
  model with an ``extra_body`` field) the layout is the embedded engine's instead:
  the volatile layers go in a trailing system message after the history, so the
  server's prefix cache reuses the conversation too; with the pipeline attached to
  a :class:`~contextkit.pipeline.served.model.ServedModel` (a vLLM server), every call also carries
  the request fields of contextkit's vLLM connector in ``extra_body`` (layer,
  importance and pin of every token range, ``cache_salt`` = the tenant) and the
  server's reported usage goes into the call's report.
- :class:`ContextKitCallbackHandler` only observes: prompt layers and content
  blocks at ``on_chat_model_start``, usage and cache read/creation tokens at
  ``on_llm_end`` (whatever the provider reports). Callbacks cannot change messages.
- :class:`ContextKitChatModel` is a ``BaseChatModel`` (with streaming, real async,
  sampling settings, a profile and token counting) backed by the embedded engine; with
  the middleware, it lays the prompt out the pipeline's way (pinned stable prefix,
  volatile layers after the history). What it supports and refuses:
  :mod:`integrations.langchain.chat_model`.

The modules: ``middleware`` (the middleware and what the chat model shares with it),
``callbacks`` (the handler), ``chat_model`` (the chat model); every name is importable
from ``integrations.langchain``.

LangChain over a vLLM server::

    from langchain_openai import ChatOpenAI
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel

    served = ServedModel("/models/Qwen2.5-7B-Instruct", name="qwen")  # what vLLM serves
    pipeline = CacheAwareContextPipeline(served=served)
    model = ChatOpenAI(model="qwen", base_url="http://127.0.0.1:8000/v1", api_key="x",
                       stream_usage=True)
    agent = create_agent(model, tools=[...],
                         middleware=[ContextKitMiddleware(pipeline, build_system_message)])

Requires the ``langchain`` extra (``pip install 'contextkit[langchain]'``).
"""

from __future__ import annotations

from contextkit.config.errors import require

require("langchain.agents", "langchain")
require("langchain_core", "langchain")

from integrations.langchain.callbacks import ContextKitCallbackHandler  # noqa: E402
from integrations.langchain.chat_model import ContextKitChatModel, to_conversation  # noqa: E402
from integrations.langchain.middleware import (  # noqa: E402
    EPHEMERAL,
    METADATA_KEY,
    ContextKitMiddleware,
    is_openai_compatible,
    openai_payload_messages,
)

__all__ = [
    "EPHEMERAL",
    "METADATA_KEY",
    "ContextKitCallbackHandler",
    "ContextKitChatModel",
    "ContextKitMiddleware",
    "is_openai_compatible",
    "openai_payload_messages",
    "to_conversation",
]
