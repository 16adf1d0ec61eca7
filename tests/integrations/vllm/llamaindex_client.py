"""One LlamaIndex chat through contextkit's ``ContextKitOpenAILike`` against a vLLM server,
printing the usage LlamaIndex hands on and the call's report as one JSON line.

Run by ``test_vllm_pressure`` with the project's ``.venv`` interpreter, which has
LlamaIndex (``.venv-vllm`` has not): ``python llamaindex_client.py BASE_URL MODEL
TENANT SEED`` (as ``python -m tests.integrations.vllm.llamaindex_client`` from the
checkout).
"""

from __future__ import annotations

import json
import sys


def main(argv: list[str]) -> int:
    base, model, tenant, seed = argv
    from llama_index.core.llms import ChatMessage
    from llama_index.llms.openai_like import OpenAILike

    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel
    from integrations.llamaindex import ContextKitOpenAILike
    from tests.integrations.vllm.connector_server import words_text

    lines = "\n".join(words_text(int(seed) + i, 40) for i in range(20))  # ~1,100 tokens
    marked = f"[CAPABILITIES]\n{lines}\n[/CAPABILITIES]\n"
    pipeline = CacheAwareContextPipeline(served=ServedModel.packaged(name=model),
                                         tenant=tenant)
    llm = ContextKitOpenAILike(
        OpenAILike(model=model, api_base=base, api_key="none", is_chat_model=True,
                   max_tokens=2, temperature=0, max_retries=0),
        pipeline)
    reply = llm.chat([ChatMessage(role="system", content=marked),
                      ChatMessage(role="user", content="Summarise.")])
    raw = reply.raw
    if raw is None:
        raise SystemExit("the reply carries no raw response (no usage to show)")
    usage = raw["usage"] if isinstance(raw, dict) else raw.usage
    details = getattr(usage, "prompt_tokens_details", None)
    report = pipeline.last_report(tenant)
    print(json.dumps({"prompt_tokens": usage.prompt_tokens,
                      "cached_tokens": getattr(details, "cached_tokens", None),
                      "report_prompt_tokens": report.prompt_tokens if report else None,
                      "report_reused_tokens": report.reused_tokens if report else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
