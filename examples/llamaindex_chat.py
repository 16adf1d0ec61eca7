"""A LlamaIndex chat engine on the embedded engine, with contextkit's pipeline.

The same Atlas agent as ``langchain_agent.py``: its ten-layer system prompt is
rebuilt on every call by ``build_system_message`` and goes through the pipeline
inside :class:`~integrations.llamaindex.ContextKitLLM`; a ``SimpleChatEngine`` keeps
the conversation; an instrumentation event handler records each call.

    python examples/llamaindex_chat.py --turns 5

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

    from llama_index.core.chat_engine import SimpleChatEngine
    from llama_index.core.instrumentation import get_dispatcher

    from contextkit import AgentReplay, CacheAwareContextPipeline, Engine
    from integrations.llamaindex import ContextKitEventHandler, ContextKitLLM

    replay = AgentReplay(turns=args.turns)
    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)
    current = {"turn": 0}

    def build_system_message(messages: Any) -> str:  # the agent's own prompt builder
        return replay.build_marked(current["turn"])

    llm = ContextKitLLM(engine, pipeline=pipeline, build_system_message=build_system_message,
                        max_new_tokens=args.max_new_tokens)
    handler = ContextKitEventHandler()
    get_dispatcher().add_event_handler(handler)
    chat = SimpleChatEngine.from_defaults(llm=llm, memory=llm.memory())
    print(f"{'turn':>4} {'TTFT ms':>9} {'prompt':>7} {'reused':>7} {'reuse':>6}  broken by")
    for turn in replay.turns():
        current["turn"] = turn.index
        chat.chat(turn.user_message)
        rec = handler.records[-1]
        print(f"{turn.index + 1:>4} {rec.ttft_ms:>9.0f} {rec.input_tokens:>7} "
              f"{rec.cache_read_tokens:>7} {rec.cache_read_tokens / rec.input_tokens:>6.0%}  "
              f"{rec.prefix_broken_by}", flush=True)
    summary = handler.summary()
    print(f"{summary['calls']} calls, {summary['cache_hit_ratio']:.0%} of prompt tokens "
          f"read from the cache, pinned blocks: {len(pipeline.pinned_blocks())}")
    if args.json:
        print(json.dumps({"example": "llamaindex_chat", **summary,
                          "turns": [r.to_dict() for r in handler.records]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
