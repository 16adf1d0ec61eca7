"""Fixtures of the integrations suite: a compact ten-layer agent prompt and a real
OpenAI-compatible HTTP server (``openai_server.py``; this directory is put on
``sys.path`` for it)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

if TYPE_CHECKING:
    from openai_server import FakeOpenAIServer


def agent_prompt(turn: int) -> str:
    """Ten layers, ~300 tokens: state and time change every turn, the rest is fixed."""
    return (
        "[AXIOMS]\nNever invent facts. Say when you are unsure.\n[/AXIOMS]\n"
        "[IDENTITY]\nYou are Atlas, a concise SRE assistant for a small online retailer.\n"
        "[/IDENTITY]\n"
        "[SYSTEM_KNOWLEDGE]\nCheckout runs on Kubernetes; deploys go through Argo CD.\n"
        "Dashboards live in Grafana; alerts page the on-call engineer.\n[/SYSTEM_KNOWLEDGE]\n"
        "[CAPABILITIES]\nmetrics_query(service, window): p95 latency and 5xx rate.\n"
        "rollback(service, revision): propose a rollback for a human to approve.\n"
        "[/CAPABILITIES]\n"
        f"[SYSTEM_STATE]\ncheckout-api p95 {180 + 7 * turn} ms, 5xx {0.1 * turn:.1f}%\n"
        f"pricing-service p95 {38 + turn} ms\n[/SYSTEM_STATE]\n"
        f"[CURRENT_TIME]\n2025-03-11 17:{turn:02d} CET\n[/CURRENT_TIME]\n"
        "[NEURONS]\nLatency incidents usually follow deploys.\n[/NEURONS]\n"
        "[MEMORIES]\nLast week's rollback of pricing-service took 4 minutes.\n[/MEMORIES]\n"
        "[AFFECT]\nCalm, focused.\n[/AFFECT]\n"
        "[AWARENESS]\nThe on-call engineer is new to the team.\n[/AWARENESS]"
    )


@pytest.fixture
def layered_prompt() -> Callable[[int], str]:
    return agent_prompt


@pytest.fixture(scope="session")
def served_model_dir() -> Path:
    """The packaged SmolLM2 as the directory a vLLM server would serve."""
    from integrations.vllm.model import packaged_model_dir

    return packaged_model_dir()


@pytest.fixture
def openai_server(served_model_dir: Path) -> Iterator[FakeOpenAIServer]:
    """A real OpenAI-compatible server on 127.0.0.1 serving the packaged model."""
    from openai_server import SERVED_NAME, FakeOpenAIServer

    with FakeOpenAIServer(served_model_dir, model_name=SERVED_NAME) as server:
        yield server
