# contextkit: `make demo` and `make test` work on a fresh machine (they run setup first).
.DEFAULT_GOAL := help
PY := .venv/bin/python
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: help setup demo test test-fast bench lint typecheck clean

help:
	@echo "make demo       set up, then run the demo (bench quant + tiers on SmolLM2, plot)"
	@echo "make test       set up, then run the test suite (what CI runs)"
	@echo "make bench      run every CPU benchmark with --json into bench/results/"
	@echo "make lint       ruff; make typecheck: mypy"

setup:
	@bash scripts/bootstrap.sh

demo: setup
	$(PY) -m contextkit.cli demo

test: setup
	$(PY) -m pytest -m "not vllm and not gpu" -q

test-fast: setup
	$(PY) -m pytest -m "not vllm and not gpu and not slow" -q

bench: setup
	@mkdir -p bench/results
	@for name in quant tiers kernel; do \
		echo "== contextkit bench $$name"; \
		$(PY) -m contextkit.cli bench $$name --json | tee bench/results/$$name-cpu.log | tail -n 1 > bench/results/$$name-cpu.json || exit 1; \
	done

lint: setup
	.venv/bin/ruff check contextkit gpu_cache memory_graph shadow integrations tests

typecheck: setup
	.venv/bin/mypy

clean:
	rm -rf .venv .pytest_cache .mypy_cache .ruff_cache runs
