"""One connector replica without vLLM, for the shared-tier tests: its scheduler-side
planner, its DDR store, its shared-tier writer (worker side) and lookups (scheduler
side)."""

from __future__ import annotations

from dataclasses import dataclass

from integrations.vllm.planning import RequestPlanner
from integrations.vllm.shared import SharedLookups, SharedWriter
from integrations.vllm.store import ConnectorStore


@dataclass
class Replica:
    planner: RequestPlanner
    store: ConnectorStore
    writer: SharedWriter
    lookups: SharedLookups

    def close(self) -> None:
        self.writer.close()
        self.lookups.close()
