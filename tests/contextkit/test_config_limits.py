"""The one check of durations, sizes and JSON input (contextkit.config.limits)."""

from __future__ import annotations

import argparse
import math

import pytest

from contextkit.config.limits import (
    MAX_JSON_BYTES,
    json_object,
    read_bounded,
    seconds,
    seconds_arg,
    size,
    size_arg,
)


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -1.0, 0, "1", True, None,
                                 10**400])
def test_a_duration_must_be_a_finite_positive_number(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^deadline_s must be a finite number of seconds > 0"):
        seconds(bad, "deadline_s")


def test_a_duration_may_be_zero_when_asked_and_comes_back_a_float() -> None:
    assert seconds(0, "interval_s", zero=True) == 0.0
    assert isinstance(seconds(2, "deadline_s"), float)
    with pytest.raises(ValueError, match=">= 0"):
        seconds(-0.5, "interval_s", zero=True)


@pytest.mark.parametrize("bad", [1.5, 2.0, -1, "3", True, math.nan])
def test_a_size_must_be_a_whole_number_in_range(bad: object) -> None:
    with pytest.raises(ValueError, match=r"^budget_mb must be a whole number >= 0"):
        size(bad, "budget_mb")


def test_sizes_keep_their_minimum_and_the_error_class_is_the_callers() -> None:
    class Mine(ValueError):
        pass

    assert size(0, "n") == 0 and size(7, "n", minimum=1) == 7
    with pytest.raises(Mine, match=">= 1, got 0"):
        size(0, "n", minimum=1, error=Mine)


def test_argparse_types_refuse_what_the_checks_refuse() -> None:
    parse = seconds_arg()
    assert parse("1.5") == 1.5
    for text in ("nan", "inf", "-1", "0", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="finite number of seconds > 0"):
            parse(text)
    assert seconds_arg(zero=True)("0") == 0.0
    assert size_arg(minimum=1)("4096") == 4096
    for text in ("1.5", "0", "many"):
        with pytest.raises(argparse.ArgumentTypeError, match="whole number >= 1"):
            size_arg(minimum=1)(text)


def test_json_input_is_bounded_in_size_and_nesting() -> None:
    assert json_object('{"a": [1, {"b": 2}]}', "config") == {"a": [1, {"b": 2}]}
    with pytest.raises(ValueError, match="nests deeper than"):
        json_object("[" * 100_000 + "]" * 100_000, "config")
    with pytest.raises(ValueError, match="nests deeper than"):
        json_object('{"a":' * 40 + "1" + "}" * 40, "config")
    with pytest.raises(ValueError, match="over 1 MiB"):
        json_object('{"a": "' + "x" * MAX_JSON_BYTES + '"}', "config")
    with pytest.raises(ValueError, match=r"^config is not JSON"):
        json_object("{oops", "config")
    with pytest.raises(ValueError, match="must be a JSON object"):
        json_object("[1]", "config")


def test_a_file_is_read_up_to_the_bound_only(tmp_path) -> None:
    (tmp_path / "ok.json").write_text("{}")
    assert read_bounded(tmp_path / "ok.json", "config file") == "{}"
    with pytest.raises(ValueError, match="over 1 MiB"):
        read_bounded("/dev/zero", "config file")
    (tmp_path / "bin").write_bytes(b"\xff\xfe")
    with pytest.raises(ValueError, match="UTF-8"):
        read_bounded(tmp_path / "bin", "config file")
