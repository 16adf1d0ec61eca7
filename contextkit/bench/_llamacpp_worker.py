"""The llama.cpp side of ``contextkit bench decode``: a standalone JSON-lines worker.

Run by path with the Python of the llama.cpp virtualenv (``make bench-decode`` creates
``.venv-llamacpp``); it imports only the standard library, numpy and ``llama_cpp``
(never contextkit or torch, which that virtualenv does not have). One request per
stdin line, one JSON reply per stdout line, in order:

- ``{"op": "load", "model_path", "n_ctx", "n_threads", "n_batch", "flash_attn"}``:
  (re)load the GGUF; replies with the library's version, build and model figures.
- ``{"op": "generate", "ids", "new_tokens"}``: a cold run: empty KV, the prompt
  evaluated (``prefill_s``: start to the first greedy token), then exactly
  ``new_tokens - 1`` more greedy tokens, EOS ignored (``decode_s``).
- ``{"op": "reuse", "ids", "then"}``: llama-cpp-python's own prefix reuse, as
  ``Llama.generate`` does it: keep the KV of the longest common prefix with what was
  evaluated before (at least one token recomputed), evaluate the rest and pick the
  first token (``ttft_s``); then evaluate ``then`` untimed (the reply a server would
  have in its KV for the next turn).
- ``{"op": "quit"}``.

Any failure is a reply ``{"ok": false, "error": "<one line>"}``; the worker keeps
serving. Native code that prints to stdout cannot corrupt the protocol: file
descriptor 1 is pointed at stderr and replies go to a private copy of the original.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

#: llama.cpp's ggml type ids of the KV formats it may report.
_GGML_TYPES = {0: "f32", 1: "f16", 8: "q8_0", 30: "bf16"}


class _Worker:
    def __init__(self) -> None:
        import llama_cpp

        self.lib = llama_cpp
        self.llm: Any = None
        self.n_vocab = 0

    # ------------------------------------------------------------------ requests
    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        op = req.get("op")
        if op == "load":
            return self.load(req)
        if self.llm is None:
            raise RuntimeError(f"op {op!r} before load")
        if op == "generate":
            return self.generate(list(req["ids"]), int(req["new_tokens"]))
        if op == "reuse":
            return self.reuse(list(req["ids"]), list(req.get("then", ())))
        raise ValueError(f"unknown op {op!r}")

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        lib = self.lib
        if self.llm is not None:
            self.llm.close()
            self.llm = None
        threads = int(req["n_threads"])
        llm = lib.Llama(model_path=str(req["model_path"]), n_ctx=int(req["n_ctx"]),
                        n_batch=int(req.get("n_batch", 512)),
                        n_ubatch=int(req.get("n_batch", 512)), n_threads=threads,
                        n_threads_batch=threads, flash_attn=bool(req.get("flash_attn", True)),
                        logits_all=False, verbose=False)
        self.llm = llm
        self.n_vocab = int(llm.n_vocab())
        info = lib.llama_print_system_info()
        info = info.decode() if isinstance(info, bytes) else str(info)
        type_k = int(llm.context_params.type_k)
        return {
            "version": lib.__version__,
            "system_info": info.strip(),
            "openmp": "OPENMP = 1" in info,
            "n_ctx": int(llm.n_ctx()),
            "n_threads": int(llm.context_params.n_threads),
            "n_threads_batch": int(llm.context_params.n_threads_batch),
            "n_batch": int(llm.n_batch),
            "flash_attn": bool(req.get("flash_attn", True)),
            "kv_type": _GGML_TYPES.get(type_k, str(type_k)),
            "model_bytes": int(lib.llama_model_size(llm.model)),
            "model_params": int(lib.llama_model_n_params(llm.model)),
            "n_vocab": self.n_vocab,
        }

    def _argmax(self) -> int:
        import numpy as np

        ptr = self.lib.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def generate(self, ids: list[int], new_tokens: int) -> dict[str, Any]:
        llm = self.llm
        if len(ids) + new_tokens > llm.n_ctx():
            raise ValueError(f"{len(ids)} + {new_tokens} tokens exceed n_ctx {llm.n_ctx()}")
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        token = self._argmax()
        t1 = time.perf_counter()
        out = [token]
        for _ in range(new_tokens - 1):
            llm.eval([token])
            token = self._argmax()
            out.append(token)
        t2 = time.perf_counter()
        return {"prefill_s": t1 - t0, "decode_s": t2 - t1, "token_ids": out}

    def reuse(self, ids: list[int], then: list[int]) -> dict[str, Any]:
        llm = self.llm
        if len(ids) + len(then) > llm.n_ctx():
            raise ValueError(f"{len(ids)} + {len(then)} tokens exceed n_ctx {llm.n_ctx()}")
        t0 = time.perf_counter()
        common = 0
        for a, b in zip(llm.input_ids[: llm.n_tokens].tolist(), ids, strict=False):
            if a != b:
                break
            common += 1
        keep = min(common, len(ids) - 1)  # the last token is run for fresh logits
        llm.n_tokens = keep  # eval drops the KV from here on (kv_cache_seq_rm)
        llm.eval(ids[keep:])
        token = self._argmax()
        ttft = time.perf_counter() - t0
        if then:
            llm.eval(then)
        return {"ttft_s": ttft, "reused_tokens": keep, "computed_tokens": len(ids) - keep,
                "first_token": token}


def main() -> int:
    # Replies go to a private copy of stdout; fd 1 (native prints) goes to stderr.
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        worker = _Worker()
    except ImportError as exc:
        reply.write(json.dumps({"ok": False, "error": f"cannot import llama_cpp: {exc}"}) + "\n")
        return 2
    reply.write(json.dumps({"ok": True, "ready": True}) + "\n")
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                reply.write(json.dumps({"ok": True}) + "\n")
                break
            out = {"ok": True, **worker.handle(req)}
        except Exception as exc:  # one line back; the worker keeps serving
            out = {"ok": False, "error": f"{type(exc).__name__}: {exc}".splitlines()[0]}
        reply.write(json.dumps(out) + "\n")
    if worker.llm is not None:
        worker.llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
