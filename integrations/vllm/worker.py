"""The connector's worker side: stored blocks into vLLM's paged KV before the forward,
newly computed blocks out of it after.

:class:`ConnectorWorker` holds the :class:`~integrations.vllm.store.ConnectorStore`
(contextkit's tiers, one pool per format, and the shadow) and the shared tier's writer.
``start_load`` decodes the stored blocks of a step's loads (any mix of formats) into
the pages; ``save_layer`` copies each layer's new blocks out of the pages and
``wait_for_save`` hands them to a background thread that encodes them into the pool of
their format and shadows them. :class:`~integrations.vllm.connector.ContextKitConnector`
builds one in each worker process, as vLLM's own connectors split their roles.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.model_executor.models.utils import extract_layer_index
from vllm.platforms import current_platform

from gpu_cache.kernels import cpu_fused
from integrations.vllm.chunk_forward import (
    PagedKV,
    ServedLlama,
    attention_dtype,
    fused_amx_copy,
    low_isa,
    matmul_dtype,
    served_llama,
)
from integrations.vllm.chunk_gate import run_gate
from integrations.vllm.chunk_placement import ChunkPlacement
from integrations.vllm.chunk_planning import ChunkLoad
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.connector_metadata import (
    ContextKitConnectorMetadata,
    ContextKitWorkerMetadata,
)
from integrations.vllm.layout import LAYOUTS, probe_cpu_key_order
from integrations.vllm.pauses import KeepSpec
from integrations.vllm.planning import LoadSpec, SaveSpec, WorkerReport
from integrations.vllm.pools import decode_pool_blocks, decode_pool_layer_into
from integrations.vllm.served_model import release_weights, served_model
from integrations.vllm.shared import SharedWriter, open_shared_tier
from integrations.vllm.store import ConnectorStore, local_session_keys

if TYPE_CHECKING:
    from gpu_cache import CacheIdentity

__all__ = ["ConnectorWorker"]

logger = logging.getLogger(__name__)


@dataclass
class Staged:
    """One save spec's K/V copied out of the paged cache, per layer ``[n, H, N, D]``."""

    spec: SaveSpec
    k: dict[int, torch.Tensor] = field(default_factory=dict)
    v: dict[int, torch.Tensor] = field(default_factory=dict)


class ConnectorWorker:
    """The worker role of :class:`~integrations.vllm.connector.ContextKitConnector`.

    Args:
        config: the connector's configuration.
        identity: the cache identity of the served model.
        block_size: vLLM's block size (the connector's).
        tokenizer_dir: the served tokenizer (chunk reuse's model check tokenizes with it).
    """

    def __init__(self, config: ConnectorConfig, identity: CacheIdentity,
                 block_size: int, tokenizer_dir: str | None = None,
                 ledger_path: Path | None = None) -> None:
        self.config = config
        self.identity = identity
        self.block_size = block_size
        self._lock = threading.Lock()
        self.store = ConnectorStore(identity, config, key_offsets=config.policy.key_offsets)
        report = self.store.restore_local()
        self.store.open_shadow(restored=bool(report and report.blocks))
        self._report = WorkerReport()
        # keys the scheduler could not seed (recovered inside the engine) reach it here
        self._report.stored |= set(self.store.keys()) - set(
            local_session_keys(config.local_store, identity))
        self._pages: dict[str, torch.Tensor] = {}  # layer -> page view [num_blocks, ...]
        self._layer_of: dict[str, int] = {}
        self._staged: list[Staged] = []
        self._load_errors: set[int] = set()
        # Saves quantize beside vLLM's forward, whose OpenMP threads are bound to every
        # core: their kernels run on save_threads threads (numba's count is per thread).
        # They keep vLLM's priority: at a lower one they starve, finish late and hold
        # the store's lock while loads wait on it.
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextkit-save",
                                         initializer=cpu_fused.limit_threads,
                                         initargs=(config.save_threads,))
        self._loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="contextkit-load")
        self._loader.submit(self.store.warm_up)  # JIT off the first request's path
        self._futures: list[Future[None]] = []
        self.writer: SharedWriter | None = None
        if config.shared_url:
            self.writer = SharedWriter(
                open_shared_tier(config, identity, "writer"), self.store,
                gc_interval_s=config.shared_gc_interval_s,
                log_path=config.stats_path, on_shared=self._uploaded,
                ledger_path=ledger_path)
            if config.shared_warm_share:
                # the startup recovery, now from the live tier: what the fleet holds
                budget = config.host_blocks * identity.bytes_per_block
                self.writer.start_warm(int(budget * config.shared_warm_share),
                                       self._imported)
        self._unpinned_tenants: set[str] = set()  # tenants told their prefix is unpinned
        self._tokenizer_dir = tokenizer_dir
        self._served: ServedLlama | None = None  # chunk reuse's model, once checked
        self._key_order = "token"  # how a page's key half orders its values
        self._isa: str | None = None  # vLLM's CPU attention kernel, which chunk reuse uses
        #: the latest chunk loads materialized (diagnostics: which blocks, what moved)
        self.recent_chunks: deque[ChunkLoad] = deque(maxlen=16)

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
        if self.config.chunk_reuse:
            self._check_chunk_model()
        release_weights()  # what chunk reuse needed is copied

    def _check_chunk_model(self) -> None:
        """Chunk reuse's model check (:mod:`.chunk_gate`); the scheduler hears the
        outcome with the next report ("" on, else why off)."""
        model = served_model()
        device = next(model.parameters()).device if model is not None else "cpu"
        low = matmul_dtype(self.config.chunk_matmul_dtype, device)
        served, why = served_llama(model, matmul_dtype=low,
                                   attention_dtype=attention_dtype(low, device))
        if served is not None and current_platform.is_cpu():
            isa = getattr(served.layers[0].self_attn.attn, "isa", None)
            order = probe_cpu_key_order(isa, self.block_size, self.identity.head_dim) \
                if isa else None
            if order is None:
                why = f"vLLM's CPU attention ({isa}) lays keys out in pages in an unknown order"
            else:
                self._key_order, self._isa = order, isa
                if served.attention_dtype is not None:  # checked and compiled before serving
                    low_isa(served.attention_dtype, isa, self.block_size)
                    fused_amx_copy(order, self.block_size, self.identity.head_dim)
        if served is not None and why is None:
            try:
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(self._tokenizer_dir)
                result = run_gate(served, lambda text: tok.encode(text, add_special_tokens=False),
                                  repair_first=self.config.chunk_repair_first,
                                  min_agreement=self.config.chunk_gate_min_agreement,
                                  max_kl=self.config.chunk_gate_max_kl)
                why = result.reason()
                logger.info("chunk reuse model check: top-1 agreement %.3f, mean KL %.4f "
                            "over %d tokens (projections in %s, attention in %s)",
                            result.agreement, result.mean_kl, result.tokens,
                            served.matmul_dtype or "the model's dtype",
                            served.attention_dtype or "the model's dtype")
            except Exception as exc:  # the check must not stop the server
                logger.exception("chunk reuse model check failed to run")
                why = f"the model check could not run ({type(exc).__name__}: {exc})"
        self._served = served if why is None else None
        if why is None:
            logger.info("chunk reuse: on")
        else:
            logger.warning("chunk reuse: off, prefix reuse only (%s)", why)
        with self._lock:
            self._report.chunk_status = why or ""

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: ContextKitConnectorMetadata | None) -> None:
        """``start_load_kv``: every load of the step, complete on return; then the
        step's pause keeps, releases and look-ahead warms and its span publications,
        on the save thread after the saves already queued (a session's blocks are
        stored before they are kept or published)."""
        if meta is None:
            return
        try:
            self._load_all(meta)
        finally:
            for keep in meta.keeps:
                self._futures.append(self._saver.submit(self._keep, keep))
            if self.writer is not None:  # after the saves queued: its blocks are stored
                for share in meta.shares:
                    self._futures.append(self._saver.submit(self.writer.share, share))

    def _keep(self, spec: KeepSpec) -> None:
        try:
            if spec.warm:
                self.store.warm(spec.keys, spec.tenant)
            else:
                self.store.keep(spec.keys, spec.tenant, spec.keep_s)
        except Exception:  # a keep is an optimisation: never fail a step over it
            logger.exception("keeping %d blocks of session %r failed", len(spec.keys),
                             spec.session)

    def _load_all(self, meta: ContextKitConnectorMetadata) -> None:
        if not meta.loads:
            return
        t0 = time.perf_counter()
        for spec in meta.loads:
            if self.writer is not None and spec.shared:
                # the shared tier's chunks into the DDR tier first (what is refused,
                # missing or late is recomputed)
                self._imported(*self._loader.submit(self.writer.bring_in, spec).result())
            # Decode on a helper thread: the fused CPU decoder (numba) sets the calling
            # thread's OpenMP thread count, which vLLM's CPU attention checks against
            # the step's metadata (and vLLM forbids setting it back).
            n = self._loader.submit(self._load, spec).result()
            missing = spec.block_ids[n:]
            if missing:
                logger.warning("request %s: %d of %d blocks no longer stored; vLLM recomputes "
                               "them", spec.req_id, len(missing), len(spec.block_ids))
            if spec.chunk is not None:
                if self.writer is not None and any(c.shared for c in spec.chunk.chunks):
                    # chunks another replica computed: their blocks into the DDR tier
                    self._imported(*self._loader.submit(self.writer.bring_in_spans,
                                                        spec.chunk).result())
                self._materialize(spec.chunk, failed=bool(missing))
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

    def _materialize(self, chunk: ChunkLoad, *, failed: bool) -> None:
        """Tokens ``chunk.start .. chunk.end-1`` into the request's pages: each moved
        chunk's K/V decoded from the store, keys re-rotated to their new positions, then
        the changed spans and seams computed by the served model over the pages. Any
        failure (a source block gone, another tenant's, the model missing) turns the
        range into load errors, which vLLM recomputes."""
        t0 = time.perf_counter()
        bs = self.block_size
        computed: int | None = None
        if not failed and self._served is not None:
            try:
                computed = self._place_and_repair(chunk, self._served)
            except Exception:
                logger.exception("request %s: chunk reuse failed; vLLM recomputes tokens "
                                 "%d..%d", chunk.req_id, chunk.start, chunk.end)
        with self._lock:
            if computed is not None:
                self.recent_chunks.append(chunk)
                span = chunk.end - chunk.start
                self._report.chunk_reused_tokens[chunk.req_id] = span - computed
                self._report.chunk_computed_tokens[chunk.req_id] = computed
            else:
                self._load_errors.update(chunk.block_ids[chunk.start // bs:chunk.end // bs])
                self._report.load_failed_tokens[chunk.req_id] = (
                    self._report.load_failed_tokens.get(chunk.req_id, 0)
                    + chunk.end - chunk.start)
        self.store.stats.count("chunk_seconds", time.perf_counter() - t0)

    def _place_and_repair(self, chunk: ChunkLoad, model: ServedLlama) -> int | None:
        """Move the chunks in, compute the rest of the range; the tokens computed, or
        None when a source block is gone."""
        keys: dict[bytes, int] = {}
        for moved in chunk.chunks:
            for key in moved.source_keys:
                keys.setdefault(key, len(keys))
        n_src = len(keys)
        t0 = time.perf_counter()
        parts = self._loader.submit(self.store.export_all, list(keys), chunk.tenant).result()
        if parts is None:
            logger.warning("request %s: a reused chunk's blocks are no longer stored; vLLM "
                           "recomputes tokens %d..%d", chunk.req_id, chunk.start, chunk.end)
            return None
        placement = ChunkPlacement.of(chunk.chunks, keys, self.block_size, model.rotation)
        paged = PagedKV([self._pages[name] for name in self._names], self._layout.split,
                        self._key_order, chunk.block_ids, self.block_size, isa=self._isa)
        self._loader.submit(placement.run, parts, paged, self._rows).result()
        t1 = time.perf_counter()
        compute = chunk.compute
        if chunk.selected:
            compute = self._select(chunk, model, paged)
        if compute:
            model.forward([chunk.range_ids[p - chunk.start] for p in compute], compute, paged)
        logger.debug("request %s: chunk reuse moved %d tokens from %d blocks in %.3f s, "
                     "computed %d in %.3f s", chunk.req_id, placement.tokens, n_src, t1 - t0,
                     len(compute), time.perf_counter() - t1)
        return len(compute)

    def _select(self, chunk: ChunkLoad, model: ServedLlama, paged: PagedKV) -> list[int]:
        """CacheBlend's selection: the range's first layers run over every token; at
        ``chunk_select_layer`` the ``chunk.selected`` moved tokens whose fresh K/V deviate
        most from the moved ones join the tokens to compute. Every token's fresh K/V are
        written at that layer and below."""
        start, end = chunk.start, chunk.end
        layer = min(self.config.chunk_select_layer, model.num_layers - 1)
        old_k, old_v = (t[:, start:end].transpose(0, 1) for t in paged.context(layer, end))
        old_k, old_v = old_k.clone(), old_v.clone()
        positions = list(range(start, end))
        k, v = model.select_kv(chunk.range_ids, positions, paged, layer)
        deviation = ((k.float() - old_k.float()) ** 2).sum((1, 2)) + (
            (v.float() - old_v.float()) ** 2).sum((1, 2))
        computed = torch.tensor([p - start for p in chunk.compute], dtype=torch.int64)
        deviation[computed] = -1.0
        picks = chunk.selected
        paged.write(layer, torch.arange(start, end), k, v)
        chosen = torch.topk(deviation, picks).indices + start if picks else torch.empty(0)
        return sorted({*chunk.compute, *(int(p) for p in chosen)})

    def take_load_errors(self) -> set[int]:
        """``get_block_ids_with_load_errors``: blocks vLLM must recompute."""
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    # ------------------------------------------------------------------ saves
    def save_layer(self, meta: ContextKitConnectorMetadata | None, layer_name: str) -> None:
        """``save_kv_layer``: copy the step's new blocks of one layer out of the pages."""
        if meta is None or not meta.saves or layer_name not in self._pages:
            return
        if not self._staged:
            self._staged = [Staged(spec) for spec in meta.saves]
        for staged in self._staged:
            self._stage(staged, layer_name)

    def _stage(self, staged: Staged, name: str) -> None:
        """Copy a save spec's pages of one layer out of the paged cache."""
        pages = self._pages[name]
        idx = torch.tensor(staged.spec.block_ids, dtype=torch.int64, device=pages.device)
        layer = self._layer_of[name]
        staged.k[layer], staged.v[layer] = self._layout.split(pages.index_select(0, idx))

    def wait_for_save(self, meta: ContextKitConnectorMetadata | None) -> None:
        """Hand the staged blocks (and any layer ``save_layer`` did not see) to the save
        thread; the forward goes on while they are encoded."""
        staged, self._staged = self._staged, []
        if meta is None or not meta.saves:
            return
        if not staged:
            staged = [Staged(spec) for spec in meta.saves]
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
        if self.writer is not None:
            self.writer.saved(spec, held)
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

    def build_worker_meta(self) -> ContextKitWorkerMetadata | None:
        """``build_connector_worker_meta``: what changed since the last step."""
        with self._lock:
            report, self._report = self._report, WorkerReport()
        return ContextKitWorkerMetadata(report) if report else None

    def take_stats(self) -> dict[str, Any] | None:
        """Loads, saves, evictions and the shadow since the last call (the shared tier's
        writer publishes its own: :mod:`integrations.vllm.ledger`)."""
        return self.store.take_stats()

    def flush(self) -> None:
        """Wait for queued saves (tests and shutdown)."""
        for future in list(self._futures):
            future.result()
        self._futures.clear()

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)
        self._loader.shutdown(wait=True)
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
        self.store.close()
