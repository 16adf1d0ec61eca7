"""A vLLM OpenAI server with contextkit's connector, sized for one end-to-end test module,
and the prompts those modules send. Imported by the ``test_vllm_*`` modules."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path
from typing import Any

BLOCK = 32
WORDS = ("alert", "latency", "replica", "deploy", "rollback", "quota", "shard", "region",
         "ticket", "budget", "canary", "cache", "queue", "trace", "index", "owner")


def words_text(seed: int, words: int) -> str:
    """``words`` seeded words of an on-call vocabulary: a prompt of about 1.3x as many
    tokens."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def connector_server(work: Path, served: str, *, kv_blocks: int, host_blocks: int,
                     max_model_len: int, device_blocks: int | None = None
                     ) -> tuple[Any, Path]:
    """A server (not started) whose vLLM KV holds ``kv_blocks`` blocks and whose
    connector's DDR budget is ``host_blocks`` (semantic eviction, no shadow; its device
    tier ``device_blocks``, default the connector's), and the path of the connector's
    per-request records."""
    from integrations.vllm.bench.harness import OpenAIServer
    from integrations.vllm.config import ConnectorConfig
    from integrations.vllm.model import packaged_model_dir

    stats = work / "stats.jsonl"
    config = ConnectorConfig(block_size=BLOCK, shadow_url="",
                             local_store=f"file://{work / 'local'}", stats_path=str(stats),
                             host_blocks=host_blocks, eviction="semantic",
                             **({"device_blocks": device_blocks} if device_blocks else {}))
    env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(os.cpu_count() or 1))}
    srv = OpenAIServer(str(packaged_model_dir()), config, work / "server.log",
                       served_name=served, block_size=BLOCK, max_model_len=max_model_len,
                       extra_args=["--enable-prompt-tokens-details",
                                   "--num-gpu-blocks-override", str(kv_blocks)], env=env)
    return srv, stats


def counter(srv: Any, name: str) -> float:
    """A metric's total on the server's /metrics."""
    from integrations.vllm.bench.harness import metric_sum

    return metric_sum(srv.get("/metrics"), name)


def counter_above(srv: Any, name: str, floor: float, wait_s: float = 30.0) -> float:
    """The metric's total once it exceeds ``floor``, or its last value after
    ``wait_s``: counters of the worker's background threads reach the API server at
    its next ledger poll (about a second), not with the reply."""
    deadline = time.monotonic() + wait_s
    value = counter(srv, name)
    while value <= floor and time.monotonic() < deadline:
        time.sleep(0.2)
        value = counter(srv, name)
    return value
