"""One naming rule for tenants and session ids (gpu_cache.ids)."""

from __future__ import annotations

import pytest

from gpu_cache import InvalidNameError, validate_name, validate_tenant


@pytest.mark.parametrize("name", ["a", "acme", "agent.tmp-1", "t_1:x@y-z", "A" * 128])
def test_valid_names_pass_unchanged(name: str) -> None:
    assert validate_name(name) == name
    assert validate_tenant(name) == name


@pytest.mark.parametrize("bad", [
    "", "acme\n", "ac\nme", "a\tb", "a b", "a\x00b", "a\x7fb", "-lead", ".hidden", "a/b",
    "a\\b", "a..b", "A" * 129, "index.json", "é",
], ids=repr)
def test_bad_names_raise_one_line_errors(bad: str) -> None:
    with pytest.raises(InvalidNameError) as info:
        validate_tenant(bad)
    message = str(info.value)
    assert "\n" not in message and "tenant" in message


@pytest.mark.parametrize("bad", [None, 5, b"acme", {}], ids=repr)
def test_non_strings_are_refused(bad: object) -> None:
    with pytest.raises(InvalidNameError, match="must be a str"):
        validate_name(bad, "session id")


def test_invalid_name_error_is_a_value_error() -> None:
    # Callers that caught ValueError for bad tenants keep working.
    assert issubclass(InvalidNameError, ValueError)
