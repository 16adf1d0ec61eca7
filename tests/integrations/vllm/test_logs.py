"""contextkit's lines inside vLLM's log carry vLLM's level and time (issue 56 item 5)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from integrations.vllm.logs import adopt_vllm_logging


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A stand-in for the ``vllm`` logger as vLLM configures it, and clean contextkit
    loggers; everything restored afterwards."""
    names = ("vllm-test", "ck-test-a", "ck-test-b")
    saved = {n: (logging.getLogger(n).handlers[:], logging.getLogger(n).level,
                 logging.getLogger(n).propagate) for n in names}
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s] %(message)s"))
    vllm = logging.getLogger("vllm-test")
    vllm.addHandler(handler)
    vllm.setLevel(logging.INFO)
    yield vllm, out
    for name, (handlers, level, propagate) in saved.items():
        log = logging.getLogger(name)
        log.handlers[:] = handlers
        log.setLevel(level)
        log.propagate = propagate


def test_contextkit_lines_take_vllms_format_once(
        loggers: tuple[logging.Logger, io.StringIO]) -> None:
    _, out = loggers
    assert adopt_vllm_logging(("ck-test-a",), source="vllm-test") == ["ck-test-a"]
    logging.getLogger("ck-test-a.store").warning("labels ignored")
    line = out.getvalue().strip()
    assert line.startswith("WARNING ") and line.endswith("ck-test-a.store] labels ignored")
    # a second connector (the scheduler's, then the worker's) adds no second handler
    assert adopt_vllm_logging(("ck-test-a",), source="vllm-test") == []
    logging.getLogger("ck-test-a").info("once")
    assert out.getvalue().count("once") == 1


def test_a_configured_logger_or_an_unconfigured_vllm_is_left_alone(
        loggers: tuple[logging.Logger, io.StringIO]) -> None:
    own = logging.getLogger("ck-test-b")
    own.addHandler(logging.NullHandler())
    assert adopt_vllm_logging(("ck-test-b",), source="vllm-test") == []
    assert adopt_vllm_logging(("ck-test-a",), source="no-such-vllm-logger") == []
    assert logging.getLogger("ck-test-a").handlers == []
