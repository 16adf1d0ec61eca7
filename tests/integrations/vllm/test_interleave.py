"""The side-by-side run's pieces: the rotating order, the quiet wait, the memory check."""

from __future__ import annotations

import pytest

from integrations.vllm.bench import interleave
from integrations.vllm.bench.interleave import check_memory, quiet, rotation, start_lanes


def test_the_order_rotates_so_each_configuration_goes_first_once_per_round() -> None:
    names = ["ceiling", "apc", "connector"]
    firsts = [rotation(names, i)[0] for i in range(6)]
    assert firsts == ["ceiling", "apc", "connector"] * 2
    assert all(sorted(rotation(names, i)) == sorted(names) for i in range(6))
    assert rotation([], 3) == []


def test_the_machine_is_quiet_when_its_cpus_were_mostly_idle_between_samples() -> None:
    # (busy, idle) jiffies: 10 of 100 busy is quiet below 0.25, 40 of 100 is not
    assert quiet((1000, 5000), (1010, 5090), busy_below=0.25)
    assert not quiet((1000, 5000), (1040, 5060), busy_below=0.25)
    assert quiet((1000, 5000), (1000, 5000), busy_below=0.25)  # no time passed


def test_servers_that_do_not_fit_are_refused_with_what_to_do(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(interleave, "available_gib", lambda: 3 * interleave.SERVER_GIB)
    check_memory(3)
    with pytest.raises(SystemExit) as exc:
        check_memory(2, extra_gib=interleave.SERVER_GIB + 0.5)  # their KV and DDR slots
    with pytest.raises(SystemExit) as exc:
        check_memory(4)
    message = str(exc.value)
    assert "4 vLLM servers" in message and "--configs" in message and "--sequential" in message


def test_a_lane_counts_its_kv_blocks_and_its_ddr_tier_before_it_starts() -> None:
    from integrations.vllm.bench.agents_bench import SETUPS, allocated_bytes

    sizes = {"bytes_per_block_fp16": 1000, "kv_blocks_pressure": 10, "kv_blocks_ceiling": 50,
             "host_blocks": 20, "budget_bytes": 30_000}
    assert allocated_bytes(SETUPS["apc"], sizes) == 10 * 2000  # float32 KV only
    assert allocated_bytes(SETUPS["ceiling"], sizes) == 50 * 2000
    assert allocated_bytes(SETUPS["connector"], sizes) == 10 * 2000 + 20 * 1000
    # the connector that holds everything: 8 budgets of DDR slots (7 GiB on the bench)
    assert allocated_bytes(SETUPS["connector_all"], sizes) == 10 * 2000 + 160 * 1000
    assert allocated_bytes(SETUPS["lmcache"], sizes) == 10 * 2000 + 30_000


class _Lane:
    """A lane that records its stop and fails to start when told to."""

    def __init__(self, name: str, fails: bool) -> None:
        self.name, self.fails, self.stopped = name, fails, False

    def start(self) -> _Lane:
        if self.fails:
            raise RuntimeError(f"{self.name} did not come up")
        return self

    def stop(self) -> None:
        self.stopped = True


def test_a_lane_that_does_not_start_is_stopped_and_reported_unless_required() -> None:
    made: dict[str, _Lane] = {}

    def make(name: str) -> _Lane:
        made[name] = _Lane(name, fails=name == "lmcache")
        return made[name]

    errors: dict[str, str] = {}
    lanes = start_lanes(["ceiling", "lmcache", "apc"], make, errors, required="ceiling")
    assert list(lanes) == ["ceiling", "apc"] and made["lmcache"].stopped
    assert errors == {"lmcache": "RuntimeError: lmcache did not come up"}
    made.clear()
    with pytest.raises(RuntimeError):
        start_lanes(["apc", "lmcache"], make, {}, required="lmcache")
    assert made["apc"].stopped  # what had started is stopped when the required one fails
