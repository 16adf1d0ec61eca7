"""A LangChain 1.x agent on a vLLM server (``ChatOpenAI``), with contextkit's middleware.

The agent is Atlas, the SRE assistant of contextkit's replay: a ten-layer system prompt
rebuilt on every call (time and platform state change each turn). ``create_agent`` runs
it on ``ChatOpenAI(base_url=<server>/v1)``; the pipeline is attached to the model the
server serves (:class:`~contextkit.pipeline.served.model.ServedModel`: the same tokenizer and chat
template), so every request carries, in ``extra_body``, the layer, importance and pin
flag of every token range and ``cache_salt`` = the tenant, for contextkit's vLLM
connector; the volatile layers go in a trailing system message after the history.

Start the server (see docs/vllm.md), then::

    python examples/langchain_vllm.py --base-url http://127.0.0.1:8000/v1 \\
        --model smollm2 --turns 4

``--model`` is the server's ``--served-model-name``; ``--model-dir`` the directory it
serves (default: the packaged SmolLM2 that ``make test-vllm`` serves). Serve with
``--enable-prompt-tokens-details`` to see the cached tokens. Prints, per turn, the
prompt tokens, the tokens the server reused from its caches (its prefix cache and
contextkit's connector) and the layer that broke the prefix; ``--json`` adds one JSON
object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-url", required=True,
                        help="the server's OpenAI API root, e.g. http://127.0.0.1:8000/v1")
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--model-dir", default=None,
                        help="the directory the server serves (default: packaged SmolLM2)")
    parser.add_argument("--turns", type=int, default=4, help="conversation turns (default 4)")
    parser.add_argument("--tenant", default="acme", help="tenant (vLLM cache_salt)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="reply length limit")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args(argv)

    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from pydantic import SecretStr

    from contextkit import AgentReplay, CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel
    from integrations.langchain import ContextKitCallbackHandler, ContextKitMiddleware

    served = (ServedModel(args.model_dir, name=args.model) if args.model_dir
              else ServedModel.packaged(name=args.model))
    pipeline = CacheAwareContextPipeline(served=served)
    model = ChatOpenAI(model=args.model, base_url=args.base_url, api_key=SecretStr("none"),
                       max_completion_tokens=args.max_new_tokens, temperature=0, stream_usage=True,
                       use_responses_api=False)
    replay = AgentReplay(turns=args.turns)
    current = {"turn": 0}

    def build_system_message(request: Any) -> str:  # the agent's own prompt builder
        return replay.build_marked(current["turn"])

    agent: Any = create_agent(model, tools=[], context_schema=dict,
                              middleware=[ContextKitMiddleware(pipeline, build_system_message)])
    handler = ContextKitCallbackHandler()
    messages: list[Any] = []
    rows = []
    print(f"{'turn':>4} {'prompt':>7} {'cached':>7} {'reuse':>6}  broken by")
    for turn in replay.turns():
        current["turn"] = turn.index
        state = agent.invoke({"messages": [*messages, ("user", turn.user_message)]},
                             config={"callbacks": [handler]}, context={"tenant": args.tenant})
        messages = state["messages"]
        report = pipeline.last_report(args.tenant)
        assert report is not None
        row = {"turn": turn.index + 1, "prompt_tokens": report.prompt_tokens,
               "cached_tokens": report.reused_tokens, "kv_reuse_ratio": report.kv_reuse_ratio,
               "prefix_broken_by": report.prefix_broken_by,
               "reused_by_layer": report.reused_by_layer,
               "layer_order": report.layer_order, "trailing_layers": report.trailing_layers}
        rows.append(row)
        print(f"{row['turn']:>4} {report.prompt_tokens:>7} {report.reused_tokens:>7} "
              f"{report.kv_reuse_ratio:>6.0%}  {report.prefix_broken_by}", flush=True)
    summary = handler.summary()
    print(f"{summary['calls']} calls, {summary['cache_hit_ratio']:.0%} of prompt tokens "
          f"reused by the server, tenant {args.tenant!r}")
    if args.json:
        print(json.dumps({"example": "langchain_vllm", **summary, "turns": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
