"""``ContextKitConnector``: contextkit's tiers and shadow behind vLLM's KV connector API.

Launch vLLM with::

    --block-size 32 --kv-transfer-config '{"kv_connector": "ContextKitConnector",
      "kv_connector_module_path": "integrations.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"block_size": 32, "shadow_url": "file:///var/ck"}}'

(:func:`integrations.vllm.kv_transfer_config` builds that object.)

Scheduler side (:class:`~integrations.vllm.planning.RequestPlanner`): block keys from
the request's token ids and tenant (``cache_salt``); ``get_num_new_matched_tokens``
reports the longest stored prefix; ``update_state_after_alloc`` and
``build_connector_meta`` turn hits into loads and newly computed full blocks into
saves, each block labelled with its format by the precision policy
(``config.policy``: attention sink, layers, pins, importance); ``request_finished``
closes the request's stats. Worker side
(:class:`~integrations.vllm.store.ConnectorStore`): ``start_load_kv`` decodes the
stored blocks (any mix of formats) into vLLM's paged KV; ``save_kv_layer`` copies
each layer's new blocks out of the paged KV and ``wait_for_save`` hands them to a
background thread that encodes them into the pool of their format in contextkit's
tiers and shadows them. Semantic labels and pins come with
the request (:func:`~integrations.vllm.planning.semantic_params`).

This module imports vLLM; import it only inside vLLM (it is named by path in
``--kv-transfer-config``).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from gpu_cache.kernels import cpu_fused
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.events import MEDIUM_SHARED, BlockEvents
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.layout import LAYOUTS
from integrations.vllm.logs import adopt_vllm_logging
from integrations.vllm.metrics import ContextKitConnectorStats, ContextKitPromMetrics
from integrations.vllm.planning import (
    LoadSpec,
    RequestPlanner,
    SaveSpec,
    StepRequest,
    WorkerReport,
)
from integrations.vllm.pools import decode_pool_blocks, decode_pool_layer_into
from integrations.vllm.shared import SharedLookups, SharedWriter, record_counters
from integrations.vllm.store import ConnectorStore, local_session_keys

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["ContextKitConnector", "ContextKitConnectorMetadata", "ContextKitWorkerMetadata"]

logger = logging.getLogger(__name__)


@dataclass
class ContextKitConnectorMetadata(KVConnectorMetadata):
    """Scheduler -> worker: this step's loads and saves."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class ContextKitWorkerMetadata(KVConnectorWorkerMetadata):
    """Worker -> scheduler: keys stored and evicted, tokens loaded."""

    report: WorkerReport = field(default_factory=WorkerReport)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, ContextKitWorkerMetadata)
        return ContextKitWorkerMetadata(self.report.merge(other.report))


@dataclass
class _Staged:
    """One save spec's K/V copied out of the paged cache, per layer ``[n, H, N, D]``."""

    spec: SaveSpec
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class ContextKitConnector(KVConnectorBase_V1):
    """KV connector storing vLLM's blocks, each in its policy's format, in contextkit's
    tiers and shadow."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig | None = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role,
                         kv_cache_config=kv_cache_config)  # type: ignore[arg-type, unused-ignore]
        adopt_vllm_logging()
        config = ConnectorConfig.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config)
        block_size = vllm_config.cache_config.block_size
        if block_size != config.block_size:
            raise ConnectorConfigError(
                f"vLLM runs with --block-size {block_size} but the connector is configured "
                f"for block_size={config.block_size}; set both to the same value")
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size > 1 or parallel.pipeline_parallel_size > 1:
            raise ConnectorConfigError(
                "ContextKitConnector supports one worker per engine (tensor and pipeline "
                "parallel size 1); run one engine per GPU (data parallel) instead")
        if self._kv_transfer_config.kv_load_failure_policy != "recompute":
            logger.warning("kv_load_failure_policy is %r: a block lost between lookup and "
                           "load fails the request; set \"kv_load_failure_policy\": "
                           "\"recompute\"", self._kv_transfer_config.kv_load_failure_policy)
        model = vllm_config.model_config
        self.config = config
        self.identity = vllm_cache_identity(
            model.model, block_size, config.codec, model_id=config.model_id,
            tokenizer_dir=model.tokenizer or model.model)
        self.block_size = block_size
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()

    # ================================================================== scheduler side
    def _init_scheduler(self) -> None:
        shared = bool(self.config.shared_url)
        self.planner = RequestPlanner(self.identity.digest(), self.block_size,
                                      self.config.default_source_layer,
                                      policy=self.config.policy,
                                      head_dim=self.identity.head_dim,
                                      chunk_blocks=self.config.shared_chunk_blocks
                                      if shared else 0)
        self._shared: SharedLookups | None = None
        if shared:
            self._shared = SharedLookups(self._shared_tier("lookups"),
                                         self.config.shared_chunk_blocks, self.planner.stats)
        seeded = self.planner.seed(local_session_keys(self.config.local_store, self.identity))
        self._requests: dict[str, Request] = {}
        self._events = BlockEvents(self.block_size)
        self._stats_path = Path(self.config.stats_path) if self.config.stats_path else None
        logger.info("ContextKitConnector scheduler: %d recovered block keys, identity %s",
                    seeded, self.identity.model_id)

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._requests[request.request_id] = request
        hit = self.planner.matched_tokens(
            request.request_id, request.all_token_ids, request.num_prompt_tokens,
            num_computed_tokens, tenant=request.cache_salt,
            params=request.kv_transfer_params)
        if self._shared is not None:
            # past the DDR hit, the shared tier: "not yet" (None) until it answers
            local_end = (num_computed_tokens + hit) // self.block_size
            tenant, keys = self.planner.lookup_keys(request.request_id)
            end = self._shared.lookup(request.request_id, tenant, keys, local_end)
            if end is None:
                return None, False
            if end > local_end:
                self.planner.note_shared(request.request_id, local_end, end)
                hit = end * self.block_size - num_computed_tokens
        return hit, False

    def _shared_tier(self, role: str) -> Any:
        from shadow.shared import SharedTier, default_writer_id

        return SharedTier(self.identity, self.config.shared_tier(),
                          mac_key=self.config.shared_tier_key(),
                          writer=f"{self.config.session_id}-{role}-{default_writer_id()}")

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self.planner.on_alloc(request.request_id, num_external_tokens)
        if self._shared is not None:
            self._shared.forget(request.request_id)

    def _block_ids(self, req_id: str, fallback: list[int] | None) -> list[int]:
        if self._kv_cache_manager is not None:
            return list(self._kv_cache_manager.get_block_ids(req_id)[0])
        return list(fallback or [])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
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
            if request is not None:  # which vLLM blocks the keys are (KV events)
                self._events.planned(spec.keys, spec.first_block, request.block_hashes,
                                     request.all_token_ids, request.cache_salt)
        return ContextKitConnectorMetadata(loads, saves)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        meta = connector_output.kv_connector_worker_meta
        if isinstance(meta, ContextKitWorkerMetadata):
            report = meta.report
            self._write_stats(self.planner.apply(report))
            self._events.stored(report.stored)
            self._events.removed(report.removed)
            self._events.failed(report.failed - report.stored)
            self._events.stored(report.shared, MEDIUM_SHARED)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM-native events of the blocks contextkit's tiers store and drop (see
        :mod:`.events`); vLLM publishes them with its own on ``--kv-events-config``."""
        return self._events.take()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._requests.pop(request.request_id, None)
        if self._shared is not None:
            self._shared.forget(request.request_id)
        self._write_stats(self.planner.finish(request.request_id))
        return False, None  # blocks were copied out when computed: free them now

    def _write_stats(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            logger.debug("request stats: %s", record)
        if records and self._stats_path is not None:
            with self._stats_path.open("a") as f:
                for record in records:
                    f.write(json.dumps(record, sort_keys=True) + "\n")

    # ================================================================== worker side
    def _init_worker(self) -> None:
        self.store = ConnectorStore(self.identity, self.config,
                                    key_offsets=self.config.policy.key_offsets)
        report = self.store.restore_local()
        self.store.open_shadow(restored=bool(report and report.blocks))
        self._report = WorkerReport()
        # keys the scheduler could not seed (recovered inside the engine) reach it here
        self._report.stored |= set(self.store.keys()) - set(
            local_session_keys(self.config.local_store, self.identity))
        self._pages: dict[str, torch.Tensor] = {}  # layer -> page view [num_blocks, ...]
        self._layer_of: dict[str, int] = {}
        self._staged: list[_Staged] = []
        self._load_errors: set[int] = set()
        # Saves quantize beside vLLM's forward, whose OpenMP threads are bound to every
        # core: their kernels run on save_threads threads (numba's count is per thread).
        # They keep vLLM's priority: at nice 19 (tried on the agents bench) they starved,
        # finished seconds late and held the store's lock while loads waited on it.
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextkit-save",
                                         initializer=cpu_fused.limit_threads,
                                         initargs=(self.config.save_threads,))
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextkit-load")
        self._loader.submit(self.store.warm_up)  # JIT off the first request's path
        self._futures: list[Future[None]] = []
        self._writer: SharedWriter | None = None
        if self.config.shared_url:
            self._writer = SharedWriter(
                self._shared_tier("writer"), self.store,
                gc_interval_s=self.config.shared_gc_interval_s,
                log_path=self.config.stats_path, on_shared=self._uploaded)
            if self.config.shared_warm_share:
                # the startup recovery, now from the live tier: what the fleet holds
                budget = self.config.host_blocks * self.identity.bytes_per_block
                self._writer.start_warm(int(budget * self.config.shared_warm_share),
                                        self._imported)
        self._unpinned_tenants: set[str] = set()  # tenants told their prefix is unpinned

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        layout = LAYOUTS["cpu" if current_platform.is_cpu() else "split"]
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != self.identity.num_layers:
            raise ConnectorConfigError(
                f"vLLM has {len(names)} attention layers, the model config "
                f"{self.identity.num_layers}; the connector supports plain decoder models")
        self._layout = layout
        for layer, name in enumerate(names):
            pages = layout.pages(kv_caches[name])
            k, _ = layout.split(pages[:1])
            want = (self.identity.num_kv_heads, self.block_size, self.identity.head_dim)
            if tuple(k.shape[1:]) != want:
                raise ConnectorConfigError(f"layer {name}: paged K is {tuple(k.shape)}, "
                                           f"expected [num_blocks, {', '.join(map(str, want))}]")
            self._pages[name] = pages
            self._layer_of[name] = layer
        self._names = names
        # decode straight into page rows where every layer is a contiguous CPU tensor
        # (vLLM's CPU backend); decode, then copy whole pages otherwise
        layers = [kv_caches[name] for name in names]
        row_path = layout.rows is not None and all(
            t.device.type == "cpu" and t.is_contiguous() for t in layers)
        self._rows = layout.rows if row_path else None
        self._page_rows = ({name: kv_caches[name].view(-1, self.identity.head_dim)
                            for name in names} if row_path else {})
        if not row_path and all(t.device.type == "cpu" for t in layers):
            logger.warning("ContextKitConnector: vLLM's CPU KV cache is not one contiguous "
                           "tensor per layer; loads decode, then copy whole pages (slower)")

    def _meta(self) -> ContextKitConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ContextKitConnectorMetadata)
        return meta

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.loads:
            return
        t0 = time.perf_counter()
        for spec in meta.loads:
            if self._writer is not None and spec.shared:
                # the shared tier's chunks into the DDR tier first (what is refused,
                # missing or late is recomputed)
                self._imported(*self._loader.submit(self._writer.bring_in, spec).result())
            # Decode on a helper thread: the fused CPU decoder (numba) sets the calling
            # thread's OpenMP thread count, which vLLM's CPU attention checks against
            # the step's metadata (and vLLM forbids setting it back).
            n = self._loader.submit(self._load, spec).result()
            missing = spec.block_ids[n:]
            if missing:
                logger.warning("request %s: %d of %d blocks no longer stored; vLLM recomputes "
                               "them", spec.req_id, len(missing), len(spec.block_ids))
            with self._lock:
                self._load_errors.update(missing)
                self._report.loaded_tokens[spec.req_id] = (
                    self._report.loaded_tokens.get(spec.req_id, 0) + n * self.block_size)
                self._report.load_failed_tokens[spec.req_id] = (
                    self._report.load_failed_tokens.get(spec.req_id, 0)
                    + len(missing) * self.block_size)
        self.store.stats.count("load_seconds", time.perf_counter() - t0)

    def _load(self, spec: LoadSpec) -> int:
        """Copy the stored prefix of ``spec`` into its pages (loader thread): each pool
        holding blocks of it decodes layer by layer straight into the page rows where
        the layout allows (:attr:`PagedLayout.rows`), else into K/V first and joins
        them into whole pages. Returns the blocks loaded."""
        parts = self.store.export_parts(spec.keys, spec.tenant)
        heads, bs = self.identity.num_kv_heads, self.block_size
        for pool, positions, data in parts:
            block_ids = torch.tensor([spec.block_ids[i] for i in positions], dtype=torch.int64)
            if self._rows is not None:
                k_rows, v_rows = self._rows(block_ids, heads, bs)
                for layer, name in enumerate(self._names):
                    decode_pool_layer_into(pool, data, layer, self._page_rows[name],
                                           k_rows, v_rows)
                continue
            k, v = decode_pool_blocks(pool, data)
            for layer, name in enumerate(self._names):
                pages = self._pages[name]
                # [n, N, H, D] -> [n, H, N, D] -> whole pages, one copy per layer
                page = self._layout.join(k[layer].permute(0, 2, 1, 3),
                                         v[layer].permute(0, 2, 1, 3))
                pages.index_copy_(0, block_ids.to(pages.device),
                                  page.to(pages.device, pages.dtype))
        return sum(len(positions) for _, positions, _ in parts)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (synchronous)

    def get_block_ids_with_load_errors(self) -> set[int]:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        meta = self._meta()
        if meta is None or not meta.saves or layer_name not in self._pages:
            return
        if not self._staged:
            self._staged = [_Staged(spec) for spec in meta.saves]
        for staged in self._staged:
            self._stage(staged, layer_name)

    def _stage(self, staged: _Staged, name: str) -> None:
        """Copy a save spec's pages of one layer out of the paged cache."""
        pages = self._pages[name]
        idx = torch.tensor(staged.spec.block_ids, dtype=torch.int64, device=pages.device)
        layer = self._layer_of[name]
        staged.k[layer], staged.v[layer] = self._layout.split(pages.index_select(0, idx))

    def wait_for_save(self) -> None:
        meta = self._meta()
        staged, self._staged = self._staged, []
        if meta is None or not meta.saves:
            return
        if not staged:
            staged = [_Staged(spec) for spec in meta.saves]
        for name, layer in self._layer_of.items():  # layers save_kv_layer did not see
            for item in staged:
                if layer not in item.k:
                    self._stage(item, name)
        num_layers = self.identity.num_layers
        for item in staged:
            # [L, n, H, N, D] -> [L, n, N, H, D], contextkit's block layout
            k = torch.stack([item.k[i] for i in range(num_layers)]).permute(0, 1, 3, 2, 4)
            v = torch.stack([item.v[i] for i in range(num_layers)]).permute(0, 1, 3, 2, 4)
            self._futures.append(self._saver.submit(self._save, item.spec, k, v))
        self._futures = [f for f in self._futures if not f.done()]

    def _save(self, spec: SaveSpec, k: torch.Tensor, v: torch.Tensor) -> None:
        """Background: quantize into the store, report, shadow."""
        t0 = time.perf_counter()
        try:
            result = self.store.save(k, v, spec.keys, spec.tenant, spec.labels)
        except Exception:
            logger.exception("saving %d blocks of request %s failed", len(spec.keys),
                             spec.req_id)
            with self._lock:
                self._report.failed.update(spec.keys)
            return
        finally:
            self.store.stats.count("save_seconds", time.perf_counter() - t0)
        if result.unpinned is not None:
            # once per tenant at WARNING: every later request of it would say the same
            first = spec.tenant not in self._unpinned_tenants
            self._unpinned_tenants.add(spec.tenant)
            logger.log(logging.WARNING if first else logging.DEBUG, "request %s: %s",
                       spec.req_id, result.unpinned)
        # stored now, or already held; a skipped volatile tail is not stored (the
        # planner drops it from its pending saves as it does a failed one)
        held = set(spec.keys) - set(result.failed) - set(result.skipped)
        with self._lock:
            self._now_held(held, result.removed)
            self._report.failed.update(result.failed)
            self._report.failed.update(result.skipped)
        if self._writer is not None:
            self._writer.saved(spec, held)
        if self.config.shadow_on_save and self.store.shadowing and result.stored:
            try:
                self.store.shadow_now()
            except Exception:
                logger.exception("shadow after save failed; the previous shadow stays")

    def _now_held(self, held: Iterable[bytes], removed: Iterable[bytes]) -> None:
        """The store holds ``held`` now and dropped ``removed`` (caller holds _lock)."""
        held, removed = set(held), set(removed)
        report = self._report
        report.removed.difference_update(held)
        report.stored.difference_update(removed)
        report.stored.update(held)
        report.removed.update(removed)

    def _imported(self, held: list[bytes], removed: list[bytes]) -> None:
        """Blocks brought in from the shared tier, and blocks evicted for them."""
        with self._lock:
            self._now_held(held, removed)

    def _uploaded(self, keys: list[bytes]) -> None:
        with self._lock:
            self._report.shared.update(keys)

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return ContextKitWorkerMetadata(report) if report else None

    # ================================================================== metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This role's stats since the last call (vLLM asks after every step).

        Scheduler side: lookups (:class:`RequestPlanner`); worker side: loads, saves,
        evictions and the shadow (:class:`ConnectorStore`).
        """
        if self.role == KVConnectorRole.SCHEDULER:
            shared = getattr(self, "_shared", None)
            if shared is not None:
                record_counters(shared.tier, self.planner.stats)
            data = self.planner.stats.take() if hasattr(self, "planner") else None
        else:
            writer = getattr(self, "_writer", None)
            if writer is not None:
                lag = writer.take_lag()
                if lag is not None:
                    self.store.stats.set_gauge("shared_lag_seconds", lag)
            data = self.store.take_stats() if hasattr(self, "store") else None
        return None if data is None else ContextKitConnectorStats(data=data)

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None
                                 ) -> KVConnectorStats | None:
        return ContextKitConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: VllmConfig,
                           metric_types: dict[type[PromMetric], type[PromMetricT]],
                           labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> ContextKitPromMetrics:
        return ContextKitPromMetrics(vllm_config, metric_types, labelnames,
                                     per_engine_labelvalues)

    def flush(self) -> None:
        """Wait for queued saves (tests and shutdown)."""
        for future in list(self._futures):
            future.result()
        self._futures.clear()

    def shutdown(self) -> None:
        if self.role != KVConnectorRole.WORKER or not hasattr(self, "store"):
            return
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self._writer is not None:
            self._writer.flush()
            self._writer.close()
        self.store.close()
