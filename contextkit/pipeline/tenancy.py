"""Tenants of a pipeline: which tenant a call or read means, and per-tenant views of
the cache (the :class:`~contextkit.pipeline.pipeline.CacheAwareContextPipeline` methods that take
``tenant=``; see *Tenants* in :mod:`contextkit.pipeline.pipeline`)."""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

from contextkit.prompt.layers import LayerConfig
from gpu_cache import PrefixPinManager, validate_tenant
from gpu_cache.metadata import BlockMeta

if TYPE_CHECKING:
    from contextkit.pipeline.reports import BuiltPrompt, CallReport
    from contextkit.engine.types import TokenSpan
    from contextkit.engine.engine import Engine
    from contextkit.pipeline.served.model import ServedModel

logger = logging.getLogger("contextkit.pipeline.pipeline")


def _check_tenant(tenant: str) -> str:
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


class _TenantViews:
    """Tenant resolution and the per-tenant reads of a pipeline."""

    engine: Engine | None
    served: ServedModel | None
    config: LayerConfig
    tenant: str
    _lock: threading.RLock
    _states: dict[str, _TenantState]
    _pins: PrefixPinManager
    _scope: contextvars.ContextVar[str | None]
    _hinted_readers: bool

    def _state(self, tenant: str) -> _TenantState:
        state = self._states.get(tenant)
        if state is None:
            state = self._states[tenant] = _TenantState(self.config)
        return state

    @contextlib.contextmanager
    def tenant_scope(self, tenant: str) -> Iterator[str]:
        """Make ``tenant`` the tenant of every call and read on this pipeline, in this
        thread or task, that names none (see *Tenants* above; scopes nest).

        The LangChain and LlamaIndex integrations enter one for each model call with the
        tenant they resolved, so what runs inside agrees with them.

        Raises:
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
        """
        token = self._scope.set(_check_tenant(tenant))
        try:
            yield tenant
        finally:
            self._scope.reset(token)

    def resolve_tenant(self, tenant: str | None = None) -> str:
        """The tenant a call or read means: ``tenant`` when given, else the innermost
        :meth:`tenant_scope`, else the pipeline's default (:attr:`tenant`).

        Raises:
            InvalidNameError: a tenant that breaks :func:`gpu_cache.validate_tenant`.
        """
        if tenant is not None:
            return _check_tenant(tenant)
        scoped = self._scope.get()
        return scoped if scoped is not None else self.tenant

    def cached_blocks(self, tenant: str | None = None) -> list[BlockMeta]:
        """Metadata of the tenant's blocks in the cache (empty without a cache)."""
        if self.engine is None:
            return []
        tenant = self.resolve_tenant(tenant)
        return [m for m in self.engine.cache.metadata.all() if m.tenant_slug == tenant]

    def pinned_blocks(self, tenant: str | None = None, *,
                      all_tenants: bool = False) -> list[int]:
        """Ids of the pinned blocks of ``tenant`` (default: the pipeline's own), or of
        every tenant with ``all_tenants=True`` (empty without a cache)."""
        if self.engine is None:
            return []
        if all_tenants:
            return self._pins.pinned_ids()
        return self._pins.pinned_ids(self.resolve_tenant(tenant))

    def blocks_by_layer(self, tenant: str | None = None) -> dict[str, int]:
        """Cached blocks per source layer for a tenant (empty without a cache)."""
        out: dict[str, int] = {}
        for meta in self.cached_blocks(tenant):
            out[meta.source_layer] = out.get(meta.source_layer, 0) + 1
        return dict(sorted(out.items()))

    def last_built(self, tenant: str | None = None) -> BuiltPrompt | None:
        """The tenant's latest :meth:`build` result (``None`` when not attached or before
        any)."""
        if self.engine is None and self.served is None:
            return None
        with self._lock:
            return self._state(self.resolve_tenant(tenant)).last

    def last_report(self, tenant: str | None = None) -> CallReport | None:
        """The tenant's latest call's report (``None`` when not attached or before any).

        The tenant is resolved as everywhere (:meth:`resolve_tenant`): a call an
        integration made for a tenant taken from its runtime context is read with
        ``last_report(that_tenant)``, inside ``tenant_scope(that_tenant)``, or from the
        reply's metadata (``response_metadata["contextkit"]``). Reading a tenant with no
        call while other tenants have some logs a hint saying so, once.
        """
        if self.engine is None and self.served is None:
            return None
        named = tenant is not None or self._scope.get() is not None
        resolved = self.resolve_tenant(tenant)
        with self._lock:
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
        """Learned change rate per layer (empty when not attached)."""
        if self.engine is None and self.served is None:
            return {}
        with self._lock:
            return dict(self._state(self.resolve_tenant(tenant)).rates)
