"""What passes between the connector's two roles each engine step.

The scheduler sends the worker this step's loads and saves, the blocks to keep
through (or release after) a session's pause and the spans to publish to the shared
tier (:class:`ContextKitConnectorMetadata`);
the worker answers with the keys it stored and evicted and the tokens it loaded
(:class:`ContextKitWorkerMetadata`). vLLM carries both, across processes where the
roles run apart.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from integrations.vllm.chunk_planning import SpanShare
from integrations.vllm.pauses import KeepSpec
from integrations.vllm.planning import LoadSpec, SaveSpec, WorkerReport

__all__ = ["ContextKitConnectorMetadata", "ContextKitWorkerMetadata"]


@dataclass
class ContextKitConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves, and pause keeps."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    keeps: list[KeepSpec] = field(default_factory=list)
    #: registered spans to publish to the shared tier (with one)
    shares: list[SpanShare] = field(default_factory=list)


@dataclass
class ContextKitWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: keys stored and evicted, tokens loaded."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ContextKitWorkerMetadata)
        return ContextKitWorkerMetadata(self.report.merge(other.report))
