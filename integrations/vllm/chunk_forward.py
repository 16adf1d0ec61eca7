"""The served model's own forward over chosen tokens: how the connector repairs chunks
on vLLM.

A chunk moved to a new position keeps its values and has its keys re-rotated by the
position delta (RoPE rotations compose). What changed around it (a new memory line,
an edited document) and the first tokens of each moved chunk (its seam with new
context) must be computed, attending over everything before them, before vLLM's own
forward computes the rest of the prompt. vLLM's scheduler cannot compute a scattered
set of tokens, so the connector does it here, with the server's own model modules
(the weights vLLM loaded, reached through :mod:`integrations.vllm.served_model`):
each decoder layer runs over the chosen tokens only, writes their K/V into the paged
cache and attends over the request's pages. That is CacheBlend's selective recompute
with the tokens picked ahead (EPIC's rule: each chunk's first tokens). On vLLM's CPU
build the writes and the attention go through vLLM's own cache and attention kernels,
straight over the pages (each run of consecutive tokens is one request of a chunked
prefill to them); elsewhere, and for the model check's plain tensors, torch's SDPA
attends over a copy of the context. Where the projections run in bfloat16 on AMX,
the attention does too (vLLM's AMX kernel over a bfloat16 copy of the context).

Only Llama-family decoders (vLLM's ``LlamaForCausalLM`` module layout, neox RoPE
over the whole head) are supported; :func:`served_llama` names why another model
cannot be, and the connector then serves prefix reuse only.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from integrations.vllm.layout import keys_by_token, probe_amx_pages
from integrations.vllm.served_model import loaded_weight

logger = logging.getLogger(__name__)

__all__ = ["ContiguousKV", "KVAccess", "LowLinear", "PagedKV", "Projections", "Runs",
           "ServedLlama", "attend_sdpa", "attention_dtype", "cpu_has_amx_bf16",
           "cpu_multiplies_bf16", "fused_amx_copy", "low_isa", "matmul_dtype", "served_llama"]

#: Runs of consecutive tokens at least this long attend on their own (SDPA's causal
#: kernel); shorter ones (seams) together under one dense mask.
LONG_RUN = 16

#: vLLM model classes whose module layout :class:`ServedLlama` drives.
LLAMA_FAMILY = frozenset({"LlamaForCausalLM"})


class KVAccess(Protocol):
    """Where a forward writes the chosen tokens' K/V and reads the context from."""

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        """Store ``k``/``v`` ``[T, H_kv, D]`` of tokens at ``positions`` ``[T]``."""

    def context(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V ``[H_kv, upto, D]`` of positions ``0 .. upto-1``."""

    def attend(self, layer: int, q: torch.Tensor, runs: Runs, scale: float,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        """Causal attention of queries ``[T, H, D]`` (the tokens of ``runs``, their K/V
        already written) over the context, computed in ``dtype`` (None: the K/V's);
        ``[T, H, D]`` float32."""


@dataclass(frozen=True)
class Runs:
    """The chosen tokens as runs of consecutive positions.

    Attributes:
        spans: ``(first row, end row, end position)`` of each run.
        positions: the tokens' positions ``[T]`` (ascending).
    """

    spans: tuple[tuple[int, int, int], ...]
    positions: torch.Tensor

    @classmethod
    def of(cls, positions: Sequence[int], device: torch.device | str = "cpu") -> Runs:
        """The runs of ``positions`` (ascending, at least one)."""
        spans: list[tuple[int, int, int]] = []
        start = 0
        for i in range(1, len(positions) + 1):
            if i == len(positions) or positions[i] != positions[i - 1] + 1:
                spans.append((start, i, positions[i - 1] + 1))
                start = i
        return cls(tuple(spans), torch.as_tensor(list(positions), dtype=torch.int64,
                                                 device=device))

    @property
    def upto(self) -> int:
        """One past the last position."""
        return max(end for _, _, end in self.spans)


def attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: Runs,
                scale: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:meth:`KVAccess.attend` with torch's SDPA in ``dtype`` over the context
    ``k``/``v`` ``[H_kv, S, D]``: runs of :data:`LONG_RUN` tokens or more each on their
    own (causal, aligned bottom-right: a run's last query sees every key before it),
    shorter ones (seams) together under one dense mask. ``[T, H, D]`` float32."""
    from torch.nn.attention.bias import causal_lower_right

    qh = q.transpose(0, 1).to(dtype)  # [H, T, D]
    k, v = k.to(dtype), v.to(dtype)
    out = qh.new_empty(qh.shape)
    short = []
    for a, b, end in runs.spans:
        if b - a >= LONG_RUN:
            out[:, a:b] = torch.nn.functional.scaled_dot_product_attention(
                qh[None, :, a:b], k[None, :, :end], v[None, :, :end],
                attn_mask=causal_lower_right(b - a, end), scale=scale, enable_gqa=True)[0]
        else:
            short.append((a, b, end))
    if short:
        pos = runs.positions.to(q.device)
        rows = torch.cat([torch.arange(a, b) for a, b, _ in short]).to(q.device)
        end = max(e for _, _, e in short)
        mask = torch.arange(end, device=q.device)[None, :] <= pos[rows][:, None]
        out[:, rows] = torch.nn.functional.scaled_dot_product_attention(
            qh[None, :, rows], k[None, :, :end], v[None, :, :end],
            attn_mask=mask, scale=scale, enable_gqa=True)[0]
    return out.transpose(0, 1).float()


@dataclass
class PagedKV:
    """One request's K/V in vLLM's paged cache.

    Attributes:
        pages: per layer, the page view ``[num_blocks, ...]`` of vLLM's KV tensor
            (:class:`~integrations.vllm.layout.PagedLayout` ``pages``).
        split: the layout's pages -> ``(k, v)`` ``[n, H_kv, N, D]``.
        key_order: how a page's key half orders its values
            (:data:`~integrations.vllm.layout.KEY_ORDERS`).
        block_ids: the request's vLLM block ids, in order.
        block_size: tokens per block (``N``).
        isa: vLLM's CPU attention kernel of these pages (``"vec"``, ``"amx"``, ...):
            writes and attention then run through vLLM's own cache and attention
            kernels, straight over the pages; None: torch ops over a copy of the
            context. Attention in a lower dtype than the pages' (bfloat16 on AMX)
            runs over a copy of the context in that dtype, in pages of its own.
    """

    pages: Sequence[torch.Tensor]
    split: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
    key_order: str
    block_ids: Sequence[int]
    block_size: int
    isa: str | None = None
    _plan: tuple[Runs, str, tuple[torch.Tensor, ...]] | None = field(
        default=None, init=False, repr=False)
    _low: torch.Tensor | None = field(default=None, init=False, repr=False)

    def _slots(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.as_tensor(list(self.block_ids), dtype=torch.int64)
        return ids[positions // self.block_size], positions % self.block_size

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        kp, vp = self.split(self.pages[layer])
        blocks, slots = self._slots(positions.to(torch.int64).cpu())
        if self.isa is not None:
            from vllm import _custom_ops as ops

            ops.cpu_attn_reshape_and_cache(
                k.to(kp.dtype).contiguous(), v.to(vp.dtype).contiguous(), kp, vp,
                blocks * self.block_size + slots, self.isa)
            return
        kp = keys_by_token(kp, self.key_order)
        blocks, slots = blocks.to(kp.device), slots.to(kp.device)
        kp[blocks, :, slots] = k.to(kp.device, kp.dtype)
        vp[blocks, :, slots] = v.to(vp.device, vp.dtype)

    def context(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = -(-upto // self.block_size)
        pages = self.pages[layer]
        idx = torch.as_tensor(list(self.block_ids[:n]), dtype=torch.int64, device=pages.device)
        # whole pages first (one contiguous copy), then each into token order
        k, v = self.split(pages.index_select(0, idx))
        out = []
        for part in (keys_by_token(k, self.key_order), v):  # [n, H, N, D]
            h, d = part.shape[1], part.shape[3]
            out.append(part.permute(1, 0, 2, 3).reshape(h, -1, d)[:, :upto])
        return out[0], out[1]

    def attend(self, layer: int, q: torch.Tensor, runs: Runs, scale: float,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        if self.isa is None:
            return attend_sdpa(q, *self.context(layer, runs.upto), runs, scale,
                               dtype or torch.float32)
        from vllm import _custom_ops as ops

        kp, vp = self.split(self.pages[layer])
        isa, table = self.isa, None
        if dtype is not None and dtype != kp.dtype:
            isa = low_isa(dtype, self.isa, self.block_size)
            kp, vp = self._low_context(layer, runs.upto, dtype, isa)
            table = torch.arange(kp.shape[0], dtype=torch.int32)
        starts, ends, table, schedule = self._kernel_plan(runs, q, kp.dtype, isa, table)
        out = torch.empty(q.shape, dtype=kp.dtype, device=kp.device)
        ops.cpu_attention_with_kv_cache(
            query=q.to(kp.dtype).contiguous(), key_cache=kp, value_cache=vp, output=out,
            query_start_loc=starts, seq_lens=ends, scale=scale, causal=True,
            alibi_slopes=None, sliding_window=-1, block_table=table, softcap=0.0,
            scheduler_metadata=schedule, s_aux=None)
        return out.float()

    def _low_context(self, layer: int, upto: int, dtype: torch.dtype, isa: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """The context ``0 .. upto-1`` of ``layer`` (the tokens just written included)
        cast to ``dtype`` in pages of its own for vLLM's ``isa`` kernel (block ``i``
        holds the request's ``i``-th block), one buffer for every layer of a forward:
        by one fused pass from the pages where :func:`fused_amx_copy` holds, else
        through token order and vLLM's cache kernel."""
        from vllm import _custom_ops as ops

        n = -(-upto // self.block_size)
        pages = self.pages[layer]
        heads, dim = self.num_kv_heads, int(pages.shape[-1])
        if self._low is None or self._low.shape[0] < n or self._low.dtype != dtype:
            # vLLM's CPU cache: [blocks, H_kv, 2N, D], keys in the first N rows
            self._low = torch.zeros(n, heads, 2 * self.block_size, dim, dtype=dtype)
        low = self._low[:n]
        kc, vc = low.chunk(2, dim=2)
        if (isa == "amx" and pages.dtype == torch.float32 and pages.is_contiguous()
                and pages.device.type == "cpu"
                and fused_amx_copy(self.key_order, self.block_size, dim)):
            import numpy as np

            from gpu_cache.kernels import cpu_fused

            ids = np.asarray(list(self.block_ids[:n]), dtype=np.int64)
            cpu_fused.amx_pages_into(pages.view(-1).numpy().view(np.uint32), ids,
                                     low.view(torch.int16).view(-1).numpy().view(np.uint16),
                                     heads, self.block_size, dim, self.key_order == "dim")
            return kc, vc
        k, v = (t.transpose(0, 1).to(dtype).contiguous() for t in self.context(layer, upto))
        ops.cpu_attn_reshape_and_cache(k, v, kc, vc, torch.arange(upto), isa)
        return kc, vc

    def _kernel_plan(self, runs: Runs, q: torch.Tensor, dtype: torch.dtype, isa: str,
                     table: torch.Tensor | None) -> tuple[torch.Tensor, ...]:
        """vLLM's CPU attention sees each run as one request of a chunked prefill: its
        queries are the last tokens of a sequence of ``end`` tokens over this request's
        blocks (``table``: their ids in the pages attended, default this request's
        block ids; causal, aligned bottom-right). The same for every layer of a
        forward."""
        if self._plan is not None and self._plan[0] is runs and self._plan[1] == isa:
            return self._plan[2]
        from vllm import _custom_ops as ops
        from vllm import envs

        starts = torch.tensor([0] + [b for _, b, _ in runs.spans], dtype=torch.int32)
        ends = torch.tensor([end for _, _, end in runs.spans], dtype=torch.int32)
        n = -(-runs.upto // self.block_size)
        ids = (torch.tensor(list(self.block_ids[:n]), dtype=torch.int32) if table is None
               else table[:n])
        blocks = ids[None, :].expand(len(runs.spans), n).contiguous()
        schedule = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=len(runs.spans), num_heads=q.shape[1], num_kv_heads=self.num_kv_heads,
            head_dim=q.shape[2], seq_lens=ends, dtype=dtype, query_start_loc=starts,
            causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=bool(envs.VLLM_CPU_ATTN_SPLIT_KV))
        self._plan = (runs, isa, (starts, ends, blocks, schedule))
        return self._plan[2]

    @property
    def num_kv_heads(self) -> int:
        return int(self.pages[0].shape[1])


class ContiguousKV:
    """K/V in plain tensors ``[L, H_kv, S, D]`` (the gate's full and reused passes)."""

    def __init__(self, num_layers: int, num_kv_heads: int, length: int, head_dim: int,
                 dtype: torch.dtype = torch.float32) -> None:
        self.k = torch.zeros(num_layers, num_kv_heads, length, head_dim, dtype=dtype)
        self.v = torch.zeros_like(self.k)

    def write(self, layer: int, positions: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> None:
        pos = positions.to(torch.int64).cpu()
        self.k[layer][:, pos] = k.transpose(0, 1).to(self.k.dtype).cpu()
        self.v[layer][:, pos] = v.transpose(0, 1).to(self.v.dtype).cpu()

    def context(self, layer: int, upto: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer][:, :upto], self.v[layer][:, :upto]

    def attend(self, layer: int, q: torch.Tensor, runs: Runs, scale: float,
               dtype: torch.dtype | None = None) -> torch.Tensor:
        return attend_sdpa(q, *self.context(layer, runs.upto), runs, scale,
                           dtype or torch.float32)


class ServedLlama:
    """A vLLM Llama-family model's modules, driven token by chosen token.

    Args:
        model: vLLM's ``LlamaForCausalLM`` (or a module of the same layout).
        matmul_dtype: the dtype of the decoder layers' projections in :meth:`forward`
            (their weights copied once, prepacked for vLLM's oneDNN GEMM where the
            build has it): bfloat16 runs them on a CPU's AMX units, about 3x faster
            than float32 at a few hundred tokens. None: the model's own modules.
        attention_dtype: the dtype :meth:`forward`'s attention computes in (the
            context cast to it; :meth:`KVAccess.attend`) for passes of
            :attr:`low_attention_from` tokens or more, or None: the K/V's.
            Embeddings, norms, RoPE and the K/V written stay in the model's dtype;
            ``exact=True`` passes use the model's own modules and dtype throughout.
    """

    #: the fewest tokens a pass attends in :attr:`attention_dtype` for: below them
    #: casting the context costs more than the faster kernel saves
    #: (scripts/chunk_pass_timings.py measures both)
    low_attention_from = 64

    def __init__(self, model: Any, *, matmul_dtype: torch.dtype | None = None,
                 attention_dtype: torch.dtype | None = None) -> None:
        inner = model.model
        self.model = model
        self.embed = inner.embed_tokens
        self.layers = list(inner.layers)
        self.norm = inner.norm
        attn = self.layers[0].self_attn
        self.num_heads: int = attn.num_heads
        self.num_kv_heads: int = attn.num_kv_heads
        self.head_dim: int = attn.head_dim
        self.q_size: int = attn.q_size
        self.kv_size: int = attn.kv_size
        self.scaling: float = attn.scaling
        rope = attn.rotary_emb
        cache = rope.cos_sin_cache
        half = cache.shape[-1] // 2
        self._cos, self._sin = cache[:, :half].float(), cache[:, half:].float()
        dtype = next(model.parameters()).dtype
        self.matmul_dtype = matmul_dtype if matmul_dtype not in (None, dtype) else None
        self.attention_dtype = (attention_dtype if attention_dtype not in (None, dtype)
                                else None)
        self._low: list[Projections] = []
        if self.matmul_dtype is not None:
            try:
                self._low = [Projections.of(layer, self.matmul_dtype) for layer in self.layers]
            except ValueError as exc:
                logger.warning("chunk reuse computes its projections in %s: %s", dtype, exc)
                self.matmul_dtype = None

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def rotation(self, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, D/2]`` of RoPE's rotation by ``delta`` (``[T]``, any
        sign) positions."""
        mag = delta.abs().to(torch.int64).cpu()
        sign = torch.where(delta.cpu() < 0, -1.0, 1.0)[:, None, None]
        return self._cos[mag][:, None, :], self._sin[mag][:, None, :] * sign

    def rotate(self, k: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Keys ``[T, H, D]`` computed at ``p`` as they are at ``p + delta``: RoPE's
        rotations compose, so one more rotation by ``delta`` moves them."""
        cos, sin = self.rotation(delta)
        return self.rotate_with(k, cos, sin)

    @staticmethod
    def rotate_with(k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``k`` ``[T, H, D]`` rotated by :meth:`rotation`'s ``cos``/``sin`` (neox
        layout: dimension ``i`` pairs with ``i + D/2``)."""
        x = k.float()
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        cos, sin = cos.to(x.device), sin.to(x.device)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(k.dtype)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], positions: Sequence[int], kv: KVAccess,
                *, logits: bool = False, exact: bool = False) -> torch.Tensor | None:
        """Run every layer over ``token_ids`` at ``positions`` (ascending), writing their
        K/V through ``kv`` and attending over ``kv``'s context up to each token.
        ``exact``: through the model's own modules even where :attr:`matmul_dtype` is
        set (a reference pass).

        Returns:
            The tokens' logits ``[T, vocab]`` when ``logits``, else None.
        """
        if len(token_ids) != len(positions):  # vLLM's RoPE kernel would write past q
            raise ValueError(f"{len(token_ids)} token ids for {len(positions)} positions")
        hidden, residual = self._run(token_ids, positions, kv, len(self.layers), exact)
        if not logits:
            return None
        hidden, _ = self.norm(hidden, residual)
        return self.model.compute_logits(hidden).float()

    @torch.inference_mode()
    def select_kv(self, token_ids: Sequence[int], positions: Sequence[int], kv: KVAccess,
                  layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers ``0 .. layer-1`` over the tokens (their K/V written), then layer
        ``layer``'s fresh K/V of each ``[T, H_kv, D]``, not written: CacheBlend's
        selection pass, whose caller compares them with the moved K/V there."""
        hidden, residual = self._run(token_ids, positions, kv, layer, False)
        device = hidden.device
        pos = torch.as_tensor(list(positions), dtype=torch.int64, device=device)
        block = self.layers[layer]
        x = (block.input_layernorm(hidden) if residual is None
             else block.input_layernorm(hidden, residual)[0])
        return self._kv(block.self_attn, x, pos, self._proj(layer, False))[1:]

    def _proj(self, layer: int, exact: bool) -> Projections | None:
        return None if exact or not self._low else self._low[layer]

    def _kv(self, attn: Any, x: torch.Tensor, pos: torch.Tensor, low: Projections | None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        t = x.shape[0]
        qkv = attn.qkv_proj(x)[0] if low is None else low.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = attn.rotary_emb(pos, q.contiguous(), k.contiguous())
        return (q, k.reshape(t, self.num_kv_heads, self.head_dim),
                v.reshape(t, self.num_kv_heads, self.head_dim))

    def _run(self, token_ids: Sequence[int], positions: Sequence[int], kv: KVAccess,
             num_layers: int, exact: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The first ``num_layers`` decoder layers over the tokens; the hidden state
        and residual after them."""
        device = next(self.model.parameters()).device
        ids = torch.as_tensor(list(token_ids), dtype=torch.int64, device=device)
        runs = Runs.of(positions, device)
        pos = runs.positions
        t = ids.shape[0]
        hidden = self.embed(ids)
        residual: torch.Tensor | None = None
        low_attention = (self.attention_dtype if not exact and t >= self.low_attention_from
                         else None)
        for i, layer in enumerate(self.layers[:num_layers]):
            if residual is None:
                residual = hidden
                x = layer.input_layernorm(hidden)
            else:
                x, residual = layer.input_layernorm(hidden, residual)
            attn, low = layer.self_attn, self._proj(i, exact)
            q, k, v = self._kv(attn, x, pos, low)
            kv.write(i, pos, k, v)
            out = kv.attend(i, q.reshape(t, self.num_heads, self.head_dim), runs, self.scaling,
                            low_attention)
            out = out.reshape(t, self.q_size).to(x.dtype)
            hidden = attn.o_proj(out)[0] if low is None else low.o(out)
            x, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = (layer.mlp(x) if low is None
                      else low.down(layer.mlp.act_fn(low.gate_up(x))))
        return hidden, residual


@dataclass(frozen=True)
class LowLinear:
    """One projection of a decoder layer in a lower matmul dtype: ``x @ weight.T`` in
    the weight's dtype, returned in ``x``'s, plus the bias (in the model's dtype, as
    vLLM applies it).

    Attributes:
        weight: ``[N, K]`` in the matmul dtype.
        bias: or None.
        gemm: ``x @ weight.T`` by vLLM's oneDNN GEMM, the weight prepacked once (its
            CPU builds), or None: torch's ``linear``, which repacks the weight on every
            call (at a few tokens, about twice the time; the same products).
    """

    weight: torch.Tensor
    bias: torch.Tensor | None
    gemm: Callable[[torch.Tensor], torch.Tensor] | None = None

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None) -> LowLinear:
        return cls(weight, bias, _prepacked(weight))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        low = x.to(self.weight.dtype)
        out = (torch.nn.functional.linear(low, self.weight) if self.gemm is None
               else self.gemm(low.contiguous()))
        out = out.to(x.dtype)
        return out if self.bias is None else out + self.bias


def _prepacked(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``x @ weight.T`` by vLLM's oneDNN GEMM with the CPU weight ``[N, K]`` prepacked,
    or None where the installed vLLM has none (a GPU build, another architecture) or
    refuses it."""
    if weight.device.type != "cpu":
        return None
    try:
        from vllm import _custom_ops as ops

        handler = ops.create_onednn_mm(weight.t(), 32)
    except (ImportError, AttributeError, RuntimeError) as exc:
        logger.debug("chunk reuse's projections use torch's linear: %s", exc)
        return None
    return lambda x: ops.onednn_mm(handler, x, None)


@dataclass(frozen=True)
class Projections:
    """One decoder layer's projections in a lower matmul dtype (:class:`LowLinear`)."""

    qkv: LowLinear
    o: LowLinear
    gate_up: LowLinear
    down: LowLinear

    @classmethod
    def of(cls, layer: Any, dtype: torch.dtype) -> Projections:
        def copy(module: Any) -> LowLinear:
            weight = loaded_weight(module)
            if weight is None:
                raise ValueError(f"{type(module).__name__} has no weight at hand to copy "
                                 "(vLLM repacked it and the loader kept none)")
            bias = getattr(module, "bias", None)
            if getattr(module, "skip_bias_add", False):
                bias = None  # returned to the caller, which Llama's layers drop
            return LowLinear.of(weight.to(dtype).contiguous(),
                                None if bias is None else bias.detach())

        attn, mlp = layer.self_attn, layer.mlp
        return cls(copy(attn.qkv_proj), copy(attn.o_proj), copy(mlp.gate_up_proj),
                   copy(mlp.down_proj))


def _cpu_flags(cpuinfo: str) -> frozenset[str]:
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[-1].split())
    except OSError:
        pass
    return frozenset()


def cpu_has_amx_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 matrices on AMX tiles (Linux's flags)."""
    return "amx_bf16" in _cpu_flags(cpuinfo)


def cpu_multiplies_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has bfloat16 dot products in hardware (AMX-BF16, or AVX512-BF16
    as on AMD Zen 4 and later), where oneDNN's bfloat16 GEMM runs about twice as fast
    as its float32 one."""
    return bool({"amx_bf16", "avx512_bf16"} & _cpu_flags(cpuinfo))


def matmul_dtype(setting: str, device: torch.device | str) -> torch.dtype | None:
    """The connector forward's projection dtype for a ``chunk_matmul_dtype`` setting
    (:data:`~integrations.vllm.config.MATMUL_DTYPES`):
    ``bfloat16``; ``model`` (None: the model's own); ``auto``: bfloat16 on a CPU with
    bfloat16 dot products (:func:`cpu_multiplies_bf16`), else the model's."""
    if setting == "bfloat16":
        return torch.bfloat16
    if setting == "auto" and torch.device(device).type == "cpu" and cpu_multiplies_bf16():
        return torch.bfloat16
    return None


def attention_dtype(matmul: torch.dtype | None, device: torch.device | str
                    ) -> torch.dtype | None:
    """The connector forward's attention dtype for its projections' (:func:`matmul_dtype`):
    bfloat16 with bfloat16 projections on a CPU with AMX-BF16, where vLLM's AMX kernel
    attends about 3x faster than its float32 one; else None (the K/V's dtype)."""
    if (matmul is torch.bfloat16 and torch.device(device).type == "cpu"
            and cpu_has_amx_bf16()):
        return torch.bfloat16
    return None


@functools.cache
def fused_amx_copy(key_order: str, block_size: int, head_dim: int) -> bool:
    """Whether the fused cast into AMX pages matches vLLM's own kernel here (checked
    once per process and page shape, its kernel compiled on the way:
    :func:`~integrations.vllm.layout.probe_amx_pages`)."""
    ok = probe_amx_pages(key_order, block_size, head_dim)
    if not ok:
        logger.info("chunk reuse casts its bfloat16 context through vLLM's cache kernel "
                    "(the fused cast does not match this vLLM's AMX pages)")
    return ok


@functools.cache
def low_isa(dtype: torch.dtype, isa: str, block_size: int) -> str:
    """vLLM's CPU attention kernel for pages in ``dtype``, beside ``isa`` for the
    model's: ``"amx"`` for bfloat16 pages of a multiple of 32 tokens on a CPU with AMX
    tiles (their use requested from the kernel first), else ``isa``."""
    if (dtype is torch.bfloat16 and block_size % 32 == 0
            and torch.cpu._is_amx_tile_supported()):
        torch.cpu._init_amx()  # Linux hands out AMX tile state on request only
        return "amx"
    return isa


def served_llama(model: Any, *, matmul_dtype: torch.dtype | None = None,
                 attention_dtype: torch.dtype | None = None
                 ) -> tuple[ServedLlama | None, str | None]:
    """The model as a :class:`ServedLlama` (``matmul_dtype``, ``attention_dtype``: see
    there), or None and why chunk reuse cannot use it."""
    if model is None:
        return None, ("the served model is not available to the connector: launch vLLM "
                      "with --load-format contextkit (contextkit's model loader plugin)")
    name = type(model).__name__
    if name not in LLAMA_FAMILY:
        return None, (f"{name} is not a Llama-family decoder (supported: "
                      f"{', '.join(sorted(LLAMA_FAMILY))})")
    try:
        served = ServedLlama(model, matmul_dtype=matmul_dtype,
                             attention_dtype=attention_dtype)
        attn = served.layers[0].self_attn
        rope = attn.rotary_emb
        if not getattr(rope, "is_neox_style", False) or rope.rotary_dim != served.head_dim:
            return None, f"{name} rotates keys other than by neox RoPE over the whole head"
        if type(attn.rotary_emb).__name__ not in {"RotaryEmbedding", "Llama3RotaryEmbedding"}:
            return None, f"{name} uses {type(rope).__name__}, not a position-only RoPE"
    except (AttributeError, IndexError, TypeError) as exc:
        return None, f"{name} does not have the Llama module layout ({exc})"
    return served, None
