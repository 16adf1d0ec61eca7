"""The connector's scheduler side: which tokens a request finds stored, and what each
engine step loads and saves.

:class:`ConnectorScheduler` holds the :class:`~integrations.vllm.planning.RequestPlanner`
(block keys from a request's token ids and tenant, the longest stored prefix, loads for
hits and saves for newly computed full blocks, each labelled with its format by the
precision policy), the shared tier's lookups past the DDR hit, the KV events of the
blocks the tiers store and drop, and the per-request stats.
:class:`~integrations.vllm.connector.ContextKitConnector` builds one in the scheduler
process, as vLLM's own connectors split their roles.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from integrations.vllm.chunk_planning import ChunkPlanner
from integrations.vllm.config import ConnectorConfig
from integrations.vllm.connector_metadata import (
    ContextKitConnectorMetadata,
    ContextKitWorkerMetadata,
)
from integrations.vllm.events import MEDIUM_SHARED, BlockEvents
from integrations.vllm.pauses import KeepSpec, SessionPauses
from integrations.vllm.planning import LoadSpec, RequestPlanner, SaveSpec, StepRequest
from integrations.vllm.shared import SharedLookups, open_shared_tier, record_counters
from integrations.vllm.store import local_session_keys

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from gpu_cache import CacheIdentity
    from shadow.shared.tier import FoundSpan

__all__ = ["ConnectorScheduler"]

logger = logging.getLogger(__name__)

#: A request's vLLM block ids from its KV cache manager, or None where there is none.
BlockIdsOf = Callable[[str], "list[int] | None"]


def _chunk_planner(config: ConnectorConfig, identity: CacheIdentity, block_size: int
                   ) -> ChunkPlanner | None:
    if not config.chunk_reuse:
        return None
    return ChunkPlanner(identity.digest(), block_size, min_tokens=config.chunk_min_tokens,
                        repair_first=config.chunk_repair_first,
                        seam_lead=config.chunk_seam_lead,
                        max_hops=config.chunk_max_hops, repair_ratio=config.chunk_repair_ratio,
                        layers=config.chunk_labels)


class ConnectorScheduler:
    """The scheduler role of :class:`~integrations.vllm.connector.ContextKitConnector`.

    Args:
        config: the connector's configuration.
        identity: the cache identity of the served model.
        block_size: vLLM's block size (the connector's).
        block_ids_of: a request's block ids from vLLM's KV cache manager (None: use
            the ids the scheduler output carries).
    """

    def __init__(self, config: ConnectorConfig, identity: CacheIdentity, block_size: int,
                 block_ids_of: BlockIdsOf) -> None:
        shared = bool(config.shared_url)
        self.config = config
        self.block_size = block_size
        self._block_ids_of = block_ids_of
        self.planner = RequestPlanner(identity.digest(), block_size,
                                      config.default_source_layer, policy=config.policy,
                                      head_dim=identity.head_dim,
                                      chunk_blocks=config.shared_chunk_blocks if shared else 0,
                                      chunks=_chunk_planner(config, identity, block_size))
        self.shared: SharedLookups | None = None
        if shared:
            self.shared = SharedLookups(open_shared_tier(config, identity, "lookups"),
                                        config.shared_chunk_blocks, self.planner.stats)
        seeded = self.planner.seed(local_session_keys(config.local_store, identity))
        self._requests: dict[str, Request] = {}
        self.pauses = SessionPauses()
        self._keeps: list[KeepSpec] = []  # for the next step's metadata
        self._events = BlockEvents(block_size)
        self._stats_path = Path(config.stats_path) if config.stats_path else None
        logger.info("ContextKitConnector scheduler: %d recovered block keys, identity %s",
                    seeded, identity.model_id)

    def matched_tokens(self, request: Request, num_computed_tokens: int
                       ) -> tuple[int | None, bool]:
        """``get_num_new_matched_tokens``: the DDR tier's hit, then the shared tier's
        past it (``None``, "not yet", until the shared tier answers)."""
        first = request.request_id not in self._requests
        self._requests[request.request_id] = request
        hit = self.planner.matched_tokens(
            request.request_id, request.all_token_ids, request.num_prompt_tokens,
            num_computed_tokens, tenant=request.cache_salt,
            params=request.kv_transfer_params)
        if first:  # a session back from its pause: learn it, release what was kept
            tenant, session = self.planner.session(request.request_id)
            if session is not None:
                release = self.pauses.arrived(tenant, session)
                if release is not None:
                    self._keeps.append(release)
        if self.shared is not None:
            local_end = (num_computed_tokens + hit) // self.block_size
            tenant, keys = self.planner.lookup_keys(request.request_id)
            end = self.shared.lookup(request.request_id, tenant, keys, local_end)
            if end is None:
                if not self.shared.looking_up_spans(request.request_id):
                    # meanwhile the spans past the DDR hit: those past the final hit
                    # are among them, so the span lookup does not wait for this one
                    self._shared_spans(request, num_computed_tokens + hit)
                return None, False
            if end > local_end:
                self.planner.note_shared(request.request_id, local_end, end)
                hit = end * self.block_size - num_computed_tokens
        found = None
        if self.shared is not None:
            found = self._shared_spans(request, num_computed_tokens + hit)
            if found is None:
                return None, False
        hit += self.planner.chunk_tokens(request.request_id, request.all_token_ids,
                                         num_computed_tokens + hit, found)
        return hit, False

    def _shared_spans(self, request: Request, prefix_end: int
                      ) -> dict[bytes, FoundSpan] | None:
        """The shared tier's span objects among the request's spans past ``prefix_end``
        that the chunk index lacks (None while the lookup is in flight)."""
        assert self.shared is not None
        misses = self.planner.chunk_misses(request.request_id, request.all_token_ids,
                                           prefix_end)
        tenant, _ = self.planner.session(request.request_id)
        return self.shared.spans(request.request_id, tenant, misses)

    def on_alloc(self, request: Request, num_external_tokens: int) -> None:
        """``update_state_after_alloc``."""
        self.planner.on_alloc(request.request_id, num_external_tokens)
        if self.shared is not None:
            self.shared.forget(request.request_id)

    def _block_ids(self, req_id: str, fallback: list[int] | None) -> list[int]:
        ids = self._block_ids_of(req_id)
        return list(ids if ids is not None else fallback or [])

    def build_meta(self, scheduler_output: SchedulerOutput) -> ContextKitConnectorMetadata:
        """``build_connector_meta``: this step's loads and saves."""
        steps = []
        num_scheduled = scheduler_output.num_scheduled_tokens
        for new in scheduler_output.scheduled_new_reqs:
            request = self._requests.get(new.req_id)
            if request is not None:
                steps.append(StepRequest(new.req_id, request.all_token_ids,
                                         new.num_computed_tokens, num_scheduled[new.req_id],
                                         self._block_ids(new.req_id, new.block_ids[0])))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            request = self._requests.get(req_id)
            if request is not None:
                steps.append(StepRequest(req_id, request.all_token_ids,
                                         cached.num_computed_tokens[i], num_scheduled[req_id],
                                         self._block_ids(req_id, None)))
        loads, saves = self.planner.plan(steps)
        specs: list[LoadSpec | SaveSpec] = [*loads, *saves]
        for spec in specs:
            request = self._requests.get(spec.req_id)
            if request is not None and not (isinstance(spec, SaveSpec) and spec.moved):
                # which vLLM blocks the keys are (KV events); moved K/V are no block's
                self._events.planned(spec.keys, spec.first_block, request.block_hashes,
                                     request.all_token_ids, request.cache_salt)
        keeps, self._keeps = [*self._keeps, *self.pauses.due()], []
        return ContextKitConnectorMetadata(loads, saves, keeps, self.planner.take_shares())

    def on_worker_output(self, connector_output: KVConnectorOutput) -> None:
        """``update_connector_output``: what the worker stored, evicted and loaded."""
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ContextKitWorkerMetadata):
            report = meta.report
            self._write_stats(self.planner.apply(report))
            self._events.stored(report.stored)
            self._events.removed(report.removed)
            self._events.failed(report.failed - report.stored)
            self._events.stored(report.shared, MEDIUM_SHARED)

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self._events.take()

    def request_finished(self, request: Request) -> dict[str, Any] | None:
        """Forget the request; returns what its prompt reused (:meth:`RequestPlanner.report`),
        which vLLM hands back in the response's ``kv_transfer_params``."""
        self._requests.pop(request.request_id, None)
        if self.shared is not None:
            self.shared.forget(request.request_id)
        report = self.planner.report(request.request_id)
        tenant, session = self.planner.session(request.request_id)
        if session is not None:  # keep its blocks through the pause it is expected to take
            keep = self.pauses.finished(tenant, session,
                                        self.planner.held_keys(request.request_id))
            if keep is not None:
                self._keeps.append(keep)
        self._write_stats(self.planner.finish(request.request_id, request.all_token_ids))
        if report is not None:
            self.planner.stats.count(f"reuse_{report['reuse']}_requests")
        return report

    def take_stats(self) -> dict[str, Any] | None:
        """Lookups since the last call (with the shared tier's counters)."""
        if self.shared is not None:
            record_counters(self.shared.tier, self.planner.stats)
        return self.planner.stats.take()

    def _write_stats(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            logger.debug("request stats: %s", record)
        if records and self._stats_path is not None:
            with self._stats_path.open("a") as f:
                for record in records:
                    f.write(json.dumps(record, sort_keys=True) + "\n")
