"""The metrics ledger: what a worker's background threads count between engine steps
reaches the API server's metrics at its next poll, once, and leaves no file behind."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from integrations.vllm.ledger import Ledger, LedgerReader, ledger_path
from integrations.vllm.metrics import COUNTERS, GAUGES, ContextKitPromMetrics
from tests.integrations.vllm.prometheus_registry import metric_types, samples

E0 = (("engine", "0"), ("model_name", "m"))


def _ledger(directory: Path, instance: str = "inst", engine: int = 0) -> Ledger:
    return Ledger(ledger_path(instance, engine, directory), COUNTERS, GAUGES)


def test_the_reader_sees_increments_once_and_gauges_when_they_change(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path)
    reader = LedgerReader("inst", tmp_path)
    assert reader.changes() == {}  # nothing published yet
    ledger.count("shared_puts", 2)
    ledger.count("shared_bytes_up", 4096)
    ledger.set_gauge("shared_lag_seconds", 0.25)
    assert reader.changes() == {}  # counted, not yet published
    ledger.publish()
    assert reader.changes() == {0: {"counters": {"shared_puts": 2, "shared_bytes_up": 4096},
                                    "by_layer": {}, "gauges": {"shared_lag_seconds": 0.25}}}
    assert reader.changes() == {}  # the same totals again: nothing new
    ledger.count("shared_puts")
    ledger.publish()
    assert reader.changes() == {0: {"counters": {"shared_puts": 1}, "by_layer": {},
                                    "gauges": {}}}


def test_engines_and_servers_keep_their_own_ledgers(tmp_path: Path) -> None:
    mine0, mine1, other = _ledger(tmp_path), _ledger(tmp_path, engine=1), _ledger(
        tmp_path, instance="other")
    for ledger, n in ((mine0, 1), (mine1, 5), (other, 100)):
        ledger.count("shared_puts", n)
        ledger.publish()
    got = LedgerReader("inst", tmp_path).changes()
    assert {e: d["counters"] for e, d in got.items()} == {0: {"shared_puts": 1},
                                                          1: {"shared_puts": 5}}


def test_a_restarted_worker_counts_from_zero_not_negative(tmp_path: Path) -> None:
    first = _ledger(tmp_path)
    first.count("shared_puts", 10)
    first.publish()
    reader = LedgerReader("inst", tmp_path)
    reader.changes()
    again = _ledger(tmp_path)
    again.count("shared_puts", 3)
    again.publish()
    assert reader.changes()[0]["counters"] == {"shared_puts": 3}


def test_names_are_checked_and_close_removes_the_file(tmp_path: Path) -> None:
    ledger = _ledger(tmp_path / "ledgers")
    with pytest.raises(KeyError, match="unknown counter"):
        ledger.count("shared_putz")
    with pytest.raises(KeyError, match="unknown gauge"):
        ledger.set_gauge("shared_lagg", 1.0)
    ledger.count("shared_puts")
    ledger.publish()
    assert ledger.path is not None and json.loads(ledger.path.read_text())["counters"] == {
        "shared_puts": 1}
    assert ((tmp_path / "ledgers").stat().st_mode & 0o777) == 0o700  # private to the user
    ledger.close()
    assert list((tmp_path / "ledgers").iterdir()) == []


def test_a_directory_others_can_write_gets_no_ledger(tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    shared = tmp_path / "open"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    with caplog.at_level(logging.WARNING):
        ledger = Ledger(ledger_path("inst", 0, shared), COUNTERS, GAUGES)
    assert ledger.path is None and "not private" in caplog.text
    ledger.count("shared_puts")
    ledger.publish()  # kept in memory only
    assert list(shared.iterdir()) == [] and ledger.totals()["counters"] == {"shared_puts": 1}


class _VllmConfig:
    instance_id = "inst"
    kv_transfer_config = None


def _prom(registry: CollectorRegistry, directory: Path, poll_s: float) -> ContextKitPromMetrics:
    return ContextKitPromMetrics(_VllmConfig(), metric_types(registry), ["model_name", "engine"],
                                 {0: ["m", "0"]}, ledger_dir=directory, ledger_poll_s=poll_s)


def test_prometheus_adds_the_ledger_to_what_steps_carry(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    prom = _prom(registry, tmp_path, poll_s=0)
    prom.observe({"counters": {"shared_gets": 2, "shared_puts": 1}}, 0)  # a step's stats
    ledger = _ledger(tmp_path)
    ledger.count("shared_puts", 3)
    ledger.set_gauge("shared_lag_seconds", 0.5)
    ledger.publish()
    prom.poll_ledgers()
    prom.poll_ledgers()  # no double count
    got = samples(registry)
    assert got[("vllm:contextkit_shared_puts_total", E0)] == 4
    assert got[("vllm:contextkit_shared_gets_total", E0)] == 2
    assert got[("vllm:contextkit_shared_lag_seconds", E0)] == 0.5


def test_the_api_server_polls_on_its_own(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    _prom(registry, tmp_path, poll_s=0.05)
    ledger = _ledger(tmp_path)
    ledger.count("shared_puts", 7)
    ledger.publish()
    value: Any = None
    for _ in range(400):  # no step, no scrape-side call: the poller records it
        value = samples(registry).get(("vllm:contextkit_shared_puts_total", E0))
        if value == 7:
            break
        time.sleep(0.05)
    assert value == 7
