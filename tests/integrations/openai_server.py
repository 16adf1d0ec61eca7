"""A small OpenAI-compatible chat server for the integration tests (no vLLM needed).

A real HTTP server on 127.0.0.1 implementing the parts of vLLM's OpenAI API that the
frameworks call: ``POST /v1/chat/completions`` (plain and ``stream: true`` SSE, with the
final usage chunk when ``stream_options.include_usage``), ``GET /v1/models`` and vLLM's
``POST /tokenize``. It records every request body and answers with a fixed text (or a
queued tool call) and the usage vLLM would report.

The prompt ids are what vLLM renders for ``/v1/chat/completions`` with an HF tokenizer
(the recipe of the research notes, verified against a live vLLM 0.32 server): the
messages' text parts joined with ``"\\n"``, the served model's chat template with
``add_generation_prompt=True``, then the tokenizer without special tokens. It is kept
here on its own, apart from :class:`contextkit.pipeline.served.model.ServedModel`, so the
tests compare contextkit's ranges with an independent oracle. ``cached_tokens`` is what
vLLM's prefix cache would hit: the longest prefix shared with an earlier prompt of the
same ``cache_salt``, whole blocks only, at least one token left to compute.

vLLM's request checks the frameworks can trip are enforced too: an unknown model is a
404, a bad ``cache_salt`` (empty, over 128 characters, ``@ / \\`` or NUL) or a
``kv_transfer_params`` that is not an object is a 400, in OpenAI's error format.

The request's own settings are honoured, so a setting a client does not pass on shows:
``n`` (that many choices), ``stop`` (the reply cut before the first stop string),
``max_tokens`` / ``max_completion_tokens`` (the reply cut to that many tokens,
``finish_reason: "length"``) and the context length (a prompt plus its token limit over
``max_model_len`` is vLLM's 400). ``strict=True`` is a server that is not vLLM
(``transformers serve``, most others): any field outside OpenAI's API, contextkit's
``kv_transfer_params`` and ``cache_salt`` included, is a 422 "Unexpected fields in the
request".
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["SERVED_NAME", "FakeOpenAIServer", "vllm_prompt_ids"]

#: The model name the tests' server serves (vLLM's ``--served-model-name``).
SERVED_NAME = "smollm2"

TEXT_PARTS = {"text", "input_text", "output_text", "refusal", "thinking"}

#: The body fields of OpenAI's ``/v1/chat/completions`` (what a strict server accepts).
OPENAI_FIELDS = frozenset({
    "messages", "model", "audio", "frequency_penalty", "function_call", "functions",
    "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata",
    "modalities", "n", "parallel_tool_calls", "prediction", "presence_penalty",
    "prompt_cache_key", "reasoning_effort", "response_format", "safety_identifier", "seed",
    "service_tier", "stop", "store", "stream", "stream_options", "temperature",
    "tool_choice", "tools", "top_logprobs", "top_p", "user", "verbosity",
    "web_search_options"})


def _flatten(content: Any) -> str:
    """vLLM's "string" content format: text parts joined with a newline."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "\n".join(p if isinstance(p, str) else p["text"] for p in content
                     if isinstance(p, str)
                     or (p.get("type") in TEXT_PARTS and p.get("text") is not None))


def _conversation(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    conv = []
    for m in messages:
        d: dict[str, Any] = {"role": m["role"], "content": _flatten(m.get("content"))}
        if m["role"] == "assistant" and m.get("tool_calls"):
            d["tool_calls"] = [{**tc, "function": {
                **tc["function"], "arguments": json.loads(tc["function"].get("arguments")
                                                          or "{}")}}
                for tc in m["tool_calls"]]
        if m["role"] == "tool" and "tool_call_id" in m:
            d["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            d["name"] = m["name"]
        conv.append(d)
    return conv


def vllm_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    chat_template: str | None = None
                    ) -> tuple[str, list[int], list[tuple[int, int]]]:
    """``(text, ids, offsets)``: the prompt vLLM builds for these chat messages
    (``chat_template``: the server's ``--chat-template``, default the tokenizer's)."""
    text = tokenizer.apply_chat_template(_conversation(messages), tools=list(tools or []) or None,
                                         chat_template=chat_template, tokenize=False,
                                         add_generation_prompt=True,
                                         continue_final_message=False)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return text, list(enc["input_ids"]), [tuple(o) for o in enc["offset_mapping"]]


def _salt_error(salt: Any) -> str | None:
    if not isinstance(salt, str) or not 0 < len(salt) <= 128:
        return "cache_salt must be a non-empty string of at most 128 characters"
    if any(c in salt for c in "@/\\\0"):
        return "cache_salt must not contain '@', '/', '\\' or NUL"
    return None


class _Error(Exception):
    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


class FakeOpenAIServer:
    """An OpenAI-compatible chat server over one served model's tokenizer.

    Args:
        model_dir: the model directory (tokenizer files and chat template).
        model_name: the served model name (requests for another model get a 404).
        reply: the assistant's text for every call.
        completion_tokens: the reported completion tokens.
        block_size: the prefix cache's block size (``cached_tokens`` granularity).
        chat_template: the server's ``--chat-template`` (default: the tokenizer's).
        max_model_len: the context length (prompt plus token limit) the server accepts.
        strict: refuse every field outside OpenAI's API with a 422, as a server that is
            not vLLM does (``transformers serve``).

    Attributes:
        requests: every request body received, in order (``{"path": ..., **body}``).
        label_mismatches: why the contextkit labels of a chat request did not belong to
            the prompt the server rendered, per such request: the check contextkit's
            vLLM connector makes (:func:`integrations.vllm.planning.label_mismatch`).
    """

    def __init__(self, model_dir: str | Path, *, model_name: str, reply: str = "All good.",
                 completion_tokens: int = 4, block_size: int = 16,
                 chat_template: str | None = None, max_model_len: int = 8192,
                 strict: bool = False) -> None:
        from transformers import AutoTokenizer

        self.model_dir = str(model_dir)
        self.model_name = model_name
        self.reply = reply
        self.completion_tokens = completion_tokens
        self.block_size = block_size
        self.chat_template = chat_template
        self.max_model_len = max_model_len
        self.strict = strict
        self.label_mismatches: list[str] = []
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.requests: list[dict[str, Any]] = []
        self._usages: list[dict[str, Any] | None] = []  # per chat request (None: refused)
        self._tool_calls: list[dict[str, Any]] = []
        self._prompts: dict[str | None, list[list[int]]] = {}
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True,
                                        name="fake-openai-server")

    # ------------------------------------------------------------------ lifecycle
    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host!s}:{port}"

    @property
    def base_url(self) -> str:
        """What ``ChatOpenAI(base_url=...)`` / ``OpenAI(base_url=...)`` take."""
        return self.url + "/v1"

    def start(self) -> FakeOpenAIServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=10)

    def __enter__(self) -> FakeOpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ scripting
    def queue_tool_call(self, name: str, arguments: Mapping[str, Any]) -> None:
        """The next chat completion answers with this tool call instead of text."""
        with self._lock:
            self._tool_calls.append({"id": f"call_{uuid.uuid4().hex[:8]}", "type": "function",
                                     "function": {"name": name,
                                                  "arguments": json.dumps(dict(arguments))}})

    def chat_requests(self) -> list[dict[str, Any]]:
        """The bodies of the ``/v1/chat/completions`` calls, in order."""
        with self._lock:
            return [r for r in self.requests if r["path"] == "/v1/chat/completions"]

    def usage_for(self, i: int) -> dict[str, Any] | None:
        """The usage reported for the ``i``-th chat request (None: it was refused)."""
        with self._lock:
            return self._usages[i]

    def cached_for(self, i: int) -> int:
        """The ``cached_tokens`` reported for the ``i``-th chat request."""
        usage = self.usage_for(i)
        assert usage is not None, f"chat request {i} was refused"
        return int(usage["prompt_tokens_details"]["cached_tokens"])

    def render(self, messages: Sequence[Mapping[str, Any]],
               tools: Sequence[Mapping[str, Any]] | None = None
               ) -> tuple[str, list[int], list[tuple[int, int]]]:
        """The prompt text, ids and char offsets vLLM would build for these messages."""
        with self._lock:
            return vllm_prompt_ids(self.tokenizer, messages, tools, self.chat_template)

    # ------------------------------------------------------------------ API
    def _cached_tokens(self, salt: str | None, ids: list[int]) -> int:
        best = 0
        for old in self._prompts.get(salt, []):
            n = 0
            for a, b in zip(old, ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        best = min(best, len(ids) - 1)
        return max(0, best // self.block_size * self.block_size)

    def _chat(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
        try:
            out, ids = self._answer(body)
        except _Error:
            with self._lock:
                self._usages.append(None)
            raise
        with self._lock:
            self._usages.append(out["usage"])
        return out, ids

    def _reply(self, body: Mapping[str, Any]) -> tuple[str, int, str]:
        """``(text, completion tokens, finish reason)`` of the fixed reply under the
        request's ``stop`` and token limit."""
        text, finish = self.reply, "stop"
        stop = body.get("stop")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        cuts = [text.find(s) for s in stops if s and s in text]
        if cuts:
            text = text[:min(cuts)]
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if limit is not None and len(ids) > int(limit):
            ids = ids[:int(limit)]
            text, finish = self.tokenizer.decode(ids), "length"
        tokens = len(ids) if (cuts or finish == "length") else self.completion_tokens
        return text, tokens, finish

    def _answer(self, body: Mapping[str, Any]) -> tuple[dict[str, Any], list[int]]:
        if self.strict and (unknown := set(body) - OPENAI_FIELDS):
            raise _Error(422, f"Unexpected fields in the request: {unknown}")
        if body.get("model") != self.model_name:
            raise _Error(404, f"The model `{body.get('model')}` does not exist.", "model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _Error(400, "messages must be a non-empty list", "messages")
        if "cache_salt" in body and (err := _salt_error(body["cache_salt"])):
            raise _Error(400, err, "cache_salt")
        if body.get("kv_transfer_params") is not None and not isinstance(
                body["kv_transfer_params"], dict):
            raise _Error(400, "kv_transfer_params: Input should be a valid dictionary",
                         "kv_transfer_params")
        _, ids, _ = self.render(messages, body.get("tools"))
        limit = body.get("max_completion_tokens") or body.get("max_tokens") or 0
        if len(ids) + int(limit) > self.max_model_len:
            raise _Error(400, f"This model's maximum context length is {self.max_model_len} "
                         f"tokens. However, you requested {len(ids) + int(limit)} tokens "
                         f"({len(ids)} in the messages, {limit} in the completion). Please "
                         "reduce the length of the messages or completion.", "messages")
        n = int(body.get("n") or 1)
        if n < 1:
            raise _Error(400, "n must be at least 1", "n")
        salt = body.get("cache_salt")
        from integrations.vllm.planning import label_mismatch

        reason = label_mismatch(body.get("kv_transfer_params"), ids)
        with self._lock:
            if reason is not None:
                self.label_mismatches.append(reason)
            cached = self._cached_tokens(salt, ids)
            self._prompts.setdefault(salt, []).append(ids)
            tool_call = self._tool_calls.pop(0) if self._tool_calls else None
        text, tokens, finish = self._reply(body)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_call is not None:
            message, finish = {"role": "assistant", "content": None,
                               "tool_calls": [tool_call]}, "tool_calls"
        usage = {"prompt_tokens": len(ids), "completion_tokens": tokens * n,
                 "total_tokens": len(ids) + tokens * n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        return {"message": message, "usage": usage, "finish_reason": finish, "n": n}, ids

    def _completion(self, body: Mapping[str, Any]) -> dict[str, Any]:
        out, ids = self._chat(body)
        doc: dict[str, Any] = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion",
            "created": int(time.time()), "model": self.model_name,
            "choices": [{"index": i, "message": out["message"], "logprobs": None,
                         "finish_reason": out["finish_reason"]} for i in range(out["n"])],
            "usage": out["usage"], "kv_transfer_params": None}
        if body.get("return_token_ids"):
            doc["prompt_token_ids"] = ids
        return doc

    def _stream(self, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        out, _ = self._chat(body)
        base = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion.chunk",
                "created": int(time.time()), "model": self.model_name}
        message = out["message"]
        for k in range(out["n"]):
            yield {**base, "choices": [{"index": k, "delta": {"role": "assistant",
                                                              "content": ""},
                                        "logprobs": None, "finish_reason": None}]}
            if message.get("tool_calls"):
                calls = [{"index": i, **tc} for i, tc in enumerate(message["tool_calls"])]
                yield {**base, "choices": [{"index": k, "delta": {"tool_calls": calls},
                                            "logprobs": None, "finish_reason": None}]}
            else:
                words = message["content"].split(" ")
                for i, word in enumerate(words):
                    if word or i == 0:
                        yield {**base, "choices": [{"index": k, "delta": {
                            "content": word if i == 0 else " " + word},
                            "logprobs": None, "finish_reason": None}]}
            yield {**base, "choices": [{"index": k, "delta": {}, "logprobs": None,
                                        "finish_reason": out["finish_reason"]}]}
        if (body.get("stream_options") or {}).get("include_usage"):
            yield {**base, "choices": [], "usage": out["usage"]}

    def _tokenize(self, body: Mapping[str, Any]) -> dict[str, Any]:
        if "messages" in body:
            _, ids, _ = self.render(body["messages"], body.get("tools"))
        else:
            ids = list(self.tokenizer(str(body.get("prompt", "")),
                                      add_special_tokens=False)["input_ids"])
        return {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids,
                "token_strs": None}

    def _models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": 0,
            "owned_by": "transformers" if self.strict else "vllm",
            "root": self.model_dir, "parent": None, "max_model_len": self.max_model_len}]}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, doc: Mapping[str, Any]) -> None:
                data = json.dumps(doc).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _error(self, err: _Error) -> None:
                kind = {404: "NotFoundError", 422: "UnprocessableEntityError"}.get(
                    err.status, "BadRequestError")
                self._send(err.status, {"error": {"message": err.message, "type": kind,
                                                  "param": err.param, "code": err.status}})

            def do_GET(self) -> None:
                if self.path.rstrip("/") == "/v1/models":
                    self._send(200, server._models())
                else:
                    self._error(_Error(404, f"no route {self.path}"))

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                try:
                    body = json.loads(self.rfile.read(length) or b"{}")
                except json.JSONDecodeError as exc:
                    self._error(_Error(400, f"invalid JSON body: {exc}"))
                    return
                path = self.path.split("?")[0].rstrip("/")
                with server._lock:
                    server.requests.append({"path": path, **body})
                try:
                    if path == "/v1/chat/completions" and body.get("stream"):
                        chunks = list(server._stream(body))  # errors before any byte
                        self.send_response(200)
                        self.send_header("Content-Type", "text/event-stream")
                        self.send_header("Cache-Control", "no-cache")
                        self.send_header("Connection", "close")
                        self.end_headers()
                        for chunk in chunks:
                            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                        self.wfile.write(b"data: [DONE]\n\n")
                        self.wfile.flush()
                        self.close_connection = True
                    elif path == "/v1/chat/completions":
                        self._send(200, server._completion(body))
                    elif path == "/tokenize":
                        self._send(200, server._tokenize(body))
                    else:
                        raise _Error(404, f"no route {path}")
                except _Error as err:
                    self._error(err)

        return Handler
