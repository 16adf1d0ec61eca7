"""CacheAwareContextPipeline: wrap ``build_system_message`` and steer the KV cache.

Usage::

    engine = Engine.from_pretrained()
    pipeline = CacheAwareContextPipeline(engine)

    @pipeline.wrap                      # or @cache_aware(pipeline)
    def build_system_message(state):
        return "[AXIOMS]\\n...\\n[/AXIOMS]\\n[IDENTITY]\\n...\\n[/IDENTITY]\\n..."

    system_text = build_system_message(state)       # budgets applied, cache-friendly order
    result = pipeline.generate("What changed?", history=[("user", ...), ("assistant", ...)])
    result.report                                   # reuse, broken-by layer, blocks per tier

With no engine attached (a cloud API, Ollama) the wrapper returns exactly what the
function returns and every cache method returns an empty result: contextkit is
purely additive.

Attached to a vLLM server instead (``CacheAwareContextPipeline(served=ServedModel(
model_dir))``, see :mod:`contextkit.pipeline.served.model`), it builds prompts exactly as with an
engine; :meth:`~CacheAwareContextPipeline.openai_messages` lays a chat request out as
the engine would, :meth:`~CacheAwareContextPipeline.request_fields` labels its token
ranges (layer, importance, pin) and tenant for contextkit's vLLM connector, and
:meth:`~CacheAwareContextPipeline.record_usage` puts the server's usage into the report.
There is no local cache then: the connector registers and pins the blocks.

What it does with an engine (or a served model) attached:

- applies the *expanded* layer budgets with :func:`synthesize_for_budget` (spilled
  lines go to :attr:`spillover`, which feeds the tier manager);
- hashes the stable prefix (the layers through ``[/CAPABILITIES]``) with SHA-256;
- orders layers by how often they changed (learned per tenant, seeded by each
  layer's ``volatile`` flag): layers that change on most calls go last, into a
  trailing system message after the conversation, so they invalidate nothing but
  themselves;
- tokenizes segment by segment, labels every token range with its layer and
  importance, and lets the engine register each block with that metadata;
- pins the stable prefix's blocks within the tenant's pin quota, held per agent
  (releasing this agent's superseded pins and the tenant's pins no live agent holds;
  see :mod:`contextkit.pipeline.pins` and :mod:`gpu_cache.pinning`), and reports per call what
  was reused, what was computed, which layer broke the prefix, whether the prefix is
  pinned, and the tenant's blocks per tier.

Tenants
-------
A tenant owns blocks: no other tenant can see, reuse or evict into them. Which tenant
a call or read means, by one rule for every method that takes ``tenant=``, is told in
:mod:`contextkit.pipeline.tenancy`.

Agents
------
Many agents may share one engine (and one :class:`~contextkit.loop.tiers.ContextTierManager`):
one pipeline per agent, ``CacheAwareContextPipeline(engine, tenant=org, agent=name,
tiers=manager)``. Agents of one tenant share their organisation's cached blocks; pins
are held per agent: a block stays pinned while the latest stable prefix of any live
agent of its tenant holds it, and an agent's call releases only pins no live agent
holds (its own superseded prefix among them; the exact rule is in
:mod:`contextkit.pipeline.pins`). With ``tiers=``, every call registers its blocks with the
manager as per-layer segments of that agent (:mod:`contextkit.pipeline.registration`).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from contextkit.engine.engine import Engine, TokenSpan
from contextkit.engine.inputs import check_max_new_tokens, check_text
from contextkit.metrics import ContextkitMetrics
from contextkit.pipeline.building import PromptBuilder, assemble_turn
from contextkit.pipeline.pins import check_pin_quota, pin_stable
from contextkit.pipeline.registration import register_call
from contextkit.pipeline.reports import (
    BuiltPrompt,
    CallReport,
    LazyMetrics,
    PipelineResult,
    TurnPlan,
    fill_report,
)
from contextkit.pipeline.served.model import ServedModel
from contextkit.pipeline.served.requests import ServedRequests
from contextkit.pipeline.tenancy import DEFAULT_MAX_TENANTS, TenantViews, check_tenant
from contextkit.prompt.chatml import ChatML
from contextkit.prompt.layers import LayerConfig, LayerSpec
from contextkit.prompt.markup import SpilloverQueue
from contextkit.prompt.ordering import (
    VOLATILE_THRESHOLD as VOLATILE_THRESHOLD,  # re-exported: its import path
)
from gpu_cache import PrefixPinManager, validate_name
from gpu_cache.metadata import BlockMeta

if TYPE_CHECKING:
    from contextkit.engine.sampling import SamplingParams
    from contextkit.pipeline.hooks import TurnHooks
    from contextkit.pipeline.registration import SegmentRegistry

__all__ = [
    "BuiltPrompt",
    "CacheAwareContextPipeline",
    "CallReport",
    "PipelineResult",
    "TurnPlan",
    "cache_aware",
]

F = TypeVar("F", bound=Callable[..., Any])

logger = logging.getLogger(__name__)


class CacheAwareContextPipeline:
    """Layered prompts in, cache-aware prompts and cache control out.

    Args:
        engine: the engine whose cache to steer; ``None`` for pass-through mode.
        served: instead of an engine, the model a vLLM server serves (its tokenizer
            and chat template): budgets, ordering and reports as with an engine, and
            the request fields for the server (:meth:`request_fields`).
        layers: layer names and budgets (default: the ten SPEC layers plus partner).
        tenant: default tenant; blocks of one tenant are never visible to another.
        reorder: volatility-aware ordering (on by default).
        trailing_message: emit volatile layers as a system message after the
            conversation (``generate``); off: they end the main system message.
        pin_stable: pin the stable prefix's blocks in the device tier; a prefix over
            the tenant's pin quota is served unpinned (a warning, ``pin_reason``), or
            refused before any work with ``"strict"``.
        reuse_chunks: on a served model, opt this pipeline's requests into chunk reuse
            (the vLLM connector's ``chunk_reuse``: sections after a changed one are
            moved in from where they were computed, their seams recomputed; an
            approximation of a full prefill, see docs/chunks.md "On vLLM"). Their
            ``cache_salt`` then carries contextkit's chunk suffix, a cache namespace of
            its own.
        volatility_alpha: weight of the newest observation in each layer's change rate.
        spillover: where over-budget lines go (a new queue by default).
        tiers: a tier manager to register every call's blocks with (see
            :mod:`contextkit.pipeline.registration`); ``CallReport.tier_items`` counts the items
            each call touched.
        agent: this pipeline's agent name (default: the tenant of each call). One
            pipeline per agent over one shared engine (and tier manager) is the
            multi-agent setup: pins are held per agent (see :mod:`contextkit.pipeline.pins`).
        reservations: memory neighborhoods prefilled in the background between turns
            (:class:`contextkit.loop.reservations.MemoryReservations`, or any
            :class:`~contextkit.pipeline.hooks.TurnHooks`): :meth:`generate` calls its
            ``before_turn`` before the engine runs (a hit is
            ``CallReport.reservation_hit``) and its ``after_reply`` after.
        max_tenants: tenants whose state is kept; past it the least recently built for
            is released (see :mod:`contextkit.pipeline.tenancy`).

    The tenant views, the served-model requests and the prompt building are parts the
    pipeline owns (:mod:`~contextkit.pipeline.tenancy`,
    :mod:`~contextkit.pipeline.served.requests`, :mod:`~contextkit.pipeline.building`);
    its methods delegate to them.
    """

    def __init__(
        self,
        engine: Engine | None = None,
        *,
        served: ServedModel | None = None,
        layers: LayerConfig | None = None,
        tenant: str = "default",
        reorder: bool = True,
        trailing_message: bool = True,
        pin_stable: bool | Literal["strict"] = True,
        reuse_chunks: bool = False,
        volatility_alpha: float = 0.3,
        spillover: SpilloverQueue | None = None,
        metrics: ContextkitMetrics | bool | None = None,
        tiers: SegmentRegistry | None = None,
        agent: str | None = None,
        reservations: TurnHooks | None = None,
        max_tenants: int = DEFAULT_MAX_TENANTS,
    ) -> None:
        if engine is not None and served is not None:
            raise ValueError("pass either engine= (the embedded engine) or served= (a vLLM "
                             "server's model), not both: a pipeline steers one cache")
        if served is not None and not isinstance(served, ServedModel):
            raise ValueError(f"served must be a contextkit.pipeline.served.model.ServedModel, got "
                             f"{type(served).__name__}")
        if not 0.0 < volatility_alpha <= 1.0:
            raise ValueError(f"volatility_alpha must be in (0, 1], got {volatility_alpha}")
        if pin_stable not in (True, False, "strict"):
            raise ValueError(f"pin_stable must be True, False or 'strict', got {pin_stable!r}")
        self.engine = engine
        self.served = served
        self.config = layers or LayerConfig()
        tenant = check_tenant(tenant)
        self.agent = validate_name(agent, "agent") if agent is not None else None
        self.tiers = tiers
        self.reservations = reservations
        self.reorder = reorder
        self.trailing_message = trailing_message
        self.pin_stable = pin_stable
        self.reuse_chunks = bool(reuse_chunks)
        self.alpha = volatility_alpha
        self.spillover = spillover if spillover is not None else SpilloverQueue()
        self._lock = threading.RLock()
        self._metrics = LazyMetrics(metrics)
        self._pins: PrefixPinManager | None = None
        if engine is not None:
            ChatML.check(engine.tokenizer)
            self._pins = PrefixPinManager(engine.cache)
        self._tenants = TenantViews(self.config, tenant, self._lock, attached=self.attached,
                                    cache=engine.cache if engine is not None else None,
                                    pins=self._pins, max_tenants=max_tenants)
        source = engine if engine is not None else served
        self._encode = source.encode if source is not None else None
        self._builder = PromptBuilder(
            self.config, self._encode, self._tenants, self.spillover, expanded=self.attached,
            reorder=reorder, trailing_message=trailing_message, alpha=volatility_alpha,
            metrics=self._metrics.get)
        self._served = ServedRequests(served, self.config, self._tenants, self._metrics.get)

    @classmethod
    def from_config(cls, engine: Engine | dict[str, Any] | None = None, config: Any = None,
                    *, served: ServedModel | None = None, layers: LayerConfig | None = None,
                    spillover: SpilloverQueue | None = None,
                    tiers: SegmentRegistry | None = None, agent: str | None = None,
                    **overrides: Any) -> CacheAwareContextPipeline:
        """A pipeline set up by a configuration's ``pipeline`` section (default tenant,
        ordering, trailing message, pinning, volatility) and ``metrics.enabled``.

        Args:
            engine: the engine to steer; ``None`` builds one from the same configuration
                (:meth:`Engine.from_config`); a ``dict`` is the ``engine`` section's
                overrides for that. (Pass-through mode, no engine: the constructor.)
            served: a vLLM server's model to attach instead of an engine (none is built).
            config: a :class:`contextkit.config.Config`, a TOML/YAML file, or ``None``:
                :func:`contextkit.config.load_config`.
            layers: as for the constructor.
            spillover: as for the constructor.
            tiers: as for the constructor.
            agent: as for the constructor.
            **overrides: section tables set in code, which win over every other source,
                e.g. ``pipeline={"tenant": "acme"}, cache={"num_device_blocks": 256}``.

        Raises:
            ConfigError: an unknown section or key, or a bad value (one line).
        """
        from contextkit.config import resolve_config

        if isinstance(engine, dict):
            overrides["engine"], engine = engine, None
        cfg = resolve_config(config, overrides)
        if engine is None and served is None:
            engine = Engine.from_config(cfg)
        s = cfg.pipeline
        return cls(engine, served=served, layers=layers, spillover=spillover, tenant=s.tenant,
                   reorder=s.reorder, trailing_message=s.trailing_message,
                   pin_stable=s.pin_stable, volatility_alpha=s.volatility_alpha,
                   metrics=None if cfg.metrics.enabled else False, tiers=tiers, agent=agent,
                   max_tenants=s.max_tenants)

    # ------------------------------------------------------------------ wrapping
    @property
    def attached(self) -> bool:
        """Whether a cache is attached: an engine, or a served model (vLLM's)."""
        return self.engine is not None or self.served is not None

    def wrap(self, fn: F) -> F:
        """Wrap a ``build_system_message`` function (also usable as a decorator).

        Attached: the wrapper returns the prompt after budgets and ordering as
        ``[LAYER]`` text and records it for :meth:`generate`. Not attached: it
        returns exactly what ``fn`` returns.
        """

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            raw = fn(*args, **kwargs)
            if not self.attached:
                return raw
            return self.build(raw).text

        wrapper.__wrapped_pipeline__ = self  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    # ------------------------------------------------------------------ building
    def budget(self, spec: LayerSpec) -> int:
        """A layer's budget: expanded when a cache is attached."""
        return spec.budget_for(self.attached)

    def build(self, raw: object, *, tenant: str | None = None) -> BuiltPrompt:
        """Apply budgets and ordering to what ``build_system_message`` returned.

        Raises:
            PromptFormatError: unknown or unbalanced layer markers, or an unsupported
                return type (nothing is recorded).
        """
        return self._builder.build(raw, self.resolve_tenant(tenant), commit=True)

    def preview(self, raw: object, *, tenant: str | None = None,
                changed: Sequence[str] | None = None) -> BuiltPrompt:
        """What :meth:`build` of ``raw`` would return now, without its side effects: the
        same budgets, order and tokens, but the learned volatility, the last built
        prompt, the metrics and the spillover queue are left as they are.

        ``changed`` names the layers to count as changed for the ordering (default: those
        whose text differs from the last build, as :meth:`build` counts them).

        Raises:
            PromptFormatError: as for :meth:`build`.
        """
        return self._builder.build(raw, self.resolve_tenant(tenant), commit=False,
                                   changed=changed)

    @property
    def metrics(self) -> ContextkitMetrics | None:
        """Where this pipeline's figures are recorded (``metrics=`` at construction;
        default: :func:`contextkit.metrics.default_metrics`); ``None``: nowhere."""
        return self._metrics.get()

    # ------------------------------------------------------------------ assembling
    def assemble(
        self,
        user_message: str | None,
        history: Sequence[tuple[str, str]] = (),
        *,
        tenant: str | None = None,
        built: BuiltPrompt | None = None,
        user_order: bool = False,
        after: Sequence[tuple[str, str]] = (),
    ) -> tuple[list[int], list[TokenSpan], int]:
        """Token ids of a chat turn, the layer spans, and where the stable prefix ends.

        Layout: the main system message, the ``history`` turns, the trailing system
        message (volatile layers), then ``user_message``, the ``after`` turns (an
        agent's tool rounds within the current turn) and the assistant header.
        ``user_order=True`` lays the same layers out in the user's original order in
        one system message (what an order-blind prefix cache would see). Empty
        without an engine (a served model's prompt is :meth:`openai_messages`, its
        ranges :meth:`request_fields`).

        Raises:
            RuntimeError: no prompt built yet (call the wrapped function first).
        """
        if self.engine is None or self._encode is None:
            return [], [], 0
        tenant = self.resolve_tenant(tenant)
        if built is None:
            built = self._tenants.last(tenant)
        if built is None:
            raise RuntimeError("no system prompt built for tenant "
                               f"{tenant!r} yet; call the wrapped build_system_message first")
        return assemble_turn(built, self.config, self._encode, user_message, history,
                             user_order=user_order, after=after)

    # ------------------------------------------------------------------ generation
    def plan_turn(self, user_message: str | None = None, *,
                  history: Sequence[tuple[str, str]] = (), max_new_tokens: int = 32,
                  tenant: str | None = None, built: BuiltPrompt | None = None) -> TurnPlan:
        """What :meth:`generate` with these arguments would reuse and allocate, without
        running it: the input of :meth:`ContextTierManager.prefetch
        <contextkit.loop.tiers.ContextTierManager.prefetch>` before the agent's turn.

        Raises:
            RuntimeError: no engine attached, or nothing built yet.
        """
        if self.engine is None:
            raise RuntimeError("plan_turn needs the embedded engine: build the pipeline "
                               "with CacheAwareContextPipeline(engine)")
        tenant = check_tenant(tenant if tenant is not None else self.resolve_tenant())
        ids, _, _ = self.assemble(user_message, history, tenant=tenant, built=built)
        cache = self.engine.cache
        hits = cache.lookup(cache.block_keys(ids, tenant), tenant)
        total = -(-(len(ids) + max_new_tokens) // cache.block_size)
        agent = self.agent if self.agent is not None else tenant
        return TurnPlan(agent, tenant, len(ids), tuple(hits), max(0, total - len(hits)))

    def generate(
        self,
        user_message: str | None = None,
        *,
        history: Sequence[tuple[str, str]] = (),
        max_new_tokens: int = 32,
        tenant: str | None = None,
        built: BuiltPrompt | None = None,
        after: Sequence[tuple[str, str]] = (),
        on_token: Callable[[int], bool | None] | None = None,
        sampling: SamplingParams | None = None,
    ) -> PipelineResult:
        """Run one chat turn on the engine with the last built system prompt.

        ``built`` picks a specific :meth:`build` result (default: the tenant's last);
        ``after`` goes to :meth:`assemble`, ``on_token`` and ``sampling`` (default
        greedy) to :meth:`Engine.generate <contextkit.engine.engine.Engine.generate>`.

        Raises:
            RuntimeError: no engine attached, or nothing built yet.
            CacheFullError: the prompt does not fit the device tier (nothing lost).
            PinCapacityError: ``pin_stable="strict"`` and the tenant's stable prefix is
                longer than its pin quota (nothing computed; otherwise it is served
                unpinned, ``CallReport.pin_reason`` says why).
        """
        if self.engine is None:
            if self.served is not None:
                raise RuntimeError("this pipeline is attached to a served model: send "
                                   "openai_messages() with request_fields() through your "
                                   "OpenAI client, then record_usage() the reply's usage")
            raise RuntimeError("no engine attached: this pipeline only passes prompts "
                               "through; build it with CacheAwareContextPipeline(engine)")
        if user_message is not None:
            check_text(user_message, "user_message")
        check_max_new_tokens(max_new_tokens)
        if tenant is None:
            tenant = built.report.tenant if built is not None else self.resolve_tenant()
        tenant = check_tenant(tenant)
        if built is not None and built.report.tenant != tenant:
            raise ValueError(f"this prompt was built for tenant {built.report.tenant!r}, not "
                             f"{tenant!r}; tenants never share blocks")
        agent = self.agent if self.agent is not None else tenant
        if built is None:
            built = self._tenants.last(tenant)
        ahead = self.reservations
        # Outside the pipeline's lock: it stops background work that may wait on it.
        hit = ahead.before_turn(built, tenant=tenant) if ahead and built else None
        with self._lock:
            ids, spans, stable_end = self.assemble(user_message, history, tenant=tenant,
                                                   built=built, after=after)
            assert built is not None and self._pins is not None
            over = check_pin_quota(self._pins, tenant, spans, stable_end,
                                   strict=self.pin_stable == "strict") if self.pin_stable else None
            result = self.engine.generate(ids, max_new_tokens=max_new_tokens, tenant=tenant,
                                          spans=spans, on_token=on_token, sampling=sampling)
            report = built.report
            report.pin_state, report.pin_reason = pin_stable(
                self._pins, weakref.ref(self), tenant, agent, result.block_ids, stable_end,
                over) if self.pin_stable else ("off", "")
            fill_report(report, result, spans, hit)
            report.pinned_blocks = len(self.pinned_blocks(tenant))
            report.blocks_by_layer = self.blocks_by_layer(tenant)
            report.tier_items = 0 if self.tiers is None else register_call(
                self.tiers, self.engine.cache, agent, tenant, result.block_ids)
        metrics = self.metrics
        if metrics is not None:
            metrics.record_generate(report)
        if ahead is not None:
            turn = [("user", user_message)] if user_message is not None else []
            ahead.after_reply(self, [*history, *turn, *after, ("assistant", result.text)],
                              tenant=tenant, built=built)
        return PipelineResult(result.text, result, report)

    # ------------------------------------------------------------------ tenants
    @property
    def tenant(self) -> str:
        """The default tenant (see *Tenants* above)."""
        return self._tenants.default

    @tenant.setter
    def tenant(self, tenant: str) -> None:
        self._tenants.default = check_tenant(tenant)

    def tenant_scope(self, tenant: str) -> AbstractContextManager[str]:
        """Make ``tenant`` the tenant of every call and read on this pipeline, in this
        thread or task, that names none (see *Tenants* above; scopes nest).

        The LangChain and LlamaIndex integrations enter one for each model call with the
        tenant they resolved, so what runs inside agrees with them.

        Raises:
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
        """
        return self._tenants.scope(tenant)

    def resolve_tenant(self, tenant: str | None = None) -> str:
        """The tenant a call or read means: ``tenant`` when given, else the innermost
        :meth:`tenant_scope`, else the pipeline's default (:attr:`tenant`).

        Raises:
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
        """
        return self._tenants.resolve(tenant)

    def tenants_held(self) -> list[str]:
        """The tenants whose state (change rates, last build and report) this pipeline
        keeps, least recently used first; at most ``max_tenants``."""
        return self._tenants.tenants()

    def cached_blocks(self, tenant: str | None = None) -> list[BlockMeta]:
        """Metadata of the tenant's blocks in the cache (empty without a cache)."""
        return self._tenants.cached_blocks(tenant)

    def pinned_blocks(self, tenant: str | None = None, *,
                      all_tenants: bool = False) -> list[int]:
        """Ids of the pinned blocks of ``tenant`` (default: the pipeline's own), or of
        every tenant with ``all_tenants=True`` (empty without a cache)."""
        return self._tenants.pinned_blocks(tenant, all_tenants=all_tenants)

    def blocks_by_layer(self, tenant: str | None = None) -> dict[str, int]:
        """Cached blocks per source layer for a tenant (empty without a cache)."""
        return self._tenants.blocks_by_layer(tenant)

    def last_built(self, tenant: str | None = None) -> BuiltPrompt | None:
        """The tenant's latest :meth:`build` result (``None`` when not attached or before
        any)."""
        return self._tenants.last_built(tenant)

    def last_report(self, tenant: str | None = None) -> CallReport | None:
        """The tenant's latest call's report (``None`` when not attached or before any).

        The tenant is resolved as everywhere (:meth:`resolve_tenant`): a call an
        integration made for a tenant taken from its runtime context is read with
        ``last_report(that_tenant)``, inside ``tenant_scope(that_tenant)``, or from the
        reply's metadata (``response_metadata["contextkit"]``). Reading a tenant with no
        call while other tenants have some logs a hint saying so, once.
        """
        return self._tenants.last_report(tenant)

    def volatility(self, tenant: str | None = None) -> dict[str, float]:
        """Learned change rate per layer (empty when not attached)."""
        return self._tenants.volatility(tenant)

    # ------------------------------------------------------------------ served model
    def openai_messages(self, conversation: Sequence[Mapping[str, Any]], *,
                        tenant: str | None = None,
                        built: BuiltPrompt | None = None) -> list[dict[str, Any]]:
        """The chat request's messages, laid out as the embedded engine lays out a turn.

        ``conversation`` is the OpenAI-format messages without the system prompt: the
        history, the current user turn and any tool rounds after it. The result is the
        main system message (the stable and changing layers), the history, a trailing
        system message with the volatile layers (none when there are none, or with
        ``trailing_message=False``), then the last user message and everything after
        it. A system message's content is its sections' ``[LAYER]...[/LAYER]`` texts, one
        per line (the same text as :attr:`BuiltPrompt.text`'s parts); the main one is
        sent even when empty, so no template injects a default system prompt. ``built`` picks a
        :meth:`build` result (default: the tenant's last).

        Raises:
            RuntimeError: nothing built for the tenant yet.
            ValueError: a conversation item is not a message dict with a role, or
                ``built`` belongs to another tenant.
        """
        return self._served.openai_messages(conversation, tenant=tenant, built=built)

    def request_fields(self, messages: Sequence[Mapping[str, Any]], *,
                       tenant: str | None = None, built: BuiltPrompt | None = None,
                       tools: Sequence[Mapping[str, Any]] | None = None) -> dict[str, Any]:
        """The body fields that label a ``/v1/chat/completions`` request for contextkit's
        vLLM connector: ``{"kv_transfer_params": {"contextkit": {...}}, "cache_salt":
        tenant}`` (pass them as the client's ``extra_body``); ``{}`` for a server that
        takes no such fields (``ServedModel.sends_fields``, ``CallReport.served_fields``).

        ``messages`` is exactly what will be sent (normally :meth:`openai_messages`'
        output; any list that holds each built section verbatim works), ``tools`` the
        request's tools. The spans are ``[start, end, source_layer, importance, pinned]``
        in the server's prompt ids (:meth:`ServedModel.render`): one per built section
        (``pinned``: a stable-prefix layer of a pinnable source, with ``pin_stable``)
        and one per other message (``user_turn``, 0.3). A span owns the tokens whose
        first character lies between the end of the previous span's text and the end
        of its own text, so the spans tile the prompt from token 0 through the last
        message's content: the chat markup before a text belongs to it, and a token
        merging across a boundary belongs to the text its first character is in. The
        markup after the last message (and the generation prompt) is in no span.

        Raises:
            RuntimeError: the pipeline is not attached to a served model, or nothing is
                built for the tenant yet.
            LabelRangeError: a built section is not in ``messages`` verbatim, or the
                messages cannot be rendered exactly (see :meth:`ServedModel.render`).
            InvalidNameError: a tenant vLLM refuses as ``cache_salt`` (it contains ``@``).
        """
        return self._served.request_fields(messages, pin=bool(self.pin_stable), tenant=tenant,
                                           built=built, tools=tools,
                                           chunks=self.reuse_chunks)

    def record_usage(self, report_or_tenant: CallReport | str | None, prompt_tokens: int,
                     cached_tokens: int) -> CallReport:
        """Fill a call's report from the usage the server reported (``prompt_tokens``
        and ``prompt_tokens_details.cached_tokens``): prompt, reused and computed tokens,
        the reuse ratio and, when the counts are those of the tenant's last
        :meth:`request_fields`, the reused and computed tokens per layer (also counted in
        ``contextkit_pipeline_prompt_tokens``).

        ``report_or_tenant``: the call's report, or a tenant (``None``: the resolved
        tenant) whose last report is meant.

        Returns:
            The report.

        Raises:
            RuntimeError: no report for the tenant yet.
            ValueError: counts that are not ints with ``0 <= cached_tokens <=
                prompt_tokens``.
        """
        return self._served.record_usage(report_or_tenant, prompt_tokens, cached_tokens)


def cache_aware(pipeline: CacheAwareContextPipeline) -> Callable[[F], F]:
    """Decorator form of :meth:`CacheAwareContextPipeline.wrap`::

        @cache_aware(pipeline)
        def build_system_message(...): ...
    """
    return pipeline.wrap

