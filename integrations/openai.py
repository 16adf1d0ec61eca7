"""The plain ``openai`` client against a vLLM server: the request a contextkit pipeline
attached to the served model lays out and labels.

::

    import openai
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel
    from integrations.openai import record_usage, request_kwargs

    served = ServedModel("/models/Qwen2.5-7B-Instruct", name="qwen")  # what vLLM serves
    pipeline = CacheAwareContextPipeline(served=served)
    client = openai.OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="x")

    pipeline.build(layered_system_prompt, tenant="acme")
    kwargs = request_kwargs(pipeline, [{"role": "user", "content": "Is checkout slow?"}],
                            tenant="acme")
    reply = client.chat.completions.create(model=served.name, **kwargs)
    record_usage(pipeline, reply, tenant="acme")

``kwargs["messages"]`` is the embedded engine's layout (main system message, history,
trailing system message with the volatile layers, current turn);
``kwargs["extra_body"]`` carries ``kv_transfer_params`` (layer, importance and pin of
every token range, with the prompt's fingerprint) and ``cache_salt`` (the tenant) for
contextkit's vLLM connector. This module does not import ``openai``.

Any other OpenAI-compatible server (``transformers serve``, ...) refuses those two fields:
:func:`chat_completion` sends the request, resends it without them when the server
refuses them (once; the served model then sends plain requests, said in one log line)
and records the usage::

    reply = chat_completion(client, pipeline, conversation, tenant="acme",
                            system=layered_system_prompt, max_tokens=64)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from contextkit.pipeline.pipeline import BuiltPrompt, CacheAwareContextPipeline, CallReport
from integrations._openai_compat import (
    fall_back,
    merge_extra_body,
    record_served_usage,
    without_fields,
)

__all__ = ["chat_completion", "record_usage", "request_kwargs"]


def request_kwargs(pipeline: CacheAwareContextPipeline,
                   conversation: Sequence[Mapping[str, Any]], *, tenant: str | None = None,
                   system: Any = None, built: BuiltPrompt | None = None,
                   tools: Sequence[Mapping[str, Any]] | None = None,
                   extra_body: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``{"messages": [...], "extra_body": {...}}`` for ``client.chat.completions.create``.

    Args:
        pipeline: a pipeline attached to a :class:`~contextkit.pipeline.served.model.ServedModel`.
        conversation: OpenAI-format messages without the system prompt (the history,
            the current user turn, its tool rounds).
        tenant: the call's tenant (default: the pipeline's rule); sent as ``cache_salt``.
        system: a layered system prompt to build first (``[LAYER]`` text, a mapping or a
            ``StructuredPrompt``); default: the tenant's last built prompt.
        built: a :meth:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline.build` result to
            use instead.
        tools: the request's ``tools`` (passed to the chat template as vLLM does); send
            the same list as ``tools=``.
        extra_body: your own ``extra_body`` fields; contextkit's are merged over them
            (``kv_transfer_params`` key by key).

    Raises:
        RuntimeError: the pipeline is not attached to a served model, or nothing is
            built for the tenant.
        LabelRangeError: the messages cannot be labelled exactly.
    """
    if system is not None:
        built = pipeline.build(system, tenant=tenant)
    messages = pipeline.openai_messages(conversation, tenant=tenant, built=built)
    fields = pipeline.request_fields(messages, tenant=tenant, built=built, tools=tools)
    return {"messages": messages, "extra_body": merge_extra_body(extra_body, fields)}


def record_usage(pipeline: CacheAwareContextPipeline, response: Any, *,
                 tenant: str | None = None, report: CallReport | None = None) -> bool:
    """Record a reply's usage (``prompt_tokens``, ``prompt_tokens_details.cached_tokens``)
    in the call's report: ``report``, else the tenant's last one.

    ``response`` is a ``ChatCompletion``, the final usage chunk of a stream (with
    ``stream_options={"include_usage": True}``), or its ``usage``. Returns whether
    anything was recorded (nothing when the reply has no usage).
    """
    usage = getattr(response, "usage", None)
    if usage is None and isinstance(response, Mapping):
        usage = response.get("usage", response)
    if usage is None:
        usage = response
    if report is None:
        report = pipeline.last_report(tenant)
    return record_served_usage(pipeline, report, usage)


def chat_completion(client: Any, pipeline: CacheAwareContextPipeline,
                    conversation: Sequence[Mapping[str, Any]], *, tenant: str | None = None,
                    system: Any = None, built: BuiltPrompt | None = None,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    extra_body: Mapping[str, Any] | None = None, **create_kwargs: Any) -> Any:
    """Send one chat turn through an ``openai.OpenAI`` client and record its usage.

    The request is :func:`request_kwargs`' (same arguments), sent to the served model's
    name with ``create_kwargs`` (``max_tokens``, ``stop``, ``n``, ``temperature``...). A
    server that refuses contextkit's fields gets the same request without them (see the
    module's docstring); with ``stream=True`` the stream is returned as it is (record
    its final usage chunk with :func:`record_usage`).

    Returns:
        The client's reply (a ``ChatCompletion``, or the stream).

    Raises:
        RuntimeError: the pipeline is not attached to a served model, or nothing is
            built for the tenant.
        LabelRangeError: the messages cannot be labelled exactly.
    """
    served = pipeline.served
    if served is None:
        raise RuntimeError("chat_completion needs a pipeline attached to a served model: "
                           "CacheAwareContextPipeline(served=ServedModel(model_dir))")
    if system is not None:
        built = pipeline.build(system, tenant=tenant)
    if built is None:
        built = pipeline.last_built(tenant)
    kwargs = request_kwargs(pipeline, conversation, tenant=tenant, built=built, tools=tools,
                            extra_body=extra_body)
    send = {"model": served.name, **create_kwargs, **({"tools": list(tools)} if tools else {})}
    report = built.report if built is not None else None
    try:
        reply = client.chat.completions.create(**kwargs, **send)
    except Exception as exc:
        if not fall_back(pipeline, report, exc):
            raise
        plain = without_fields(kwargs.pop("extra_body", None))
        reply = client.chat.completions.create(**kwargs, **send,
                                               **({"extra_body": plain} if plain else {}))
    if not create_kwargs.get("stream"):
        record_usage(pipeline, reply, tenant=tenant, report=report)
    return reply
