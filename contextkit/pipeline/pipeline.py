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
A tenant owns blocks: its keys are salted with its name, so no other tenant can see,
reuse or evict into them, and its pins count against its own quota. Every method that
takes ``tenant=`` (:meth:`~CacheAwareContextPipeline.build`, ``generate``,
``assemble``, ``openai_messages``, ``request_fields``, ``record_usage``, ``last_report``,
``last_built``, ``pinned_blocks``, ``cached_blocks``, ``blocks_by_layer``,
``volatility``) means the same tenant by one rule
(:meth:`~CacheAwareContextPipeline.resolve_tenant`):

1. the ``tenant`` argument, when given;
2. else the innermost :meth:`~CacheAwareContextPipeline.tenant_scope` entered in this
   thread or asyncio task;
3. else the pipeline's default, :attr:`~CacheAwareContextPipeline.tenant`
   (``[pipeline] tenant`` in the configuration, ``"default"`` unless set).

Reads never fall back to another tenant. The integrations resolve a tenant of their
own (LangChain: the middleware's ``tenant``, then ``tenant`` of the agent's runtime
context; LlamaIndex: the call's ``tenant`` keyword, then the LLM's) and enter a
``tenant_scope`` for the call, so the engine, the pipeline and the report agree. A
call's report also travels with its reply (``response_metadata["contextkit"]`` in
LangChain, ``raw["contextkit"]`` in LlamaIndex), which is the simplest way to read it
for a tenant taken from a runtime context.

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

import contextvars
import functools
import hashlib
import logging
import struct
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from contextkit.prompt.chatml import _ChatML
from contextkit.prompt.ordering import (
    BOUNDARY,
    first_difference,
    order_sections,
    section_text,
)
from contextkit.prompt.ordering import (
    VOLATILE_THRESHOLD as VOLATILE_THRESHOLD,  # re-exported: its import path
)
from contextkit.pipeline.pins import check_pin_quota, pin_stable
from contextkit.pipeline.registration import register_call
from contextkit.pipeline.reports import BuiltPrompt, CallReport, PipelineResult, TurnPlan, fill_report
from contextkit.pipeline.served.requests import _ServedPipeline
from contextkit.pipeline.tenancy import _check_tenant, _TenantState, _TenantViews
from contextkit.engine.engine import Engine, TokenSpan
from contextkit.prompt.layers import LayerConfig, LayerSpec
from contextkit.metrics import ContextkitMetrics
from contextkit.metrics import resolve as resolve_metrics
from contextkit.prompt.markup import (
    PromptSection,
    SpilloverQueue,
    coerce_prompt,
    synthesize_for_budget,
)
from contextkit.pipeline.served.model import ServedModel
from gpu_cache import PrefixPinManager, validate_name

if TYPE_CHECKING:
    from contextkit.loop.reservations import MemoryReservations
    from contextkit.loop.tiers import ContextTierManager

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

_ROLES = ("user", "assistant", "system", "tool")


class CacheAwareContextPipeline(_ServedPipeline, _TenantViews):
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
        pin_stable: pin the stable prefix's blocks in the device tier.
        volatility_alpha: weight of the newest observation in each layer's change rate.
        spillover: where over-budget lines go (a new queue by default).
        tiers: a tier manager to register every call's blocks with (see
            :mod:`contextkit.pipeline.registration`); ``CallReport.tier_items`` counts the items
            each call touched.
        agent: this pipeline's agent name (default: the tenant of each call). One
            pipeline per agent over one shared engine (and tier manager) is the
            multi-agent setup: pins are held per agent (see :mod:`contextkit.pipeline.pins`).
        reservations: memory neighborhoods prefilled in the background between turns
            (:class:`contextkit.loop.reservations.MemoryReservations`): :meth:`generate`
            calls its ``before_turn`` before the engine runs (a hit is
            ``CallReport.reservation_hit``) and its ``after_reply`` after.
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
        pin_stable: bool = True,
        volatility_alpha: float = 0.3,
        spillover: SpilloverQueue | None = None,
        metrics: ContextkitMetrics | bool | None = None,
        tiers: ContextTierManager | None = None,
        agent: str | None = None,
        reservations: MemoryReservations | None = None,
    ) -> None:
        if engine is not None and served is not None:
            raise ValueError("pass either engine= (the embedded engine) or served= (a vLLM "
                             "server's model), not both: a pipeline steers one cache")
        if served is not None and not isinstance(served, ServedModel):
            raise ValueError(f"served must be a contextkit.pipeline.served.model.ServedModel, got "
                             f"{type(served).__name__}")
        if not 0.0 < volatility_alpha <= 1.0:
            raise ValueError(f"volatility_alpha must be in (0, 1], got {volatility_alpha}")
        self.engine = engine
        self.served = served
        self.config = layers or LayerConfig()
        self.tenant = _check_tenant(tenant)
        self.agent = validate_name(agent, "agent") if agent is not None else None
        self.tiers = tiers
        self.reservations = reservations
        self.reorder = reorder
        self.trailing_message = trailing_message
        self.pin_stable = pin_stable
        self.alpha = volatility_alpha
        self.spillover = spillover if spillover is not None else SpilloverQueue()
        self._states: dict[str, _TenantState] = {}
        self._lock = threading.RLock()
        self._metrics_arg = metrics
        self._metrics: ContextkitMetrics | None = None
        self._spill_warned: set[str] = set()
        self._scope: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"contextkit_tenant_{id(self):x}", default=None)
        self._hinted_readers = False
        if engine is not None:
            _ChatML.check(engine.tokenizer)
            self._pins = PrefixPinManager(engine.cache)

    @classmethod
    def from_config(cls, engine: Engine | dict[str, Any] | None = None, config: Any = None,
                    *, served: ServedModel | None = None, layers: LayerConfig | None = None,
                    spillover: SpilloverQueue | None = None,
                    tiers: ContextTierManager | None = None, agent: str | None = None,
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
                   metrics=None if cfg.metrics.enabled else False, tiers=tiers, agent=agent)

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
        return self._build(raw, self.resolve_tenant(tenant), commit=True)

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
        return self._build(raw, self.resolve_tenant(tenant), commit=False, changed=changed)

    def _build(self, raw: object, tenant: str, *, commit: bool,
               changed: Sequence[str] | None = None) -> BuiltPrompt:
        prompt = coerce_prompt(raw, self.config)
        count = self._count_tokens
        sections: list[PromptSection] = []
        spilled: dict[str, int] = {}
        layer_tokens: dict[str, int] = {}
        for section in prompt.sections:
            spec = self.config.get(section.layer)
            budget = self.budget(spec)
            kept, over = synthesize_for_budget(section.lines, budget, count, layer=spec.name,
                                               spillover=self.spillover if commit else None)
            if over and commit:
                spilled[spec.name] = spilled.get(spec.name, 0) + len(over)
                self._warn_spill(spec.name, len(over), len(section.lines), budget)
            sections.append(PromptSection(spec.name, tuple(kept)))
            layer_tokens[spec.name] = count("\n".join(line.text for line in kept))
        with self._lock:
            state = self._state(tenant) if commit else \
                self._states.get(tenant) or _TenantState(self.config)
            # Each section is rendered and tokenized once per call; the hash, the
            # change report and assemble() all reuse these ids.
            texts = {s.layer: section_text(s) for s in sections}
            section_ids = {layer: tuple(self._encode(t)) for layer, t in texts.items()}
            first = state.calls == 0
            diff = [name for name, text in texts.items()
                    if first or state.last_texts.get(name) != text]
            rates = dict(state.rates)
            if not first:
                for name in texts:
                    hit = 1.0 if name in (diff if changed is None else changed) else 0.0
                    rates[name] = (1 - self.alpha) * rates[name] + self.alpha * hit
            main, trailing = order_sections(sections, rates, self.config, reorder=self.reorder,
                                            trailing_message=self.trailing_message)
            stable_ids = self._encode(_ChatML.open("system"))
            stable_layers: list[str] = []
            for sec in main:
                if not self.config.get(sec.layer).stable:
                    break
                stable_ids += section_ids[sec.layer]
                stable_layers.append(sec.layer)
            stable_hash = hashlib.sha256(
                struct.pack(f"<{len(stable_ids)}i", *stable_ids)).hexdigest()
            # The boundary between the main and the trailing message is a segment
            # too: a layer moving across it changes the token layout.
            segments = [*((sec.layer, section_ids[sec.layer]) for sec in main),
                        (BOUNDARY, ()),
                        *((sec.layer, section_ids[sec.layer]) for sec in trailing)]
            broken = first_difference(state.last_segments, segments) if not first \
                else "first_call"
            report = CallReport(
                call=state.calls + 1, tenant=tenant, stable_hash=stable_hash,
                stable_changed=not first and stable_hash != state.stable_hash,
                changed_layers=diff, prefix_broken_by=broken,
                layer_order=[s.layer for s in main], trailing_layers=[s.layer for s in trailing],
                layer_tokens=layer_tokens, spilled_lines=sum(spilled.values()),
                spilled_by_layer=spilled)
            # Sections end with a newline; the returned text does not.
            text = "".join(texts[sec.layer] for sec in (*main, *trailing))[:-1]
            built = BuiltPrompt(tuple(main), tuple(trailing), text, report, section_ids,
                                texts, tuple(stable_layers))
            if not commit:
                return built
            state.rates = rates
            state.calls += 1
            state.last_texts = texts
            state.last_segments = segments
            state.stable_hash = stable_hash
            state.last = built
        metrics = self.metrics
        if metrics is not None:
            metrics.record_build(report)
        return built

    def _warn_spill(self, layer: str, spilled: int, lines: int, budget: int) -> None:
        """Warn the first time a layer spills (the report counts every call)."""
        with self._lock:
            if layer in self._spill_warned:
                return
            self._spill_warned.add(layer)
        logger.warning(
            "layer %s: %d of its %d lines are over its budget of %d tokens and were "
            "spilled (left out of the prompt; see CallReport.spilled_by_layer). Shorten "
            "the layer or raise its budget (LayerConfig.with_budgets); this warning is "
            "given once per layer", layer, spilled, lines, budget)

    @property
    def metrics(self) -> ContextkitMetrics | None:
        """Where this pipeline's figures are recorded (``metrics=`` at construction;
        default: :func:`contextkit.metrics.default_metrics`); ``None``: nowhere."""
        if self._metrics is None and self._metrics_arg is not False:
            self._metrics = resolve_metrics(self._metrics_arg)
            if self._metrics is None:
                self._metrics_arg = False
        return self._metrics

    def _count_tokens(self, text: str) -> int:
        return len(self._encode(text))

    def _encode(self, text: str) -> list[int]:
        source = self.engine if self.engine is not None else self.served
        assert source is not None
        return source.encode(text)

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
        if self.engine is None:
            return [], [], 0
        tenant = self.resolve_tenant(tenant)
        if built is None:
            with self._lock:
                built = self._state(tenant).last
        if built is None:
            raise RuntimeError("no system prompt built for tenant "
                               f"{tenant!r} yet; call the wrapped build_system_message first")
        main, trailing = list(built.main), list(built.trailing)
        if user_order:
            order = {spec.name: i for i, spec in enumerate(self.config)}
            main, trailing = sorted(main + trailing, key=lambda s: order[s.layer]), []
        ids: list[int] = []
        spans: list[TokenSpan] = []
        stable_end = 0
        in_stable = True

        def add(text: str, layer: str | None = None, importance: float = 0.5,
                piece: Sequence[int] | None = None) -> None:
            piece = self._encode(text) if piece is None else piece
            if layer is not None:
                spans.append(TokenSpan(len(ids), len(ids) + len(piece), layer, importance))
            ids.extend(piece)

        def add_system(sections: Sequence[PromptSection]) -> None:
            nonlocal stable_end, in_stable
            add(_ChatML.open("system"))
            for s in sections:
                spec = self.config.get(s.layer)
                imp = max((line.importance for line in s.lines), default=0.5)
                add("", spec.source, imp, piece=built.section_ids[s.layer])
                if in_stable and spec.stable:
                    stable_end = len(ids)
                else:
                    in_stable = False
            add(_ChatML.close())

        def add_turns(turns: Sequence[tuple[str, str]]) -> None:
            for role, text in turns:
                if role not in _ROLES:
                    raise ValueError(f"message role must be one of {', '.join(_ROLES)}, "
                                     f"got {role!r}")
                add(_ChatML.open(role))
                add(text + _ChatML.close(), "user_turn", 0.3)

        add_system(main)
        in_stable = False
        add_turns(history)
        if trailing:
            add_system(trailing)
        if user_message is not None:
            add_turns([("user", user_message)])
        add_turns(after)
        add(_ChatML.open("assistant"))
        return ids, spans, stable_end

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
        tenant = _check_tenant(tenant if tenant is not None else self.resolve_tenant())
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
    ) -> PipelineResult:
        """Run one chat turn on the engine with the last built system prompt.

        ``built`` picks a specific :meth:`build` result (default: the tenant's last);
        ``after`` and ``on_token`` are passed to :meth:`assemble` and
        :meth:`Engine.generate <contextkit.engine.engine.Engine.generate>`.

        Raises:
            RuntimeError: no engine attached, or nothing built yet.
            CacheFullError: the prompt does not fit the device tier (nothing lost).
            PinCapacityError: ``pin_stable`` and the tenant's stable prefix is longer
                than its pin quota (nothing computed).
        """
        if self.engine is None:
            if self.served is not None:
                raise RuntimeError("this pipeline is attached to a served model: send "
                                   "openai_messages() with request_fields() through your "
                                   "OpenAI client, then record_usage() the reply's usage")
            raise RuntimeError("no engine attached: this pipeline only passes prompts "
                               "through; build it with CacheAwareContextPipeline(engine)")
        if tenant is None:
            tenant = built.report.tenant if built is not None else self.resolve_tenant()
        tenant = _check_tenant(tenant)
        if built is not None and built.report.tenant != tenant:
            raise ValueError(f"this prompt was built for tenant {built.report.tenant!r}, not "
                             f"{tenant!r}; tenants never share blocks")
        agent = self.agent if self.agent is not None else tenant
        with self._lock:
            built = built if built is not None else self._state(tenant).last
        ahead = self.reservations
        # Outside the pipeline's lock: it stops background work that may wait on it.
        hit = ahead.before_turn(built, tenant=tenant) if ahead and built else None
        with self._lock:
            ids, spans, stable_end = self.assemble(user_message, history, tenant=tenant,
                                                   built=built, after=after)
            assert built is not None
            if self.pin_stable:
                check_pin_quota(self._pins, tenant, spans, stable_end)
            result = self.engine.generate(ids, max_new_tokens=max_new_tokens, tenant=tenant,
                                          spans=spans, on_token=on_token)
            report = built.report
            if self.pin_stable:
                report.pin_state, report.pin_reason = pin_stable(
                    self._pins, self, tenant, agent, result.block_ids, stable_end)
            else:
                report.pin_state, report.pin_reason = "off", ""
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


def cache_aware(pipeline: CacheAwareContextPipeline) -> Callable[[F], F]:
    """Decorator form of :meth:`CacheAwareContextPipeline.wrap`::

        @cache_aware(pipeline)
        def build_system_message(...): ...
    """
    return pipeline.wrap

