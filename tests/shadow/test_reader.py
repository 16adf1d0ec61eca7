"""The recovery's read-ahead: in order, never more reads in flight than free buffers."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from shadow._reader import _BUFFER_SETS, prefetched


def _chunks(n: int) -> Any:
    """Stand-ins for planned chunks: ``prefetched`` only hands them to the read."""
    return list(range(n))


def test_reads_run_ahead_but_never_into_the_buffer_being_imported() -> None:
    lock = threading.Lock()
    started: list[int] = []

    def read(chunk: Any) -> Any:
        with lock:
            started.append(chunk)
        return chunk

    consumed: list[Any] = []
    for got in prefetched(read, _chunks(10)):
        # the chunk being imported and at most the next two are read, none further
        with lock:
            assert max(started) <= int(got) + _BUFFER_SETS - 1  # type: ignore[call-overload]
        consumed.append(got)
    assert consumed == list(range(10))
    assert sorted(started) == list(range(10))


def test_a_consumer_that_stops_early_leaves_no_read_running() -> None:
    gate = threading.Event()
    finished = []

    def read(chunk: Any) -> Any:
        if chunk == 1:
            gate.wait(5)
        finished.append(chunk)
        return chunk

    gen = prefetched(read, _chunks(6))
    assert next(gen) == 0
    threading.Timer(0.05, gate.set).start()  # chunk 1's read, if started, ends during close
    gen.close()  # each queued read is cancelled, or awaited if it had started
    done = list(finished)
    assert set(done) <= {0, 1, 2}
    gate.wait(0.2)
    assert finished == done  # nothing ran after close returned


def test_errors_reach_the_consumer() -> None:
    def read(chunk: Any) -> Any:
        if chunk == 2:
            raise OSError("disk gone")
        return chunk

    gen = prefetched(read, _chunks(5))
    assert [next(gen), next(gen)] == [0, 1]
    with pytest.raises(OSError, match="disk gone"):
        next(gen)
