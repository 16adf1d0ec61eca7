"""Background prefill: reused by the next request, preempted by a foreground one, no leaks."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from contextkit.engine.background import BackgroundPrefiller, PrefillOutcome
from contextkit.engine.engine import Engine, TokenSpan
from gpu_cache import Tier

pytestmark = pytest.mark.slow

SYSTEM = ("You are Atlas, a site reliability assistant. Answer briefly, cite the metric you "
          "used, and never run destructive commands without confirmation. Memories: the "
          "payments database pool was raised to 40 connections last week. ") * 2


def chat(engine: Engine, user: str, system: str = SYSTEM) -> list[int]:
    ids = engine.tokenizer.apply_chat_template(
        [{"role": "system", "content": system}, {"role": "user", "content": user}],
        add_generation_prompt=True, tokenize=True)
    if not isinstance(ids, list):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def prefix_of(engine: Engine) -> list[int]:
    """The system message: what the next prompt starts with (and it ends mid-block)."""
    full = chat(engine, "Why do services use connection pools?")
    other = chat(engine, "List two signs of pool exhaustion.")
    common = next(i for i, (a, b) in enumerate(zip(full, other, strict=False)) if a != b)
    return full[:common]


def free(engine: Engine) -> tuple[int, int]:
    return engine.cache.num_free(Tier.DEVICE), engine.cache.num_free(Tier.HOST)


def test_prefilled_blocks_are_reused_and_the_reply_is_unchanged(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    prompt = chat(eng, "Why do services use connection pools?")
    bs = eng.cache.block_size
    full_blocks = len(prefix) // bs
    spans = [TokenSpan(0, len(prefix), "memories", 0.8)]

    out = eng.prefill_prefix(prefix, tenant="acme", spans=spans)
    assert isinstance(out, PrefillOutcome)
    assert (out.prompt_tokens, out.reused_tokens) == (len(prefix), 0)
    assert out.computed_tokens == full_blocks * bs and len(out.block_ids) == full_blocks
    assert out.tier == "device" and not out.preempted and out.reason == ""
    assert out.cpu_s > 0 and out.wall_s > 0
    assert all(eng.cache.metadata.get(b).ref_count == 0 for b in out.block_ids)
    assert eng.cache.metadata.get(out.block_ids[0]).source_layer == "memories"
    # A second prefill finds everything cached.
    again = eng.prefill_prefix(prefix, tenant="acme")
    assert again.reused_tokens == full_blocks * bs and again.block_ids == ()

    res = eng.generate(prompt, max_new_tokens=8, tenant="acme")
    assert res.reused_tokens == full_blocks * bs
    assert res.block_ids[:full_blocks] == list(out.block_ids)
    # Exactly what a foreground request of those full blocks would have cached: the
    # same bytes, hence the same reply.
    warm = fresh("tq4")
    warm.generate(prefix[: full_blocks * bs], max_new_tokens=1, tenant="acme")
    theirs = warm.cache.lookup(warm.cache.block_keys(prefix, "acme"), "acme")
    assert len(theirs) == full_blocks
    mine_bytes = eng.cache.export_blocks(list(out.block_ids))
    their_bytes = warm.cache.export_blocks(theirs)
    assert all(torch.equal(mine_bytes[k], their_bytes[k]) for k in mine_bytes)
    again_warm = warm.generate(prompt, max_new_tokens=8, tenant="acme")
    assert again_warm.reused_tokens == full_blocks * bs
    assert res.token_ids == again_warm.token_ids


def test_native_prefill_reply_equals_a_cold_full_prefill(fresh: Callable[..., Engine]) -> None:
    eng = fresh("native")
    prefix = prefix_of(eng)
    prompt = chat(eng, "Why do services use connection pools?")
    out = eng.prefill_prefix(prefix, tenant="acme", chunk=32)  # several chunks
    bs = eng.cache.block_size
    assert out.computed_tokens == len(prefix) // bs * bs and not out.preempted
    res = eng.generate(prompt, max_new_tokens=8, tenant="acme")
    assert res.reused_tokens == out.computed_tokens
    cold = eng.generate(prompt, max_new_tokens=8, tenant="acme", use_cache=False)
    assert res.token_ids == cold.token_ids


def test_background_prefiller_runs_jobs_in_order(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    order: list[str] = []

    def job_a(stop: Callable[[], bool]) -> PrefillOutcome:
        order.append("a")
        return eng.prefill_prefix(prefix, tenant="acme", should_stop=stop)

    def job_b(stop: Callable[[], bool]) -> int:
        order.append("b")
        return 7

    with BackgroundPrefiller(eng) as bg:
        first = bg.submit(job_a, label="a")
        second = bg.submit(job_b, label="b")
        assert bg.wait_idle(timeout=60)
        assert second.result() == 7
        out = first.result()
        assert out.computed_tokens == len(prefix) // eng.cache.block_size * 16
        stats = bg.stats()
    assert order == ["a", "b"]
    assert stats["jobs_done"] == 2 and stats["jobs_preempted"] == 0
    assert stats["cpu_s"] >= out.cpu_s > 0


def test_to_host_spills_and_the_next_request_warms_them(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    dev0, host0 = free(eng)
    out = eng.prefill_prefix(prefix, tenant="acme", to_host=True)
    k = len(out.block_ids)
    assert k == len(prefix) // eng.cache.block_size and out.tier == "host"
    assert all(eng.cache.metadata.get(b).tier is Tier.HOST for b in out.block_ids)
    assert free(eng) == (dev0, host0 - k)
    res = eng.generate(chat(eng, "Why do services use connection pools?"), max_new_tokens=4,
                       tenant="acme")
    assert res.reused_tokens == out.computed_tokens
    assert res.warmed_tokens == out.computed_tokens


def test_to_host_with_a_full_host_tier_stays_on_device(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", host=2)
    out = eng.prefill_prefix(prefix_of(eng), tenant="acme", to_host=True)
    assert out.block_ids and out.tier == "device"
    assert "host tier full" in out.reason and "num_host_blocks" in out.reason
    assert all(eng.cache.metadata.get(b).tier is Tier.DEVICE for b in out.block_ids)


def test_hold_leaves_one_reference_per_block(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    dev0, host0 = free(eng)
    out = eng.prefill_prefix(prefix, tenant="acme", to_host=True, hold=True)
    assert out.tier == "host"
    assert [eng.cache.metadata.get(b).ref_count for b in out.block_ids] == [1] * len(
        out.block_ids)
    # Held blocks survive pressure on their tier; the holder frees them.
    eng.cache.release(list(out.block_ids))
    eng.cache.remove_blocks(list(out.block_ids))
    assert free(eng) == (dev0, host0)


def test_a_full_device_tier_is_reported_and_nothing_leaks(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", device=3)
    before = free(eng)
    out = eng.prefill_prefix(prefix_of(eng), tenant="acme")
    assert out.block_ids == () and out.computed_tokens == 0
    assert out.reason.startswith("device tier full:") and "num_device_blocks" in out.reason
    assert free(eng) == before


def test_short_input_and_bad_arguments(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    out = eng.prefill_prefix([1, 2, 3], tenant="acme")
    assert out.computed_tokens == 0 and "fewer than 16 tokens" in out.reason
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        eng.prefill_prefix([1] * 32, tenant="acme", chunk=0)
    with pytest.raises(ValueError, match="tenant"):
        eng.prefill_prefix([1] * 32, tenant="bad tenant!")


def test_tenants_do_not_share_prefilled_blocks(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    out = eng.prefill_prefix(prefix, tenant="acme")
    prompt = chat(eng, "Why do services use connection pools?")
    assert eng.generate(prompt, max_new_tokens=1, tenant="globex").reused_tokens == 0
    theirs = eng.prefill_prefix(prefix, tenant="globex")  # its own request's blocks
    assert theirs.reused_tokens == out.computed_tokens and theirs.block_ids == ()
    globex = eng.cache.lookup(eng.cache.block_keys(prefix, "globex"), "globex")
    assert len(globex) == len(out.block_ids) and set(globex).isdisjoint(out.block_ids)


class StopAfter:
    """A should_stop that turns true on its ``n``-th call (1-based)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.calls = 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls >= self.n


def test_should_stop_mid_chunk_keeps_the_finished_chunks_and_leaks_nothing(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    bs = eng.cache.block_size
    dev0, host0 = free(eng)
    layers = eng.model.num_layers
    # Chunk 1: one check before it and one per layer; chunk 2 stops at its 5th layer.
    stop = StopAfter((1 + layers) + 1 + 5)
    out = eng.prefill_prefix(prefix, tenant="acme", should_stop=stop, chunk=2 * bs)
    assert out.preempted and out.reason == ""
    assert out.computed_tokens == 2 * bs and len(out.block_ids) == 2
    keys = eng.cache.block_keys(prefix, "acme")
    assert eng.cache.lookup(keys, "acme") == list(out.block_ids)  # a prefix, registered
    assert free(eng) == (dev0 - 2, host0)  # the interrupted chunk's blocks were freed
    assert all(m.ref_count == 0 for m in eng.cache.metadata.of_tenant("acme"))
    # Stopped before it starts: nothing done, said so.
    idle = eng.prefill_prefix(prefix, tenant="acme", should_stop=lambda: True)
    assert idle.preempted and idle.block_ids == () and "preempted" in idle.reason
    # Resuming reuses what was done and computes the rest.
    rest = eng.prefill_prefix(prefix, tenant="acme", chunk=2 * bs)
    assert rest.reused_tokens == 2 * bs
    assert rest.computed_tokens == len(prefix) // bs * bs - 2 * bs


def test_a_foreground_request_mid_prefill_is_served_first(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4", device=256)
    bs = eng.cache.block_size
    long_prefix = chat(eng, "Why do services use connection pools?", system=SYSTEM * 6)
    prompt = chat(eng, "Why do services use connection pools?")
    assert len(long_prefix) > 6 * 2 * bs
    events: list[str] = []
    in_second_chunk = threading.Event()
    layers = eng.model.num_layers

    class Watch:
        """Once the job is inside its second chunk, wait for the request to queue."""

        calls = 0

        def __call__(self) -> bool:
            self.calls += 1
            if self.calls == (1 + layers) + 2:
                in_second_chunk.set()
                waited = 0
                while eng.foreground_gate.waiting == 0 and waited < 3000:
                    threading.Event().wait(0.01)
                    waited += 1
                events.append("request queued")
            return False

    def on_token(_: int) -> None:
        if "request first token" not in events:
            events.append("request first token")

    replies = []
    with BackgroundPrefiller(eng) as bg:
        watch = Watch()
        fut = bg.submit(lambda stop: eng.prefill_prefix(
            long_prefix, tenant="acme", chunk=2 * bs,
            should_stop=lambda: stop() or watch()), label="long")
        assert in_second_chunk.wait(60)
        fg = threading.Thread(target=lambda: replies.append(eng.generate(
            prompt, max_new_tokens=4, tenant="acme", on_token=on_token)))
        fg.start()
        out = fut.result(timeout=60)
        events.append("prefill returned")
        fg.join(60)
        stats = bg.stats()
    assert out.preempted and out.computed_tokens == 2 * bs
    assert events[0] == "request queued"
    assert set(events[1:]) == {"request first token", "prefill returned"}
    assert replies and replies[0].reused_tokens == 2 * bs  # the finished chunk, registered
    assert eng.last_foreground_wait_ms > 0
    assert stats["jobs_preempted"] == 1
    assert all(m.ref_count == 0 for m in eng.cache.metadata.of_tenant("acme"))


def test_prefiller_held_cancel_and_close(fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    ran: list[str] = []
    bg = BackgroundPrefiller(eng)
    with bg.held():
        queued = bg.submit(lambda stop: ran.append("queued"), label="q")
        assert not bg.wait_idle(timeout=0.2)  # held: it does not start
        assert ran == []
    assert bg.wait_idle(timeout=10) and ran == ["queued"] and queued.done()
    # A running job is stopped (and waited for) when the prefiller is held.
    started = threading.Event()

    def spin(stop: Callable[[], bool]) -> str:
        started.set()
        while not stop():
            threading.Event().wait(0.005)
        return "stopped"

    running = bg.submit(spin, label="spin")
    assert started.wait(10)
    with bg.held():
        assert running.done() and running.result() == "stopped"
        later = [bg.submit(lambda stop: ran.append("never"), label=f"x{i}") for i in range(3)]
        assert bg.cancel_pending() == 3
    assert all(f.cancelled() for f in later)
    failing = bg.submit(lambda stop: 1 / 0, label="boom")
    with pytest.raises(ZeroDivisionError):
        failing.result(timeout=10)
    bg.close()
    bg.close()  # idempotent
    stats = bg.stats()
    assert stats["jobs_cancelled"] == 3 and stats["jobs_preempted"] == 1
    assert stats["jobs_failed"] == 1 and stats["jobs_done"] == 3
    assert ran == ["queued"]
    with pytest.raises(RuntimeError, match="closed"):
        bg.submit(lambda stop: None)


def test_a_stopped_prefill_frees_its_chunk_and_close_ends_the_worker(
        fresh: Callable[..., Engine]) -> None:
    eng = fresh("tq4")
    prefix = prefix_of(eng)
    before = free(eng)
    inside = threading.Event()
    release = threading.Event()
    calls = StopAfter(2)

    def watch() -> bool:  # the 2nd poll is inside the first chunk: let the test act
        if calls():
            inside.set()
            assert release.wait(30)
        return False

    bg = BackgroundPrefiller(eng)
    fut = bg.submit(lambda stop: eng.prefill_prefix(
        prefix, tenant="acme", should_stop=lambda: stop() or (not inside.is_set() and watch())))
    assert inside.wait(60)
    bg.stop_running()
    release.set()
    out = fut.result(timeout=60)
    bg.close()
    assert out.preempted and out.block_ids == () and out.computed_tokens == 0
    assert free(eng) == before
    assert all(m.ref_count == 0 for m in eng.cache.metadata.of_tenant("acme"))
    assert bg.stats()["jobs_preempted"] == 1
    assert not bg._thread.is_alive()
