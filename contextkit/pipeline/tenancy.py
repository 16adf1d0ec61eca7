"""Tenants of a pipeline: which tenant a call or read means, each tenant's state, and
the per-tenant views of the cache (:class:`TenantViews`, owned by
:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline`, whose methods that take
``tenant=`` delegate to it).

Tenants
-------
A tenant owns blocks: its keys are salted with its name, so no other tenant can see,
reuse or evict into them, and its pins count against its own quota. Every method of
:class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` that takes ``tenant=``
(``build``, ``generate``, ``assemble``, ``openai_messages``, ``request_fields``,
``record_usage``, ``last_report``, ``last_built``, ``pinned_blocks``,
``cached_blocks``, ``blocks_by_layer``, ``volatility``) means the same tenant by one
rule (its ``resolve_tenant``):

1. the ``tenant`` argument, when given;
2. else the innermost ``tenant_scope`` entered in this thread or asyncio task;
3. else the pipeline's default, its ``tenant`` (``[pipeline] tenant`` in the
   configuration, ``"default"`` unless set).

Reads never fall back to another tenant, and never create a tenant's state. The
integrations resolve a tenant of their own (LangChain: the middleware's ``tenant``,
then ``tenant`` of the agent's runtime context; LlamaIndex: the call's ``tenant``
keyword, then the LLM's) and enter a ``tenant_scope`` for the call, so the engine, the
pipeline and the report agree. A call's report also travels with its reply
(``response_metadata["contextkit"]`` in LangChain, ``raw["contextkit"]`` in
LlamaIndex), which is the simplest way to read it for a tenant taken from a runtime
context.

State
-----
A pipeline keeps the state (change rates, last build and report) of at most
``max_tenants`` tenants (1024 unless set; ``[pipeline] max_tenants``). Past it, the
tenant least recently built for is released: its next call starts from the layers'
seed rates, as a new tenant's does, and its ``last_report`` reads ``None`` until then.
A call in flight holds the pipeline's lock, so no tenant is released under it.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections import OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from contextkit.config.settings import PipelineSettings, check_int
from contextkit.prompt.layers import LayerConfig
from gpu_cache import PrefixPinManager, TQGPUCache, validate_tenant
from gpu_cache.metadata import BlockMeta

if TYPE_CHECKING:
    from contextkit.engine.types import TokenSpan
    from contextkit.pipeline.reports import BuiltPrompt, CallReport

logger = logging.getLogger("contextkit.pipeline.pipeline")

#: Tenants whose state a pipeline keeps unless told otherwise (the setting's default).
DEFAULT_MAX_TENANTS: int = PipelineSettings().max_tenants


def check_tenant(tenant: str) -> str:
    return validate_tenant(tenant)  # InvalidNameError is a ValueError


class _TenantState:
    def __init__(self, config: LayerConfig) -> None:
        self.calls = 0
        self.rates = {s.name: (1.0 if s.volatile else 0.0) for s in config}
        self.last_texts: dict[str, str] = {}
        self.last_segments: list[tuple[str, tuple[int, ...]]] = []
        self.stable_hash = ""
        self.last: BuiltPrompt | None = None
        # A served model's last request_fields: (report, prompt tokens, spans).
        self.last_request: tuple[CallReport, int, list[TokenSpan]] | None = None


class TenantViews:
    """A pipeline's tenants: which one a call or read means, each one's state, and the
    per-tenant reads of the cache.

    Args:
        config: the pipeline's layers (a new tenant's change rates start from them).
        default: the pipeline's default tenant.
        lock: the pipeline's lock; a tenant's state is read and changed under it.
        attached: whether the pipeline has an engine or a served model (reads of a
            pipeline without either are empty).
        cache: the engine's cache (``None`` without an engine).
        pins: the pin manager over ``cache``.
        max_tenants: tenants whose state is kept; past it the least recently built
            for is released.
    """

    def __init__(self, config: LayerConfig, default: str, lock: threading.RLock, *,
                 attached: bool, cache: TQGPUCache | None = None,
                 pins: PrefixPinManager | None = None,
                 max_tenants: int = DEFAULT_MAX_TENANTS) -> None:
        self.config = config
        self.default = check_tenant(default)
        self.lock = lock
        self.attached = attached
        self.cache = cache
        self.pins = pins
        check_int("max_tenants", max_tenants, 1)
        self.max_tenants = max_tenants
        # least recently used first
        self._states: OrderedDict[str, _TenantState] = OrderedDict()
        self._scope: contextvars.ContextVar[str | None] = contextvars.ContextVar(
            f"contextkit_tenant_{id(self):x}", default=None)
        self._hinted_readers = False

    # ------------------------------------------------------------------ state
    def state(self, tenant: str) -> _TenantState:
        """The tenant's state to change, made on first use; the least recently used
        tenant's is released past :attr:`max_tenants` (hold :attr:`lock`)."""
        state = self._states.get(tenant)
        if state is None:
            state = self._states[tenant] = _TenantState(self.config)
            while len(self._states) > self.max_tenants:
                self._states.popitem(last=False)
        else:
            self._states.move_to_end(tenant)
        return state

    def peek(self, tenant: str) -> _TenantState:
        """The tenant's state to read, or a fresh one that is not kept (hold :attr:`lock`)."""
        return self._states.get(tenant) or _TenantState(self.config)

    def tenants(self) -> list[str]:
        """The tenants whose state is kept, least recently used first."""
        with self.lock:
            return list(self._states)

    def last(self, tenant: str) -> BuiltPrompt | None:
        """The tenant's latest build (``None`` before any, or once released)."""
        with self.lock:
            return self.peek(tenant).last

    # ------------------------------------------------------------------ resolution
    @contextlib.contextmanager
    def scope(self, tenant: str) -> Iterator[str]:
        """See :meth:`CacheAwareContextPipeline.tenant_scope`."""
        token = self._scope.set(check_tenant(tenant))
        try:
            yield tenant
        finally:
            self._scope.reset(token)

    def resolve(self, tenant: str | None = None) -> str:
        """See :meth:`CacheAwareContextPipeline.resolve_tenant`."""
        if tenant is not None:
            return check_tenant(tenant)
        scoped = self._scope.get()
        return scoped if scoped is not None else self.default

    # ------------------------------------------------------------------ views
    def cached_blocks(self, tenant: str | None = None) -> list[BlockMeta]:
        if self.cache is None:
            return []
        tenant = self.resolve(tenant)
        return [m for m in self.cache.metadata.all() if m.tenant_slug == tenant]

    def pinned_blocks(self, tenant: str | None = None, *,
                      all_tenants: bool = False) -> list[int]:
        if self.pins is None:
            return []
        if all_tenants:
            return self.pins.pinned_ids()
        return self.pins.pinned_ids(self.resolve(tenant))

    def blocks_by_layer(self, tenant: str | None = None) -> dict[str, int]:
        out: dict[str, int] = {}
        for meta in self.cached_blocks(tenant):
            out[meta.source_layer] = out.get(meta.source_layer, 0) + 1
        return dict(sorted(out.items()))

    def last_built(self, tenant: str | None = None) -> BuiltPrompt | None:
        if not self.attached:
            return None
        return self.last(self.resolve(tenant))

    def last_report(self, tenant: str | None = None) -> CallReport | None:
        """The tenant's latest report; reading a tenant with no call while other
        tenants have some logs a hint saying so, once."""
        if not self.attached:
            return None
        named = tenant is not None or self._scope.get() is not None
        resolved = self.resolve(tenant)
        with self.lock:
            state = self._states.get(resolved)
            last = state.last if state is not None else None
            others = sorted(t for t, s in self._states.items() if s.last is not None)
            hint = last is None and not named and others and not self._hinted_readers
            if hint:
                self._hinted_readers = True
        if hint:
            logger.warning(
                "last_report(): no call yet for the default tenant %r; calls were made for "
                "%s. Name the tenant (last_report(tenant=...)), read inside "
                "pipeline.tenant_scope(tenant), or take the report from the reply's metadata",
                resolved, ", ".join(repr(t) for t in others[:5]))
        return last.report if last else None

    def volatility(self, tenant: str | None = None) -> dict[str, float]:
        if not self.attached:
            return {}
        with self.lock:
            return dict(self.peek(self.resolve(tenant)).rates)
