"""One rule for which tenant a call or read means: argument > tenant_scope > default."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable

import pytest

from contextkit.engine.engine import Engine
from contextkit.pipeline.pipeline import CacheAwareContextPipeline
from gpu_cache import InvalidNameError

PROMPT = {"axioms": ["Tell the truth about what you checked."],
          "identity": ["You are Atlas, the SRE assistant."]}


def test_argument_then_scope_then_default(fresh: Callable[..., Engine]) -> None:
    pipeline = CacheAwareContextPipeline(fresh("tq4"), tenant="home")
    assert pipeline.resolve_tenant() == "home"
    with pipeline.tenant_scope("acme"):
        assert pipeline.resolve_tenant() == "acme"
        assert pipeline.resolve_tenant("globex") == "globex"
        with pipeline.tenant_scope("initech"):
            assert pipeline.resolve_tenant() == "initech"
        assert pipeline.resolve_tenant() == "acme"
        seen: list[str] = []
        # A scope belongs to its thread (or asyncio task): another thread is not in it.
        worker = threading.Thread(target=lambda: seen.append(pipeline.resolve_tenant()))
        worker.start()
        worker.join()
        assert seen == ["home"]
    assert pipeline.resolve_tenant() == "home"
    other = CacheAwareContextPipeline(fresh("tq4"))
    with pipeline.tenant_scope("acme"):
        assert other.resolve_tenant() == "default"  # scopes are per pipeline
    with pytest.raises(InvalidNameError), pipeline.tenant_scope("../etc"):
        pass


def test_asyncio_tasks_keep_their_own_scope(fresh: Callable[..., Engine]) -> None:
    pipeline = CacheAwareContextPipeline(fresh("tq4"))

    async def task(name: str) -> str:
        with pipeline.tenant_scope(name):
            await asyncio.sleep(0.01)  # the other task enters its scope meanwhile
            return pipeline.resolve_tenant()

    async def both() -> list[str]:
        return list(await asyncio.gather(task("acme"), task("globex")))

    assert asyncio.run(both()) == ["acme", "globex"]


def test_calls_and_reads_in_a_scope_mean_its_tenant(
        fresh: Callable[..., Engine], caplog: pytest.LogCaptureFixture) -> None:
    engine = fresh("tq4")
    pipeline = CacheAwareContextPipeline(engine)
    with pipeline.tenant_scope("acme"):
        pipeline.build(PROMPT)
        result = pipeline.generate("Hi", max_new_tokens=2)
        assert result.report.tenant == "acme"
        assert pipeline.last_report() is result.report
        assert pipeline.last_built() is not None
        assert pipeline.pinned_blocks() == pipeline.pinned_blocks("acme") != []
        assert pipeline.blocks_by_layer() == pipeline.blocks_by_layer("acme") != {}
        assert {m.tenant_slug for m in pipeline.cached_blocks()} == {"acme"}
    assert {m.tenant_slug for m in engine.cache.metadata.all()} == {"acme"}
    # Outside the scope, the default tenant: never another tenant's report...
    with caplog.at_level(logging.WARNING, logger="contextkit.pipeline.pipeline"):
        assert pipeline.last_report() is None
        assert pipeline.last_report() is None
    hints = [r.getMessage() for r in caplog.records if "last_report()" in r.getMessage()]
    # ...but a hint, once, that names who did call and how to ask.
    assert len(hints) == 1 and "'acme'" in hints[0] and "tenant_scope" in hints[0], hints
    assert pipeline.pinned_blocks() == [] and pipeline.cached_blocks() == []
    assert pipeline.last_report("acme") is result.report



# ---------------------------------------------------------------- bounded tenant state
def test_reads_of_an_unknown_tenant_create_no_state(fresh: Callable[..., Engine]) -> None:
    pipeline = CacheAwareContextPipeline(fresh("native", device=8, host=8))
    pipeline.build(PROMPT, tenant="acme")
    assert pipeline.tenants_held() == ["acme"]
    assert pipeline.last_report("nobody") is None
    assert pipeline.last_built("nobody") is None
    assert pipeline.volatility("nobody") == pipeline.volatility("other")  # the layers' seed
    assert pipeline.preview(PROMPT, tenant="nobody").report.tenant == "nobody"
    with pytest.raises(RuntimeError, match="no system prompt built"):
        pipeline.openai_messages([], tenant="nobody")
    with pytest.raises(RuntimeError, match="no call for tenant"):
        pipeline.record_usage("nobody", 10, 0)
    assert pipeline.tenants_held() == ["acme"]


def test_ten_thousand_tenants_leave_at_most_the_bound() -> None:
    from contextkit.pipeline.tenancy import DEFAULT_MAX_TENANTS, TenantViews
    from contextkit.prompt.layers import LayerConfig

    views = TenantViews(LayerConfig(), "default", threading.RLock(), attached=True)
    assert views.max_tenants == DEFAULT_MAX_TENANTS == 1024
    with views.lock:
        for i in range(10_000):
            views.state(f"t{i}").calls += 1
    held = views.tenants()
    assert len(held) == 1024
    assert held[0] == "t8976" and held[-1] == "t9999"  # the least recently used went


def test_the_least_recently_used_tenant_is_released(fresh: Callable[..., Engine]) -> None:
    pipeline = CacheAwareContextPipeline(fresh("native", device=8, host=8), max_tenants=2)
    for tenant in ("acme", "globex", "acme", "initech"):
        pipeline.build(PROMPT, tenant=tenant)
    assert pipeline.tenants_held() == ["acme", "initech"]
    assert pipeline.last_report("globex") is None
    assert pipeline.last_report("acme") is not None
    with pytest.raises(ValueError, match=r"^max_tenants must be an integer >= 1, got 0"):
        CacheAwareContextPipeline(max_tenants=0)


def test_the_bound_is_a_pipeline_setting() -> None:
    from contextkit.config import PipelineSettings, load_config

    assert PipelineSettings().max_tenants == 1024
    assert load_config(env={"CONTEXTKIT_PIPELINE_MAX_TENANTS": "16"}).pipeline.max_tenants == 16
    with pytest.raises(ValueError, match=r"^max_tenants must be an integer >= 1"):
        PipelineSettings(max_tenants=float("nan"))
