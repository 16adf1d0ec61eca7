"""Per-request K/V views: contiguous (no-cache baseline) and paged over the block cache."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from contextkit.engine.attention import (
    attend_positions,
    attend_with_prefix,
    flash_attention,
    fold_heads,
    merge_partials,
    unfold_heads,
)
from gpu_cache import TQGPUCache
from gpu_cache.codec import TQ4Encoded
from gpu_cache.kernels import Backend, cpu_decode, quantize_into_cache, tq4_decode_attention

__all__: list[str] = []

#: Rows up to which new K/V are encoded by one compiled call on CPU (a decode step,
#: a short extension); longer runs take the codec's batched path.
_FUSED_ENCODE_ROWS = 64


def read_slots(cache: TQGPUCache, layer: int, slots: torch.Tensor,
               values: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """K/V held in device ``slots`` of ``layer``: float ``[n, Hkv, D]`` (keys centered
    for tq4, as the cache stores them); ``values=False`` reads the keys alone."""
    view = cache.layer_view(layer)
    h = view.k_packed.shape[2]

    def read(packed: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
        rows = packed.view(-1, h, packed.shape[3]).index_select(0, slots)
        if cache.identity.codec == "native":
            return rows.float()
        return cache.codec.decode(TQ4Encoded(rows, norms.view(-1, h).index_select(0, slots)))

    return (read(view.k_packed, view.k_norms),
            read(view.v_packed, view.v_norms) if values else None)


def slots_of(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slots of sequence ``positions`` (any order, gaps allowed) under a block
    ``table`` (one slot base per block of the sequence)."""
    pos = positions.to(table.device)
    return table[pos // block_size] * block_size + pos % block_size


def write_slots(cache: TQGPUCache, layer: int, slots: torch.Tensor, k: torch.Tensor,
                v: torch.Tensor | None) -> None:
    """Store K ``[n, Hkv, D]`` (uncentered: the layer's key offset is taken off for
    tq4) and V (``None``: leave them) in device ``slots`` of ``layer``."""
    view = cache.layer_view(layer)
    h = view.k_packed.shape[2]
    if cache.identity.codec == "native":
        d = view.k_packed.shape[3]
        view.k_packed.view(-1, h, d).index_copy_(0, slots, k.float())
        if v is not None:
            view.v_packed.view(-1, h, d).index_copy_(0, slots, v.float())
        return
    offset = cache.key_offset(layer)
    pd = view.k_packed.shape[3]
    pairs = [(k.float() if offset is None else k.float() - offset, view.k_packed, view.k_norms)]
    if v is not None:
        pairs.append((v.float(), view.v_packed, view.v_norms))
    for x, packed, norms in pairs:
        enc = cache.codec.encode(x.contiguous())
        packed.view(-1, h, pd).index_copy_(0, slots, enc.packed)
        norms.view(-1, h).index_copy_(0, slots, enc.norms)


def check_overlay(residual_tokens: int, sink_tokens: int, block_size: int) -> None:
    """Validate the float residual window and sink sizes (engine or per call)."""
    if residual_tokens < 0:
        raise ValueError(f"residual_tokens must be >= 0, got {residual_tokens}")
    if sink_tokens < 0 or sink_tokens % block_size:
        raise ValueError(f"sink_tokens must be a multiple of block_size ({block_size}) and "
                         f">= 0, got {sink_tokens}")


class ContiguousKV:
    """Plain per-request K/V (the no-cache baseline)."""

    def __init__(self, num_layers: int) -> None:
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.v: list[torch.Tensor | None] = [None] * num_layers

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int, scale: float) -> torch.Tensor:
        k_prev, v_prev = self.k[layer], self.v[layer]
        if k_prev is not None and v_prev is not None:
            k_prev, v_prev = k_prev[:start], v_prev[:start]
        out = attend_with_prefix(q, k_prev, v_prev, k, v, scale)
        self.k[layer] = k if k_prev is None else torch.cat([k_prev, k])
        self.v[layer] = v if v_prev is None else torch.cat([v_prev, v])
        return out


class PagedKV:
    """One sequence's view of the block cache: writes new K/V, attends over the prefix.

    Tokens ``< cached`` are already in the cache (reused blocks) and are not written.
    ``fresh=True`` lets new tokens attend to their own unquantized K/V (prefill);
    ``fresh=False`` reads them back as decode would see them (teacher-forced scoring).

    Full-precision overlay (TQ4 only). Two ranges of the sequence are read as float32
    for the whole request instead of from their packed copy:

    - the **attention sink**, positions ``[0, sink)``: the first tokens draw a large
      share of attention in every layer, so their 4-bit error reaches every query.
      Their K/V depend on those tokens alone, so the engine recomputes them (one
      short forward) when the request reuses them from the cache;
    - the **residual window**, positions ``>= window_start`` that this request
      computes (the tail of the prompt and every generated token), as KIVI keeps its
      most recent tokens in full precision.

    The cache stores every token in TQ4 all the same: later requests and other
    engines read the packed blocks. Decode attends the packed middle with the fused
    kernel and merges the float ranges by log-sum-exp: on CPU one call per layer
    (:mod:`gpu_cache.kernels.cpu_decode`) folds the float ranges into the same online
    softmax; on CUDA the Triton kernel's log-sum-exp is merged with a flash pass.

    The window's float copies live in buffers that grow by doubling, so a decode
    step writes its token in place instead of concatenating the whole window.
    """

    #: Decode backend of :func:`gpu_cache.kernels.tq4_decode_attention` ("auto": the
    #: fused CPU kernel on CPU, Triton on CUDA; "torch": the chunked torch path).
    decode_backend: Backend = "auto"

    def __init__(self, cache: TQGPUCache, block_ids: Sequence[int], cached: int,
                 window_start: int | None = None, sink: int = 0) -> None:
        self.cache = cache
        self.ids = list(block_ids)
        self.cached = cached
        self.table = cache.block_table(self.ids).long()
        self.table_i32 = self.table.to(torch.int32).contiguous()
        self.native = cache.identity.codec == "native"
        self.block_size = cache.block_size
        self.fresh = True
        num_layers = cache.identity.num_layers
        self.window_start = None if self.native else window_start
        w0 = self.window_start
        # The sink stays block-aligned (the kernel reads whole blocks after it); a
        # window starting inside it already covers the rest.
        self.sink = 0 if self.native else min(sink, w0 if w0 is not None else sink)
        self.sink_k: list[torch.Tensor | None] = [None] * num_layers
        self.sink_v: list[torch.Tensor | None] = [None] * num_layers
        # Window buffers [capacity, Hkv, D]; rows [0, win_len) are the window so far.
        self.win_k: list[torch.Tensor | None] = [None] * num_layers
        self.win_v: list[torch.Tensor | None] = [None] * num_layers
        self.win_len = [0] * num_layers

    def _slots(self, start: int, n: int) -> torch.Tensor:
        return self.slots_at(torch.arange(start, start + n, device=self.table.device))

    def _centered(self, layer: int, k: torch.Tensor) -> torch.Tensor:
        """Keys as the TQ4 cache holds them (minus the layer's calibrated offset)."""
        offset = self.cache.key_offset(layer)
        return k.float() if offset is None else k.float() - offset

    def set_sink(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The sink tokens' K/V ``[sink, Hkv, D]`` (uncentered), computed apart."""
        self.sink_k[layer] = self._centered(layer, k[: self.sink]).contiguous()
        self.sink_v[layer] = v[: self.sink].float().contiguous()

    def _keep(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """Keep the float copy of the sink and window parts of tokens ``start..``."""
        if start == 0 and self.sink and self.sink_k[layer] is None and k.shape[0] >= self.sink:
            self.set_sink(layer, k, v)
        w0 = self.window_start
        if w0 is None or start + k.shape[0] <= w0:
            return
        skip = max(0, w0 - start)
        have = self.win_len[layer]
        if have != start + skip - w0:
            raise RuntimeError("residual window writes must be contiguous")
        self._append_window(layer, self._centered(layer, k[skip:]), v[skip:])

    def _append_window(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` ``[n, Hkv, D]`` after the window's rows (doubling the
        buffers when full, so a decode step copies one row, not the window)."""
        n0 = self.win_len[layer]
        n1 = n0 + k.shape[0]
        buf_k, buf_v = self.win_k[layer], self.win_v[layer]
        if buf_k is None or buf_v is None or buf_k.shape[0] < n1:
            old_cap = 0 if buf_k is None else buf_k.shape[0]
            cap = max(n1 + 64, 2 * old_cap)
            new_k = torch.empty((cap, *k.shape[1:]), dtype=torch.float32, device=k.device)
            new_v = torch.empty((cap, *v.shape[1:]), dtype=torch.float32, device=v.device)
            if n0 and buf_k is not None and buf_v is not None:
                new_k[:n0] = buf_k[:n0]
                new_v[:n0] = buf_v[:n0]
            self.win_k[layer], self.win_v[layer] = buf_k, buf_v = new_k, new_v
        buf_k[n0:n1] = k
        buf_v[n0:n1] = v
        self.win_len[layer] = n1

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        if not self.native:
            self._keep(layer, k, v, start)
        skip = max(0, self.cached - start)
        if skip >= k.shape[0]:
            return
        k, v = k[skip:], v[skip:]
        slots = self._slots(start + skip, k.shape[0])
        view = self.cache.layer_view(layer)
        if self.native:
            h, d = k.shape[1], k.shape[2]
            view.k_packed.view(-1, h, d).index_copy_(0, slots, k.float())
            view.v_packed.view(-1, h, d).index_copy_(0, slots, v.float())
            return
        codec = self.cache.codec
        if (k.shape[0] <= _FUSED_ENCODE_ROWS and k.device.type == "cpu"
                and self.decode_backend != "torch" and cpu_decode.fused_available()):
            offset = self.cache.key_offset(layer)
            cpu_decode.encode_into_cache(
                k.float().contiguous(), v.float().contiguous(), slots, view.k_packed,
                view.k_norms, view.v_packed, view.v_norms, codec.rotation, codec.boundaries,
                codec.centroids, None if offset is None else offset.float().contiguous())
            return
        quantize_into_cache(k.float(), v.float(), slots, view.k_packed, view.k_norms,
                            view.v_packed, view.v_norms, codec,
                            check_bounds=False, key_offset=self.cache.key_offset(layer))

    def _float_parts(self, layer: int, n: int) -> tuple[int, int, list[torch.Tensor],
                                                          list[torch.Tensor]]:
        """For tokens ``0..n``: the packed range ``[lo, hi)`` and the float K/V pieces
        (sink, then window) that surround it."""
        lo = min(n, self.sink)
        w0 = self.window_start
        hi = n if w0 is None or w0 >= n else max(lo, w0)
        ks: list[torch.Tensor] = []
        vs: list[torch.Tensor] = []
        if lo:
            sk, sv = self.sink_k[layer], self.sink_v[layer]
            assert sk is not None and sv is not None, "sink K/V were not computed"
            ks.append(sk[:lo])
            vs.append(sv[:lo])
        if hi < n:
            wk, wv = self.win_k[layer], self.win_v[layer]
            assert wk is not None and wv is not None and w0 is not None
            ks.append(wk[hi - w0 : n - w0])
            vs.append(wv[hi - w0 : n - w0])
        return lo, hi, ks, vs

    def _read(self, layer: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of tokens ``0..n`` as float ``[n, Hkv, D]`` (keys centered for tq4); the
        sink and residual window come from their float copies."""
        view = self.cache.layer_view(layer)
        if self.native:
            slots = self._slots(0, n)
            h, d = view.k_packed.shape[2], view.k_packed.shape[3]
            return (view.k_packed.view(-1, h, d).index_select(0, slots),
                    view.v_packed.view(-1, h, d).index_select(0, slots))
        lo, hi, ks, vs = self._float_parts(layer, n)
        if hi == lo:
            return torch.cat(ks), torch.cat(vs)
        # Decode [0, hi) and overwrite the sink rows in place: no copy of the prefix.
        slots = self._slots(0, hi)
        h = view.k_packed.shape[2]
        pd = view.k_packed.shape[3]
        codec = self.cache.codec
        k = codec.decode(TQ4Encoded(view.k_packed.view(-1, h, pd).index_select(0, slots),
                                    view.k_norms.view(-1, h).index_select(0, slots)))
        v = codec.decode(TQ4Encoded(view.v_packed.view(-1, h, pd).index_select(0, slots),
                                    view.v_norms.view(-1, h).index_select(0, slots)))
        if lo:
            k[:lo], v[:lo] = ks[0], vs[0]
            ks, vs = ks[1:], vs[1:]
        if ks:  # the window part
            k, v = torch.cat([k, *ks]), torch.cat([v, *vs])
        return k, v

    def _decode(self, layer: int, q: torch.Tensor, pos: int, scale: float) -> torch.Tensor:
        """One query at ``pos`` over the packed cache merged with the float sink and
        residual window: one fused call on CPU, the Triton kernel plus a flash pass
        merged by log-sum-exp on CUDA."""
        view = self.cache.layer_view(layer)
        lo, hi, ks, vs = self._float_parts(layer, pos + 1)
        if (q.device.type == "cpu" and self.decode_backend != "torch"
                and cpu_decode.fused_available()):
            codec = self.cache.codec
            out, _ = cpu_decode.decode_attention(
                q[0].float().contiguous(), view.k_packed, view.k_norms, view.v_packed,
                view.v_norms, self.table_i32, lo // self.block_size, hi - lo, codec.rotation,
                codec.centroids, scale, ks, vs)
            return out[None].to(q.dtype)
        if hi == lo:  # everything visible is float
            k_f, v_f = torch.cat(ks), torch.cat(vs)
            return attend_with_prefix(q, k_f[:-1], v_f[:-1], k_f[-1:], v_f[-1:], scale)
        table = self.table[lo // self.block_size :][None].to(torch.int32)
        res = tq4_decode_attention(
            q.float(), view.k_packed, view.k_norms, view.v_packed, view.v_norms, table,
            torch.tensor([hi - lo], device=self.table.device),
            self.cache.codec, scale=scale, backend=self.decode_backend, check_bounds=False,
            return_lse=bool(ks))
        if not ks:
            assert isinstance(res, torch.Tensor)
            return res.to(q.dtype)
        out_pack, lse_pack = res
        k_f = torch.cat(ks) if len(ks) > 1 else ks[0]
        v_f = torch.cat(vs) if len(vs) > 1 else vs[0]
        out_f, lse_f = flash_attention(fold_heads(q.float(), k_f.shape[1]),
                                       k_f.transpose(0, 1)[None], v_f.transpose(0, 1)[None],
                                       False, scale)
        out_f, lse_f = unfold_heads(out_f, lse_f, 1, q.shape[1])  # [1, Hq, 1, D]
        return merge_partials(out_pack, lse_pack, out_f[:, :, 0], lse_f[:, :, 0]).to(q.dtype)

    # ------------------------------------------------------------ rows anywhere
    def slots_at(self, positions: torch.Tensor) -> torch.Tensor:
        """Cache slots of sequence ``positions`` (any order, any gaps)."""
        return slots_of(self.table, positions, self.block_size)

    def rows(self, layer: int, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K/V of ``positions`` as the cache holds them: float ``[n, Hkv, D]``, keys
        centered for tq4 (the float overlay is not consulted)."""
        k, v = read_slots(self.cache, layer, self.slots_at(positions))
        assert v is not None
        return k, v

    def write_rows(self, layer: int, k: torch.Tensor, v: torch.Tensor,
                   positions: torch.Tensor) -> None:
        """Write the K/V of tokens at ``positions`` (ascending, gaps allowed; every
        position of the sink and of the residual window that this request computes
        among them): the float overlay keeps its parts, the cache gets the rest."""
        pos = positions.tolist()
        if not self.native:
            if self.sink and pos[0] == 0 and len(pos) >= self.sink \
                    and pos[self.sink - 1] == self.sink - 1:
                self._keep(layer, k[: self.sink], v[: self.sink], 0)
            w0 = self.window_start
            if w0 is not None and pos[-1] >= w0:
                j = next(i for i, p in enumerate(pos) if p >= w0)
                if pos[j] != w0 or pos[-1] - w0 != len(pos) - 1 - j:
                    raise RuntimeError("the residual window must be computed whole")
                self._keep(layer, k[j:], v[j:], w0)
        keep = positions >= self.cached
        if not bool(keep.all()):
            k, v, positions = k[keep], v[keep], positions[keep]
        if positions.numel():
            write_slots(self.cache, layer, self.slots_at(positions), k, v)

    def attend_rows(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    positions: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of tokens at ``positions`` (ascending, gaps allowed: the tokens
        between keep the K/V the cache holds) over every token up to each one. Their
        own K/V are written first and read fresh (unquantized)."""
        self.write_rows(layer, k, v, positions)
        n = int(positions[-1]) + 1
        k_all, v_all = self._read(layer, n)
        if self.native:
            k_all[positions], v_all[positions] = k, v
        else:
            k_all[positions] = self._centered(layer, k)
            v_all[positions] = v.float()
        return attend_positions(q.float(), positions, k_all, v_all, scale).to(q.dtype)

    def attend_some(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    start: int, rows: torch.Tensor, scale: float) -> torch.Tensor:
        """Write the K/V of tokens ``start..start+T`` as :meth:`attend` does (a
        prefill: their own K/V read fresh) and return the attention of the query
        ``rows`` alone (indices into the ``T``, ascending): ``[len(rows), Hq, D]``,
        what ``attend(...)[rows]`` gives without the other rows' work."""
        self._write(layer, k, v, start)
        k_new = k.float() if self.native else self._centered(layer, k)
        v_new = v.float()
        if start:
            k_pre, v_pre = self._read(layer, start)
            k_new, v_new = torch.cat([k_pre, k_new]), torch.cat([v_pre, v_new])
        positions = rows.to(q.device) + start
        return attend_positions(q[rows].float(), positions, k_new, v_new, scale).to(q.dtype)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               start: int, scale: float) -> torch.Tensor:
        n = q.shape[0]
        self._write(layer, k, v, start)
        if n == 1 and not self.native:
            return self._decode(layer, q, start, scale)
        if not self.fresh:
            k_all, v_all = self._read(layer, start + n)
            return attend_with_prefix(q, k_all[:start], v_all[:start], k_all[start:],
                                      v_all[start:], scale)
        k_pre, v_pre = self._read(layer, start) if start else (None, None)
        if not self.native:
            k = self._centered(layer, k).to(k.dtype)
        return attend_with_prefix(q, k_pre, v_pre, k, v, scale)
