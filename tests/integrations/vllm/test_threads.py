"""The connector's save thread leaves the cores to vLLM's forward (no vLLM needed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from gpu_cache.kernels.cpu_fused import limit_threads
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError

numba = pytest.importorskip("numba")


def _threads_in_background(threads: int) -> int:
    """The numba thread count inside a thread set up like the connector's save thread."""
    with ThreadPoolExecutor(1, initializer=limit_threads, initargs=(threads,)) as pool:
        return pool.submit(numba.get_num_threads).result()


def test_save_thread_kernels_run_on_one_thread_and_the_caller_keeps_its_own() -> None:
    assert _threads_in_background(ConnectorConfig().save_threads) == 1
    assert numba.get_num_threads() == numba.config.NUMBA_NUM_THREADS


def test_save_threads_is_capped_at_numbas_pool() -> None:
    assert _threads_in_background(10_000) == numba.config.NUMBA_NUM_THREADS


def test_save_threads_below_one_is_refused() -> None:
    with pytest.raises(ConnectorConfigError, match="save_threads must be a whole number >= 1"):
        ConnectorConfig(save_threads=0)


def test_save_threads_comes_from_the_extra_config() -> None:
    assert ConnectorConfig.from_extra_config({"save_threads": 2}, env={}).save_threads == 2
