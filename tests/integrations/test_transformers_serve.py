"""Served mode against a real OpenAI-compatible server that is not vLLM: ``transformers
serve`` on the packaged SmolLM2 (issue 34). It refuses contextkit's fields with a 422
("Unexpected fields in the request"); LangChain, LlamaIndex and the ``openai`` client
then send plain requests, the layout still applied, and the usage is recorded."""

from __future__ import annotations

import logging
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi", reason="transformers serve needs transformers[serving]")
pytest.importorskip("uvicorn", reason="transformers serve needs transformers[serving]")

CONVERSATION = [{"role": "user", "content": "Is checkout slow?"},
                {"role": "assistant", "content": "All good."},
                {"role": "user", "content": "What changed since the deploy?"}]


class TransformersServe:
    """``transformers serve <model_dir>`` on a free loopback port, stopped on close."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = model_dir
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cli = Path(sys.executable).with_name("transformers")
        self.proc = subprocess.Popen(
            [str(cli), "serve", str(model_dir), "--host", "127.0.0.1", "--port",
             str(self.port), "--device", "cpu", "--log-level", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def wait(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited: {self.proc.stderr.read()}")  # type: ignore[union-attr]
            try:
                with urllib.request.urlopen(self.base_url + "/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("transformers serve did not come up")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture(scope="module")
def transformers_serve(served_model_dir: Path) -> Iterator[TransformersServe]:
    server = TransformersServe(served_model_dir)
    try:
        server.wait()
        yield server
    finally:
        server.close()


def served_pipeline(model_dir: Path) -> Any:
    from contextkit import CacheAwareContextPipeline
    from contextkit.pipeline.served.model import ServedModel

    return CacheAwareContextPipeline(served=ServedModel(model_dir))  # name: the directory


def test_every_client_falls_back_to_plain_requests(
        transformers_serve: TransformersServe, served_model_dir: Path,
        layered_prompt: Callable[[int], str], caplog: pytest.LogCaptureFixture) -> None:
    import openai
    from langchain.agents import create_agent
    from langchain_openai import ChatOpenAI
    from llama_index.core.base.llms.types import ChatMessage, MessageRole
    from llama_index.llms.openai_like import OpenAILike
    from pydantic import SecretStr

    from integrations.langchain import ContextKitMiddleware
    from integrations.llamaindex import ContextKitOpenAILike
    from integrations.openai import chat_completion, request_kwargs

    name = str(served_model_dir)
    with caplog.at_level(logging.WARNING):
        # the plain openai client
        plain = served_pipeline(served_model_dir)
        client = openai.OpenAI(base_url=transformers_serve.base_url, api_key="x", max_retries=0)
        reply = chat_completion(client, plain, CONVERSATION, tenant="acme",
                                system=layered_prompt(1), max_tokens=4)
        assert reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "length"  # max_tokens reached the server
        report = plain.last_report("acme")
        assert report.served_fields == "plain"
        assert report.prompt_tokens == reply.usage.prompt_tokens > 0
        messages = request_kwargs(plain, CONVERSATION, tenant="acme")["messages"]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "system",
                                                 "user"]
        # LangChain: create_agent + ChatOpenAI + the middleware
        chain = served_pipeline(served_model_dir)
        agent: Any = create_agent(
            ChatOpenAI(model=name, base_url=transformers_serve.base_url,
                       api_key=SecretStr("x"), max_retries=0, max_tokens=4), tools=[],
            middleware=[ContextKitMiddleware(chain, lambda r: layered_prompt(1),
                                             tenant="acme")])
        out = agent.invoke({"messages": [(m["role"], m["content"]) for m in CONVERSATION]})
        assert out["messages"][-1].text
        assert chain.last_report("acme").served_fields == "plain"
        assert chain.last_report("acme").prompt_tokens > 0
        # LlamaIndex: OpenAILike wrapped
        llama = served_pipeline(served_model_dir)
        llm = ContextKitOpenAILike(
            OpenAILike(model=name, api_base=transformers_serve.base_url, api_key="x",
                       is_chat_model=True, max_retries=0, max_tokens=4), llama, tenant="acme")
        answer = llm.chat([ChatMessage(role=MessageRole.SYSTEM, content=layered_prompt(1)),
                           *(ChatMessage(role=m["role"], content=m["content"])
                             for m in CONVERSATION)])
        assert answer.message.content
        assert llama.last_report("acme").served_fields == "plain"
    lines = [r.getMessage() for r in caplog.records if "refused contextkit's" in r.getMessage()]
    assert len(lines) == 3  # one per served model (each negotiates once)
    assert all("Unexpected fields" in line and "\n" not in line for line in lines)
