"""The vLLM benchmarks' drivers: processes that ``contextkit bench vllm`` and ``contextkit
bench agent-vllm`` start by module name (``python -m integrations.vllm.bench.harness``,
``... .agent_bench``), so that contextkit itself never imports integrations.

``harness`` runs one vLLM engine (cold, recovery, recovered) per precision policy;
``agent_bench`` drives a LangChain agent against vLLM's OpenAI server. They may import
everything below them: the connector's modules, :mod:`integrations.langchain`, contextkit.
"""
