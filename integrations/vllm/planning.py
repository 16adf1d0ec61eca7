"""Scheduler-side planning of the vLLM connector, free of vLLM imports (unit-testable).

The scheduler side owns the *index* of block keys the worker's store holds; the
worker side owns the bytes. They live in different processes (vLLM's CPU and
multi-GPU executors run workers apart from the scheduler), so the index is fed by
the worker's reports (:class:`WorkerReport`, sent back through vLLM's
``build_connector_worker_meta``) and seeded at start from the local store that
``contextkit recover --for-vllm`` filled. A key the worker lost meanwhile (evicted,
corrupt) surfaces as a load error, which vLLM recomputes.

Block keys are contextkit's (:func:`gpu_cache.hash_token_blocks`): a SHA-256 chain
over the cache identity, the tenant (vLLM's ``cache_salt``) and the token ids, so the
same tokens of another tenant or model never match.

The labels a request carries (contextkit's entry of ``kv_transfer_params``: the spans,
the pin flag, the prompt's fingerprint, precision keys) are defined once, in
:mod:`contextkit.pipeline.served.wire`, which the pipeline writes with and the planner
reads with; :func:`semantic_params` writes them for a client without a pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from contextkit.pipeline.served.wire import (
    PARAMS_KEY,
    TURN_LAYER,
    WireSpan,
    decode_fingerprint,
    decode_precision,
    decode_spans,
    decode_volatile_from,
    encode_labels,
    labels_entry,
    opted_into_chunks,
    prompt_fingerprint,
)
from gpu_cache import PINNABLE_SOURCES, hash_block_tokens
from integrations.vllm.chunk_planning import (
    ChunkLoad,
    ChunkPlanner,
    SpanShare,
    block_taints,
    moved_key,
    tail_key,
)
from integrations.vllm.hints import Hints, from_wire
from integrations.vllm.metrics import StatsRecorder, layer_names
from integrations.vllm.precision import (
    DEFAULT_POLICY,
    BlockLabel,
    PrecisionError,
    PrecisionPolicy,
    vs_fp16,
)
from shadow.shared.tier import FoundSpan

__all__ = [
    "DEFAULT_TENANT",
    "LoadSpec",
    "RequestPlanner",
    "SaveSpec",
    "StepRequest",
    "WorkerReport",
    "hinted_labels",
    "label_mismatch",
    "label_problem",
    "labels_from_params",
    "prompt_fingerprint",
    "semantic_params",
]

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
# The wire format (PARAMS_KEY, the spans, the fingerprint) is the pipeline's:
# contextkit.pipeline.served.wire, re-exported here for the connector's callers.


@dataclass(slots=True)
class LoadSpec:
    """Worker instruction: decode these stored blocks into these vLLM blocks."""

    req_id: str
    tenant: str
    keys: list[bytes]
    block_ids: list[int]  # vLLM block ids, one per key
    #: shared-tier chunks to bring into the DDR tier first: each chunk's block keys
    #: (its name is the last one's); the load's keys among them come from there
    shared: list[list[bytes]] = field(default_factory=list)
    first_block: int = 0  # index of the first block within the request
    #: after these blocks, the chunks to move in and the tokens to compute
    chunk: ChunkLoad | None = None


@dataclass(slots=True)
class SaveSpec:
    """Worker instruction: quantize these vLLM blocks into the store under these keys."""

    req_id: str
    tenant: str
    keys: list[bytes]
    block_ids: list[int]
    first_block: int  # index of the first block within the request
    labels: list[BlockLabel]
    #: keys of the request's blocks from the start of ``first_block``'s shared-tier
    #: chunk up to it (empty without a shared tier): the chunks this save completes
    lead_keys: list[bytes] = field(default_factory=list)
    #: ``keys`` are keys no prefix lookup computes, so they are no vLLM block's (chunk
    #: reuse): blocks holding moved K/V under their
    #: :func:`~integrations.vllm.chunk_planning.moved_key`, or a prompt's last, partial
    #: block under its :func:`~integrations.vllm.chunk_planning.tail_key`
    moved: bool = False


@dataclass(slots=True)
class WorkerReport:
    """What the worker did since its last report (aggregated over workers)."""

    stored: set[bytes] = field(default_factory=set)
    removed: set[bytes] = field(default_factory=set)
    failed: set[bytes] = field(default_factory=set)  # saves that did not make it
    loaded_tokens: dict[str, int] = field(default_factory=dict)
    load_failed_tokens: dict[str, int] = field(default_factory=dict)
    shared: set[bytes] = field(default_factory=set)  # keys now in the shared tier
    #: per request, chunk tokens moved in and not recomputed / computed by the connector
    chunk_reused_tokens: dict[str, int] = field(default_factory=dict)
    chunk_computed_tokens: dict[str, int] = field(default_factory=dict)
    #: once, after the model check: "" (chunk reuse is on) or why it is off
    chunk_status: str | None = None

    def merge(self, other: WorkerReport) -> WorkerReport:
        out = WorkerReport(self.stored | other.stored, self.removed | other.removed,
                           self.failed | other.failed, dict(self.loaded_tokens),
                           dict(self.load_failed_tokens), self.shared | other.shared,
                           {**self.chunk_reused_tokens, **other.chunk_reused_tokens},
                           {**self.chunk_computed_tokens, **other.chunk_computed_tokens},
                           other.chunk_status if other.chunk_status is not None
                           else self.chunk_status)
        # Every worker loads the same tokens (its own heads): a token counts as
        # loaded when all workers loaded it, and as failed when any worker failed.
        for req_id, n in other.loaded_tokens.items():
            out.loaded_tokens[req_id] = min(out.loaded_tokens.get(req_id, n), n)
        for req_id, n in other.load_failed_tokens.items():
            out.load_failed_tokens[req_id] = max(out.load_failed_tokens.get(req_id, n), n)
        return out

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed or self.failed or self.loaded_tokens
                    or self.load_failed_tokens or self.shared or self.chunk_reused_tokens
                    or self.chunk_computed_tokens or self.chunk_status is not None)


@dataclass(slots=True)
class StepRequest:
    """A request scheduled in this step, as the planner needs it."""

    req_id: str
    token_ids: Sequence[int]  # every known token (prompt + output so far)
    num_computed: int  # tokens whose KV exists before this step
    num_scheduled: int  # tokens whose KV this step computes
    block_ids: Sequence[int]  # the request's vLLM blocks, in order


def semantic_params(spans: Iterable[tuple[Any, ...]], *, pin: bool = False,
                    prompt_token_ids: Sequence[int] | None = None,
                    precision: Mapping[str, Any] | None = None,
                    volatile_from: int | None = None) -> dict[str, Any]:
    """``kv_transfer_params`` that label prompt token ranges with their prompt layer.

    Pass the result as ``SamplingParams(extra_args={"kv_transfer_params": ...})``
    (offline ``LLM``) or as the ``kv_transfer_params`` field of an OpenAI-API
    request. Blocks get the source layer of the span holding their first token.
    A span's optional 5th element pins its blocks in the store; spans without it
    are pinned when ``pin=True`` and their layer is pinnable (axioms, identity,
    rules, capabilities, soul).

    Args:
        spans: ``(start, end, source_layer[, importance[, pinned]])`` token ranges.
        pin: pin blocks of pinnable layers (spans without their own flag).
        prompt_token_ids: the prompt the ranges were computed on; when given, its
            fingerprint travels along and the connector ignores the labels of a
            request whose prompt differs (see :func:`label_mismatch`).
        precision: this request's precision policy keys over the server's (e.g.
            ``{"importance": [[0.9, "fp16"]]}``; each key replaces the server's
            value), see :class:`~integrations.vllm.precision.PrecisionPolicy`. It
            picks block formats only: ``key_offsets`` stays the server's (its pools).
        volatile_from: the first token of the prompt's volatile tail, which the next
            call changes (e.g. a trailing message of volatile layers); the connector
            stores the blocks from there on only while its DDR tier has room.

    Raises:
        ValueError: a bad span or ``volatile_from`` below 0;
            :class:`~integrations.vllm.precision.PrecisionError` (a ValueError): an
            unknown precision key or format.
    """
    out: list[WireSpan] = []
    for span in spans:
        start, end, layer = int(span[0]), int(span[1]), str(span[2])
        importance = float(span[3]) if len(span) > 3 else 0.5
        if not 0 <= start <= end or not 0.0 <= importance <= 1.0:
            raise ValueError(f"bad span {span!r}: need 0 <= start <= end, importance in [0, 1]")
        out.append(WireSpan(start, end, layer, importance,
                            bool(span[4]) if len(span) > 4 else None))
    keys = None
    if precision is not None:
        # checked here so the client hears of a typo; sent as plain JSON values
        checked = PrecisionPolicy.from_mapping(precision, PrecisionPolicy()).to_dict()
        keys = {key: checked[key] for key in precision}
    if volatile_from is not None and int(volatile_from) < 0:
        raise ValueError(f"volatile_from must be >= 0, got {volatile_from}")
    return encode_labels(out, pin=pin, prompt_token_ids=prompt_token_ids, precision=keys,
                         volatile_from=volatile_from)


def label_mismatch(params: Mapping[str, Any] | None, prompt_token_ids: Sequence[int]
                   ) -> str | None:
    """Why the labels in ``params`` do not belong to this prompt, or None when they do
    (or carry no fingerprint: the old form is trusted as before)."""
    ours = labels_entry(params)
    if not isinstance(ours, Mapping):
        return None
    expected_n, expected_sha = decode_fingerprint(ours)
    if expected_n is None and expected_sha is None:
        return None
    n, sha = prompt_fingerprint(prompt_token_ids)
    if expected_n is not None and expected_n != n:
        return (f"the labels were computed for {expected_n} prompt tokens, the server's "
                f"prompt has {n}")
    if expected_sha is not None and str(expected_sha).lower() != sha:
        return f"prompt_sha256 differs from the server's prompt ids ({n} tokens each)"
    return None


def label_problem(params: Mapping[str, Any] | None, prompt_token_ids: Sequence[int]
                  ) -> str | None:
    """Why the connector cannot use the labels in ``params`` for this prompt, or None.

    The labels are refused when they are malformed (not the wire format of
    :mod:`contextkit.pipeline.served.wire`, a span with ``start > end`` or an importance
    outside ``[0, 1]``), when a span runs past the end of the prompt, or when their
    fingerprint says they were computed for another prompt (:func:`label_mismatch`).
    A request without contextkit labels has no problem.
    """
    return (_malformed(labels_entry(params), len(prompt_token_ids))
            or label_mismatch(params, prompt_token_ids))


def _malformed(ours: Any, num_prompt: int) -> str | None:
    """What is wrong with the shape of contextkit's entry (None: nothing, or no entry)."""
    if ours is None:
        return None
    if not isinstance(ours, Mapping):
        return f"kv_transfer_params[{PARAMS_KEY!r}] must be an object, got {_short(ours)}"
    try:
        _, spans = decode_spans(ours)
    except (TypeError, ValueError, IndexError, AttributeError, KeyError):
        return (f"malformed spans {_short(ours.get('spans'))}: each must be [start, end, "
                "layer, importance(, pinned)]")
    for span in spans:
        if not 0 <= span.start <= span.end or not 0.0 <= span.importance <= 1.0:
            return (f"bad span {span.encode()}: need 0 <= start <= end and importance "
                    "in [0, 1]")
        if span.end > num_prompt:
            return (f"span {span.encode()} ends past the end of the prompt "
                    f"({num_prompt} tokens)")
    tail = decode_volatile_from(ours)
    if tail is not None and (isinstance(tail, bool) or not isinstance(tail, int)
                             or not 0 <= tail <= num_prompt):
        return (f"volatile_from must be a token index in [0, {num_prompt}] (the prompt's "
                f"length), got {_short(tail)}")
    return None


def _short(value: object, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def hinted_labels(labels: Sequence[BlockLabel], hints: Hints, first_block: int,
                  block_size: int) -> list[BlockLabel]:
    """``labels`` (of blocks ``first_block`` on) raised by a request's agent hints: the
    larger importance, and a pin for ``keep_s`` seconds where the block was not
    pinned for good already."""
    out = []
    for b, label in enumerate(labels, start=first_block):
        importance, keep = hints.at(b * block_size)
        if importance is not None and importance > label.importance:
            label = dataclasses.replace(label, importance=importance)
        if keep and not label.pinned:
            label = dataclasses.replace(label, pinned=True, keep_s=keep)
        out.append(label)
    return out


def labels_from_params(params: Mapping[str, Any] | None, first_block: int, num_blocks: int,
                       block_size: int, default_layer: str, *,
                       chunks: bool = False) -> list[BlockLabel]:
    """Per block, the label of the span holding its first token (see :func:`semantic_params`),
    marked ``tail`` from the block holding the request's ``volatile_from`` on.
    ``chunks``: the request opted into chunk reuse, where the conversation's messages
    after the volatile sections (the user's last message, after the trailing message)
    are repeated next call as history: the blocks holding them are not marked.

    Malformed params are logged and ignored (the request must not fail over labels).
    """
    default = BlockLabel(default_layer)
    ours = labels_entry(params)
    if not ours:
        return [default] * num_blocks
    try:
        pin, sent = decode_spans(ours)
    except (TypeError, ValueError, IndexError, AttributeError, KeyError):
        logger.warning("ignoring malformed kv_transfer_params[%r]: %r", PARAMS_KEY, ours)
        return [default] * num_blocks
    tail = decode_volatile_from(ours)
    # the block holding the tail's first token mixes in what came before, which the next
    # call's prompt does not repeat there either: it is the tail's first block
    tail_block = tail // block_size if isinstance(tail, int) else None
    kept_from = None  # chunk reuse: the first message after the tail starts here
    if chunks and isinstance(tail, int):
        kept_from = min((s.start for s in sent
                         if s.start >= tail and s.source_layer == TURN_LAYER), default=None)
    labels = []
    for b in range(first_block, first_block + num_blocks):
        pos = b * block_size
        label = default
        for span in sent:
            if span.start <= pos < span.end:
                pinned = (span.pinned if span.pinned is not None
                          else pin and span.source_layer in PINNABLE_SOURCES)
                label = BlockLabel(span.source_layer, span.importance, pinned)
                break
        if (tail_block is not None and b >= tail_block
                and (kept_from is None or pos + block_size <= kept_from)):
            label = dataclasses.replace(label, tail=True)
        labels.append(label)
    return labels


@dataclass(slots=True)
class _RequestState:
    tenant: str
    params: Mapping[str, Any] | None
    num_prompt_tokens: int
    policy: PrecisionPolicy
    keys: list[bytes] = field(default_factory=list)
    load_first_block: int = 0
    load_num_blocks: int = 0
    load_planned: bool = False
    planned_hit_tokens: int = 0
    last_num_computed: int = 0
    load_reported: bool = True
    finished: bool = False
    considered_blocks: int = 0  # blocks below this were stored, planned or skipped
    planned_saves: int = 0
    prompt_formats: list[str] | None = None  # the prompt blocks' formats, once planned
    budget_spent: float = 0.0  # fp16 shares of the blocks given a format so far
    shared_from: int = 0  # blocks [shared_from, shared_to) are in the shared tier
    shared_to: int = 0
    shared_tokens: int = 0  # of its loads' tokens, those planned from the shared tier
    vllm_hit_tokens: int = -1  # vLLM's own prefix-cache hit at the first lookup
    labels_ignored: str | None = None  # why the request's labels were not used
    hints: Hints | None = None  # the request's agent hints (integrations.vllm.hints)
    chunk: ChunkLoad | None = None  # the chunk load of its latest lookup
    chunk_planned: bool = False  # allocated: the next plan sends it
    moved: range = range(0)  # blocks holding moved K/V: saved under moved_key only
    #: the chunk load's first token and ``(position, end, hops)`` of its moved chunks
    materialized: int | None = None
    moved_tokens: list[tuple[int, int, int]] = field(default_factory=list)
    chunks_off: str | None = None  # why an opted-in request reused no chunk
    #: the prompt's last, partial block and its :func:`tail_key`, once planned for
    #: saving (chunk reuse: the spans ending in it become chunks)
    tail: tuple[int, bytes] | None = None


class RequestPlanner:
    """Scheduler-side state: the key index, per-request keys, load and save plans.

    Args:
        identity_digest: :meth:`gpu_cache.CacheIdentity.digest` of the store.
        block_size: tokens per block (vLLM's and the store's).
        default_layer: source layer of blocks without a span label.
        policy: the server's precision policy (each saved block's format);
            ``None``: :data:`~integrations.vllm.precision.DEFAULT_POLICY`. A request
            may override keys of it (``kv_transfer_params["contextkit"]["precision"]``).
        head_dim: the model's head dimension (the byte costs of the policy's budget).
        chunk_blocks: blocks per shared-tier chunk (0: no shared tier).
        chunks: chunk reuse for requests that opt in (None: prefix reuse only).

    Attributes:
        stats: the scheduler side's metrics (lookups), taken by the connector.
        chunk_status: why chunk reuse is off (None: on); the worker's model check
            sets it (:attr:`WorkerReport.chunk_status`).
    """

    def __init__(self, identity_digest: bytes, block_size: int,
                 default_layer: str = "user_turn",
                 policy: PrecisionPolicy | None = None, head_dim: int = 128,
                 chunk_blocks: int = 0, chunks: ChunkPlanner | None = None) -> None:
        self.stats = StatsRecorder(layer_names(default_layer))
        self.identity_digest = identity_digest
        self.block_size = block_size
        self.default_layer = default_layer
        self.policy = DEFAULT_POLICY if policy is None else policy
        self.head_dim = head_dim
        self.chunk_blocks = chunk_blocks
        self.index: set[bytes] = set()
        self.pending: set[bytes] = set()
        self._reqs: dict[str, _RequestState] = {}
        self._loaded: dict[str, int] = {}
        self._load_failed: dict[str, int] = {}
        self.chunks = chunks
        self.chunk_status: str | None = (
            "the worker has not reported its model check yet" if chunks is not None
            else "chunk reuse is not enabled on this server (chunk_reuse)")
        self._chunk_reused: dict[str, int] = {}
        self._chunk_computed: dict[str, int] = {}
        self._shares: list[SpanShare] = []

    # ------------------------------------------------------------------ keys
    def _keys(self, state: _RequestState, token_ids: Sequence[int], num_blocks: int
              ) -> list[bytes]:
        """Keys of the first ``num_blocks`` blocks, extending the cached chain."""
        bs = self.block_size
        while len(state.keys) < num_blocks:
            b = len(state.keys)
            parent = state.keys[-1] if state.keys else None
            state.keys.append(hash_block_tokens(self.identity_digest, state.tenant, parent,  # type: ignore[arg-type]
                                                list(token_ids[b * bs:(b + 1) * bs])))
        return state.keys[:num_blocks]

    def _state(self, req_id: str, tenant: str | None, params: Mapping[str, Any] | None,
               token_ids: Sequence[int], num_prompt_tokens: int) -> _RequestState:
        state = self._reqs.get(req_id)
        if state is None:
            raw_params = params
            # Bad labels are the client's mistake, but the request itself is fine: it is
            # served without them (the scheduler cannot answer one request with an HTTP
            # 400, and raising here would stop the engine for every request).
            prompt = token_ids[:num_prompt_tokens]
            reason, hint = _malformed(labels_entry(params), num_prompt_tokens), ""
            if reason is None:
                reason = label_mismatch(params, prompt)
                hint = "; another model, tokenizer or chat template?"
            if reason is not None:
                logger.warning("request %s: ignoring its contextkit labels (%s%s); its "
                               "blocks get the default layer %r and nothing is pinned",
                               req_id, reason, hint, self.default_layer)
                self.stats.count("label_mismatches")
                params = None
            hints, bad = from_wire(raw_params)
            if bad is not None:
                logger.warning("request %s: ignoring its agent hints (%s); it is served "
                               "without them", req_id, bad)
                self.stats.count("hints_ignored")
            state = _RequestState(tenant or DEFAULT_TENANT, params, num_prompt_tokens,
                                  self._request_policy(req_id, params),
                                  labels_ignored=reason, hints=hints)
            self._reqs[req_id] = state
        return state

    def _request_policy(self, req_id: str, params: Mapping[str, Any] | None
                        ) -> PrecisionPolicy:
        """The server's policy with the request's ``precision`` keys over it; a bad
        override is logged and ignored (a request never fails over it)."""
        ours = labels_entry(params)
        override = decode_precision(ours) if isinstance(ours, Mapping) else None
        if override is None:
            return self.policy
        try:
            return PrecisionPolicy.from_mapping(override, base=self.policy)
        except PrecisionError as exc:
            logger.warning("request %s: ignoring its precision override (%s); its blocks "
                           "get the server's policy", req_id, exc)
            return self.policy

    # ------------------------------------------------------------------ lookups
    def matched_tokens(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int,
                       num_computed: int, *, tenant: str | None = None,
                       params: Mapping[str, Any] | None = None) -> int:
        """Prompt tokens beyond ``num_computed`` the store can supply (block-aligned).

        At least one prompt token is always left to compute (vLLM needs its logits).
        Side-effect free apart from caching the request's keys.
        """
        self.stats.count("lookups")
        state = self._state(req_id, tenant, params, token_ids, num_prompt_tokens)
        state.last_num_computed = num_computed
        if state.vllm_hit_tokens < 0:
            state.vllm_hit_tokens = num_computed
        max_blocks = max(0, num_prompt_tokens - 1) // self.block_size
        matched = 0
        for key in self._keys(state, token_ids, max_blocks):
            if key not in self.index:
                break
            matched += 1
        return max(0, matched * self.block_size - num_computed)

    def lookup_keys(self, req_id: str) -> tuple[str, list[bytes]]:
        """A looked-up request's tenant and the keys of its blocks a load may cover
        (all but the block of its last prompt token)."""
        state = self._reqs[req_id]
        return state.tenant, state.keys[:max(0, state.num_prompt_tokens - 1) // self.block_size]

    def _chunk_spans(self, state: _RequestState) -> list[WireSpan] | None:
        """The request's labelled spans when it may reuse chunks; else None, with why
        not in ``state.chunks_off`` (a request that did not opt in needs no reason)."""
        if not opted_into_chunks(state.tenant):
            return None
        if self.chunks is None or self.chunk_status is not None:
            state.chunks_off = f"chunk reuse is off: {self.chunk_status}"
            return None
        ours = labels_entry(state.params)
        if not ours:
            state.chunks_off = "the request carries no contextkit spans to find chunks by"
            return None
        state.chunks_off = None
        return list(decode_spans(ours)[1])

    def chunk_misses(self, req_id: str, token_ids: Sequence[int], prefix_end: int
                     ) -> list[bytes]:
        """The content keys of a looked-up request's spans past ``prefix_end`` that
        chunk reuse would use but the local chunk index lacks (the shared tier is asked
        for them)."""
        state = self._reqs[req_id]
        spans = self._chunk_spans(state)
        if spans is None or self.chunks is None:
            return []
        return self.chunks.misses(state.tenant, token_ids, state.num_prompt_tokens, spans,
                                  prefix_end, self.index.__contains__)

    def chunk_tokens(self, req_id: str, token_ids: Sequence[int], prefix_end: int,
                     found: Mapping[bytes, FoundSpan] | None = None) -> int:
        """Tokens past ``prefix_end`` (the prefix hit, block-aligned) that chunk reuse
        materializes for a looked-up request (0: none; see
        :meth:`ChunkPlanner.plan <integrations.vllm.chunk_planning.ChunkPlanner.plan>`).
        Only requests whose tenant (``cache_salt``) opted in are considered.
        ``found``: span objects the shared tier holds (:meth:`chunk_misses`)."""
        state = self._reqs[req_id]
        state.chunk = None
        spans = self._chunk_spans(state)
        if spans is None or self.chunks is None:
            return 0
        state.chunk = self.chunks.plan(
            req_id, state.tenant, token_ids, state.num_prompt_tokens, spans, prefix_end,
            held=self.index.__contains__, found=found,
            prefix_keys=self._keys(state, token_ids, prefix_end // self.block_size))
        if state.chunk is None:
            return 0
        return state.chunk.end - prefix_end

    def note_shared(self, req_id: str, first: int, end: int) -> None:
        """The shared tier holds blocks ``first .. end-1`` of the request, past what the
        DDR tier holds: the next load brings them in (:attr:`LoadSpec.shared`)."""
        state = self._reqs[req_id]
        state.shared_from, state.shared_to = first, end

    def on_alloc(self, req_id: str, num_external: int) -> None:
        """vLLM allocated blocks; ``num_external`` tokens after its local hit are ours."""
        state = self._reqs.get(req_id)
        if state is None or num_external <= 0:
            return
        bs = self.block_size
        state.load_first_block = state.last_num_computed // bs
        state.load_num_blocks = num_external // bs
        chunk, state.chunk = state.chunk, None
        if chunk is not None and state.last_num_computed + num_external == chunk.end:
            # blocks up to the chunk range are loaded; the range is materialized
            state.load_num_blocks = (chunk.start - state.last_num_computed) // bs
            state.chunk, state.chunk_planned = chunk, True
            state.moved = range(chunk.start // bs, chunk.end // bs)
            state.materialized, state.moved_tokens = chunk.start, chunk.token_taints()
            if chunk.found and self.chunks is not None:
                self.chunks.adopt(chunk)
                self.stats.count("shared_span_hits", len(chunk.found))
        state.load_planned = True
        state.load_reported = False
        state.planned_hit_tokens += num_external

    # ------------------------------------------------------------------ plans
    def plan(self, step: Iterable[StepRequest]) -> tuple[list[LoadSpec], list[SaveSpec]]:
        """Loads and saves for one scheduler step."""
        loads: list[LoadSpec] = []
        saves: list[SaveSpec] = []
        bs = self.block_size
        for req in step:
            state = self._reqs.get(req.req_id)
            if state is None:
                continue
            if state.load_planned:
                state.load_planned = False
                first, n = state.load_first_block, state.load_num_blocks
                keys = self._keys(state, req.token_ids, first + n)[first:]
                chunk = None
                if state.chunk_planned and state.chunk is not None:
                    state.chunk_planned = False
                    chunk = state.chunk
                    chunk.block_ids = list(req.block_ids[:chunk.end // bs])
                loads.append(LoadSpec(req.req_id, state.tenant, list(keys),
                                      list(req.block_ids[first:first + n]),
                                      self._shared_chunks(state, first, first + n), first,
                                      chunk))
                if loads[-1].shared:  # brought in from the shared tier: not saved again
                    state.considered_blocks = max(state.considered_blocks, first + n)
            full = min(req.num_computed + req.num_scheduled, len(req.token_ids)) // bs
            full = min(full, len(req.block_ids))
            keys = self._save_keys(state, self._keys(state, req.token_ids, full))
            todo = [b for b in range(state.considered_blocks, full)
                    if keys[b] not in self.index and keys[b] not in self.pending]
            state.considered_blocks = max(state.considered_blocks, full)
            state.planned_saves += len(todo)
            tail = self._tail(state, req)
            if tail is not None:
                saves.append(self._save_spec(state, req, [tail[0]], [tail[1]], [], moved=True))
            if not todo:
                continue
            # one spec per contiguous run keeps the labels' positions right
            runs: list[list[int]] = [[todo[0]]]
            for b in todo[1:]:
                if b == runs[-1][-1] + 1 and (b in state.moved) == (b - 1 in state.moved):
                    runs[-1].append(b)
                else:
                    runs.append([b])
            for run in runs:
                lead = (keys[run[0] - run[0] % self.chunk_blocks:run[0]]
                        if self.chunk_blocks else [])
                saves.append(self._save_spec(state, req, run, [keys[b] for b in run], lead,
                                             moved=run[0] in state.moved))
        return loads, saves

    def _save_spec(self, state: _RequestState, req: StepRequest, run: list[int],
                   run_keys: list[bytes], lead: list[bytes], *, moved: bool) -> SaveSpec:
        """The save of the request's blocks ``run`` (contiguous) under ``run_keys``: each
        with its label, format and hints."""
        self.pending.update(run_keys)
        bs = self.block_size
        labels = labels_from_params(state.params, run[0], len(run), bs, self.default_layer,
                                    chunks=self._opted_in(state))
        fmts = [self._format(state, b, label) for b, label in zip(run, labels, strict=True)]
        labels = [dataclasses.replace(label, fmt=fmt, room_fmt=state.policy.room_for(fmt))
                  for label, fmt in zip(labels, fmts, strict=True)]
        if state.hints is not None:
            labels = hinted_labels(labels, state.hints, run[0], bs)
        return SaveSpec(req.req_id, state.tenant, run_keys, [req.block_ids[b] for b in run],
                        run[0], labels, list(lead), moved=moved)

    def _opted_in(self, state: _RequestState) -> bool:
        """Whether the request reuses chunks: it opted in, and the server has chunk reuse."""
        return self.chunks is not None and opted_into_chunks(state.tenant)

    def _tail(self, state: _RequestState, req: StepRequest) -> tuple[int, bytes] | None:
        """The prompt's last, partial block and its :func:`tail_key`, to save in the step
        that computes the prompt's last token, where the request opted into chunk reuse:
        its last message ends there (the template's generation prompt follows it), and
        next turn repeats it. None when there is none to save (held already: noted)."""
        bs, n = self.block_size, state.num_prompt_tokens
        b = n // bs
        if (state.tail is not None or n % bs == 0 or not self._opted_in(state)
                or b >= len(req.block_ids)
                or req.num_computed + req.num_scheduled < n):
            return None
        parent = self._keys(state, req.token_ids, b)[-1] if b else None
        key = tail_key(hash_block_tokens(self.identity_digest, state.tenant, parent,  # type: ignore[arg-type]
                                         list(req.token_ids[b * bs:n])))
        state.tail = (b, key)
        if key in self.index or key in self.pending:
            return None
        state.planned_saves += 1
        return state.tail

    @staticmethod
    def _save_keys(state: _RequestState, keys: list[bytes]) -> list[bytes]:
        """The keys the request's blocks are stored under: blocks holding moved K/V
        under their :func:`moved_key` (chunk sources for later requests, never a
        prefix hit)."""
        if not state.moved:
            return keys
        return [moved_key(k) if b in state.moved else k for b, k in enumerate(keys)]

    def _shared_chunks(self, state: _RequestState, first: int, end: int) -> list[list[bytes]]:
        """The shared-tier chunks covering blocks ``first .. end-1`` that
        :meth:`note_shared` found (each chunk's keys); the note is used up."""
        lo, hi = max(first, state.shared_from), min(end, state.shared_to)
        state.shared_from = state.shared_to = 0
        if hi <= lo or not self.chunk_blocks:
            return []
        state.shared_tokens += (hi - lo) * self.block_size
        self.stats.count("shared_hit_tokens", (hi - lo) * self.block_size)
        c = self.chunk_blocks
        return [state.keys[j * c:(j + 1) * c] for j in range(lo // c, -(-hi // c))]

    def _format(self, state: _RequestState, block: int, label: BlockLabel) -> str:
        """Block ``block``'s format: the prompt's blocks are decided together (the
        policy's byte budget spans the prompt); later (generated) blocks one by one,
        raised only while the request's blocks stay within the budget."""
        policy = state.policy
        n = state.num_prompt_tokens // self.block_size
        if state.prompt_formats is None:
            labels = labels_from_params(state.params, 0, n, self.block_size,
                                        self.default_layer, chunks=self._opted_in(state))
            state.prompt_formats = policy.formats_for(labels, self.head_dim)
            state.budget_spent = sum(vs_fp16(f, self.head_dim) for f in state.prompt_formats)
        if block < n:
            return state.prompt_formats[block]
        fmt = policy.format_for(block, label)
        if policy.max_vs_fp16 is not None and fmt != policy.default:
            # a generated block is raised only while the request stays within budget
            cost = vs_fp16(fmt, self.head_dim)
            if (cost > vs_fp16(policy.default, self.head_dim)
                    and state.budget_spent + cost > policy.max_vs_fp16 * (block + 1)):
                fmt = policy.default
        state.budget_spent += vs_fp16(fmt, self.head_dim)
        return fmt

    # ------------------------------------------------------------------ feedback
    def apply(self, report: WorkerReport) -> list[dict[str, Any]]:
        """Fold a worker report into the index.

        Returns:
            Stats of finished requests whose load report this was (see :meth:`finish`).
        """
        self.index |= report.stored
        self.index -= report.removed
        self.pending -= report.stored | report.failed | report.removed
        if report.chunk_status is not None and self.chunks is not None:
            self.chunk_status = report.chunk_status or None
        done = []
        for req_id in (set(report.loaded_tokens) | set(report.load_failed_tokens)
                       | set(report.chunk_reused_tokens)):
            self._loaded[req_id] = (self._loaded.get(req_id, 0)
                                    + report.loaded_tokens.get(req_id, 0))
            self._load_failed[req_id] = (self._load_failed.get(req_id, 0)
                                         + report.load_failed_tokens.get(req_id, 0))
            for mine, theirs, stat in (
                    (self._chunk_reused, report.chunk_reused_tokens, "chunk_reused_tokens"),
                    (self._chunk_computed, report.chunk_computed_tokens,
                     "chunk_computed_tokens")):
                if req_id in theirs:
                    mine[req_id] = mine.get(req_id, 0) + theirs[req_id]
                    self.stats.count(stat, theirs[req_id])
            state = self._reqs.get(req_id)
            if state is not None:
                state.load_reported = True
                if state.finished:
                    done.append(self._close(req_id))
        return done

    def seed(self, keys: Iterable[bytes]) -> int:
        """Add keys the worker will hold at start (the recovered local store)."""
        before = len(self.index)
        self.index.update(keys)
        return len(self.index) - before

    def session(self, req_id: str) -> tuple[str, str | None]:
        """A looked-up request's tenant and its session (from its hints), if any."""
        state = self._reqs.get(req_id)
        if state is None:
            return DEFAULT_TENANT, None
        return state.tenant, state.hints.session if state.hints is not None else None

    def held_keys(self, req_id: str) -> list[bytes]:
        """The keys of the request's blocks it stored or planned to (a prefix chain)."""
        state = self._reqs.get(req_id)
        return list(state.keys[:state.considered_blocks]) if state is not None else []

    def report(self, req_id: str) -> dict[str, Any] | None:
        """What a request's prompt reused, for its response (``kv_transfer_params``):
        its reuse class (``prefix``: some tokens came from vLLM's cache or contextkit's;
        ``recomputed``: tokens promised from contextkit's cache failed to load and were
        computed; ``none``), its prompt tokens by where they came from, and why
        contextkit fell back, if it did. ``complete`` is False for a request that ended
        before its load was reported (its loaded tokens are then not known yet)."""
        state = self._reqs.get(req_id)
        if state is None:
            return None
        # a request that finished in the step of its load is reported as planned
        # (``complete`` False): the worker's report of that step comes after it
        planned = not state.load_reported
        chunk = state.chunk if planned and not state.chunk_planned else None
        loaded = self._loaded.get(req_id, state.load_num_blocks * self.block_size
                                  if planned else 0)
        failed = self._load_failed.get(req_id, 0)
        reused = self._chunk_reused.get(req_id, chunk.reused_tokens if chunk else 0)
        repaired = self._chunk_computed.get(req_id, chunk.computed_tokens if chunk else 0)
        cached = max(0, state.vllm_hit_tokens)
        fallback = []
        if state.labels_ignored is not None:
            fallback.append(f"labels ignored: {state.labels_ignored}")
        if failed:
            fallback.append(f"{failed} tokens failed to load and were computed")
        if state.chunks_off is not None:
            fallback.append(state.chunks_off)
        reuse = ("recomputed" if failed else "chunk" if reused
                 else ("prefix" if cached + loaded else "none"))
        return {"reuse": reuse, "prompt_tokens": state.num_prompt_tokens,
                "vllm_cached_tokens": cached, "contextkit_loaded_tokens": loaded,
                "shared_tier_tokens": min(state.shared_tokens, loaded),
                "chunk_reused_tokens": reused,
                "repaired_tokens": repaired,
                "computed_tokens": max(0, state.num_prompt_tokens - cached - loaded - reused),
                "fallback": "; ".join(fallback) or None,
                "complete": state.load_reported}

    def finish(self, req_id: str, token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
        """A request finished (``token_ids``: its tokens, whose labelled spans become
        chunks where it opted into chunk reuse). Returns its stats now, or from the
        :meth:`apply` call that brings its load report (vLLM frees a request that
        finishes in the step of its load before it hands over that step's worker
        report)."""
        state = self._reqs.get(req_id)
        if state is None:
            return []
        state.finished = True
        if self.chunks is not None and token_ids and opted_into_chunks(state.tenant):
            self._register_chunks(state, token_ids)
        return [self._close(req_id)] if state.load_reported else []

    def _register_chunks(self, state: _RequestState, token_ids: Sequence[int]) -> None:
        """The request's spans into the chunk index; the blocks holding moved K/V
        marked with their hops first (the spans in them inherit them)."""
        assert self.chunks is not None
        keys = self._save_keys(state, state.keys[:state.considered_blocks])
        for first, end, hops in block_taints(state.moved_tokens, self.block_size):
            self.chunks.taint(keys[first:end], hops)
        ours = labels_entry(state.params)
        if not ours:
            return
        _, spans = decode_spans(ours)
        stored_tokens = None
        if state.tail is not None and state.tail[0] == len(keys):  # the partial block
            keys, stored_tokens = [*keys, state.tail[1]], state.num_prompt_tokens
        shares = self.chunks.register(state.tenant, token_ids, spans, keys, len(keys),
                                      lambda k: k in self.index or k in self.pending,
                                      materialized=state.materialized,
                                      moved=state.moved_tokens, stored_tokens=stored_tokens)
        if self.chunk_blocks:  # a shared tier: the worker publishes them
            self._shares += shares

    def take_shares(self) -> list[SpanShare]:
        """The spans registered since the last call, for the shared tier."""
        shares, self._shares = self._shares, []
        return shares

    def _close(self, req_id: str) -> dict[str, Any]:
        state = self._reqs.pop(req_id)
        reused = self._chunk_reused.pop(req_id, 0)
        return {
            "chunk_reused_tokens": reused,
            "chunk_computed_tokens": self._chunk_computed.pop(req_id, 0),
            "request_id": req_id,
            "tenant": state.tenant,
            "prompt_tokens": state.num_prompt_tokens,
            "planned_hit_tokens": state.planned_hit_tokens,
            "external_hit_tokens": self._loaded.pop(req_id, 0),
            "load_failed_tokens": self._load_failed.pop(req_id, 0),
            "planned_save_blocks": state.planned_saves,
            "shared_hit_tokens": state.shared_tokens,
        }
