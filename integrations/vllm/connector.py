"""``ContextKitConnector``: contextkit's tiers and shadow behind vLLM's KV connector API.

Launch vLLM with::

    --block-size 32 --kv-transfer-config '{"kv_connector": "ContextKitConnector",
      "kv_connector_module_path": "integrations.vllm.connector", "kv_role": "kv_both",
      "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"block_size": 32, "shadow_url": "file:///var/ck"}}'

(:func:`integrations.vllm.kv_transfer_config` builds that object.)

The connector is split by role, as vLLM's own connectors are: in the scheduler process
it builds a :class:`~integrations.vllm.scheduler.ConnectorScheduler` (which tokens a
request finds stored; each step's loads and saves, labelled with their formats by the
precision policy), in each worker a :class:`~integrations.vllm.worker.ConnectorWorker`
(stored blocks into vLLM's paged KV, new blocks out of it into contextkit's tiers and
shadow). This class checks the configuration both share and hands each of vLLM's calls
to its role. Semantic labels and pins come with the request
(:func:`~integrations.vllm.planning.semantic_params`).

This module imports vLLM; import it only inside vLLM (it is named by path in
``--kv-transfer-config``).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from contextkit.pipeline.served.wire import REPORT_KEY
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.connector_metadata import (
    ContextKitConnectorMetadata,
)
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.ledger import ledger_path
from integrations.vllm.logs import adopt_vllm_logging
from integrations.vllm.metrics import ContextKitConnectorStats, ContextKitPromMetrics
from integrations.vllm.scheduler import ConnectorScheduler
from integrations.vllm.store import ConnectorStore
from integrations.vllm.worker import ConnectorWorker

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

__all__ = ["ContextKitConnector"]

logger = logging.getLogger(__name__)


class ContextKitConnector(KVConnectorBase_V1):
    """KV connector storing vLLM's blocks, each in its policy's format, in contextkit's
    tiers and shadow; ``scheduler`` or ``worker`` does the work of its role."""

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
        self.scheduler: ConnectorScheduler | None = None
        self.worker: ConnectorWorker | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler = ConnectorScheduler(config, self.identity, block_size,
                                                self._manager_block_ids)
        else:
            self.worker = ConnectorWorker(
                config, self.identity, block_size, tokenizer_dir=model.tokenizer or model.model,
                ledger_path=ledger_path(vllm_config.instance_id, parallel.data_parallel_rank))

    def _manager_block_ids(self, req_id: str) -> list[int] | None:
        if self._kv_cache_manager is None:
            return None
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    def _scheduler(self) -> ConnectorScheduler:
        assert self.scheduler is not None, "a scheduler-side call on the worker"
        return self.scheduler

    def _worker(self) -> ConnectorWorker:
        assert self.worker is not None, "a worker-side call on the scheduler"
        return self.worker

    @property
    def store(self) -> ConnectorStore:
        """The worker's store (the bench harness drains it over ``collective_rpc``)."""
        return self._worker().store

    def _meta(self) -> ContextKitConnectorMetadata | None:
        if not self.has_connector_metadata():
            return None
        meta = self._get_connector_metadata()
        assert isinstance(meta, ContextKitConnectorMetadata)
        return meta

    # ================================================================== scheduler side
    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self._scheduler().matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        self._scheduler().on_alloc(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self._scheduler().build_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self._scheduler().on_worker_output(connector_output)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """vLLM-native events of the blocks contextkit's tiers store and drop (see
        :mod:`.events`); vLLM publishes them with its own on ``--kv-events-config``."""
        return self._scheduler().take_events()

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        report = self._scheduler().request_finished(request)
        # blocks were copied out when computed: free them now; the response's
        # kv_transfer_params carry what the prompt reused
        return False, ({REPORT_KEY: report} if report is not None else None)

    # ================================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._worker().register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        self._worker().start_load(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads complete in start_load_kv (synchronous)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker().take_load_errors()

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any,
                      **kwargs: Any) -> None:
        self._worker().save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        self._worker().wait_for_save(self._meta())

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self._worker().build_worker_meta()

    # ================================================================== metrics
    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """This role's stats since the last call (vLLM asks after every step):
        lookups on the scheduler, loads, saves, evictions and the shadow on a worker."""
        role = self.scheduler or self.worker
        data = role.take_stats() if role is not None else None
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
        if self.worker is not None:
            self.worker.flush()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
