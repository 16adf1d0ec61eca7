"""A LangChain 1.x agent on the embedded engine, with contextkit's middleware.

The agent is Atlas, the SRE assistant of contextkit's replay: a ten-layer, ~6K-token
system prompt rebuilt on every call (time and platform state change each turn,
memories when the topic changes). ``create_agent`` runs it on the packaged SmolLM2
through :class:`~integrations.langchain.ContextKitChatModel`; the middleware builds
the system message through the pipeline; the callback handler records each call.

    python examples/langchain_agent.py --turns 5

Prints, per turn, the time to first token and how much of the prompt was reused
from the cache; ``--json`` adds one JSON object as the last line.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=5, help="conversation turns (default 5)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="reply length limit")
    parser.add_argument("--json", action="store_true", help="print a JSON summary last")
    args = parser.parse_args(argv)

    from langchain.agents import create_agent

    from contextkit import AgentReplay, CacheAwareContextPipeline, Engine
    from integrations.langchain import (
        ContextKitCallbackHandler,
        ContextKitChatModel,
        ContextKitMiddleware,
    )

    replay = AgentReplay(turns=args.turns)
    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    current = {"turn": 0}

    def build_system_message(request: Any) -> str:  # the agent's own prompt builder
        return replay.build_marked(current["turn"])

    agent = create_agent(
        ContextKitChatModel(engine=engine, pipeline=pipeline, max_tokens=args.max_new_tokens),
        tools=[],
        middleware=[ContextKitMiddleware(pipeline, build_system_message)],
    )
    handler = ContextKitCallbackHandler()
    messages: list[Any] = []
    print(f"{'turn':>4} {'TTFT ms':>9} {'prompt':>7} {'reused':>7} {'reuse':>6}  broken by")
    for turn in replay.turns():
        current["turn"] = turn.index
        state = agent.invoke({"messages": [*messages, ("user", turn.user_message)]},
                             config={"callbacks": [handler]})
        messages = state["messages"]
        rec = handler.records[-1]
        report = pipeline.last_report()
        assert report is not None
        print(f"{turn.index + 1:>4} {rec.ttft_ms:>9.0f} {rec.input_tokens:>7} "
              f"{rec.cache_read_tokens:>7} {rec.cache_read_tokens / rec.input_tokens:>6.0%}  "
              f"{report.prefix_broken_by}", flush=True)
    summary = handler.summary()
    print(f"{summary['calls']} calls, {summary['cache_hit_ratio']:.0%} of prompt tokens "
          f"read from the cache, pinned blocks: {len(pipeline.pinned_blocks())}")
    if args.json:
        print(json.dumps({"example": "langchain_agent", **summary,
                          "turns": [r.to_dict() for r in handler.records]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
