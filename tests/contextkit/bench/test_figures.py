"""The published figures are the committed JSON's: generated, never typed by hand."""

from __future__ import annotations

import re

import pytest

from contextkit.bench import figures

#: A measured number: a decimal, a ratio (``4.8x``), a rate or a duration with its unit.
MEASURED = re.compile(
    r"(?<![\w.-])\d[\d,]*(?:\.\d+)?\s?(?:x\b|ms\b|tokens/s|tok/s|GB/s|%)|(?<![\w.])\d+\.\d+")
#: Numbers that are not measurements (the interval's confidence level).
NOT_MEASURED = {"95%"}


def _outside_blocks(text: str) -> str:
    text = figures.BLOCK.sub("", text)
    return re.sub(r"```.*?```", "", text, flags=re.S)


@pytest.mark.parametrize("target", figures.TARGETS)
def test_every_figure_table_matches_its_json(target: str) -> None:
    text = (figures.ROOT / target).read_text()
    assert figures.BLOCK.search(text), f"{target} has no generated figure table"
    assert not figures.stale(text, figures.blocks()), (
        f"{target}: a figure table differs from bench/results; run "
        "`python -m contextkit.bench.figures`")


def test_a_number_edited_by_hand_is_caught() -> None:
    text = (figures.ROOT / "README.md").read_text()
    generated = figures.blocks()
    assert "| 5.80 |" in generated["headline"]
    edited = text.replace("| 5.80 |", "| 5.90 |", 1)
    assert edited != text
    assert figures.stale(edited, generated) == ["headline"]
    assert figures.rewrite(edited, generated) == text


@pytest.mark.parametrize("target", figures.TARGETS)
def test_no_measured_number_stands_outside_a_generated_table(target: str) -> None:
    loose = [m.group(0) for m in MEASURED.finditer(
        _outside_blocks((figures.ROOT / target).read_text()))]
    assert [n for n in loose if n not in NOT_MEASURED] == [], (
        f"{target}: measured numbers typed outside a generated table: add a Row to "
        "contextkit/bench/figures.py instead")


def test_the_loose_number_finder_finds_them() -> None:
    found = {m.group(0) for m in MEASURED.finditer(
        "TTFT 0.43 s, 14.5x faster, 206 ms, 42.7 tok/s, 12% of it; SmolLM2-135M, "
        "turns 5, 8 and 12, a 30 s think time, AVX2")}
    assert found == {"0.43", "14.5x", "206 ms", "42.7 tok/s", "12%"}


def test_every_file_says_where_it_was_run() -> None:
    for row in figures.ROWS:
        for name in row.files:
            assert figures.machine(name, figures.load(name))


def test_the_wilson_interval() -> None:
    lo, hi = figures.wilson(591, 608)
    assert lo < 591 / 608 < hi
    assert round(lo, 4) == 0.9557 and round(hi, 4) == 0.9825
    assert figures.wilson(10, 10)[1] == pytest.approx(1.0)
    with pytest.raises(ValueError):
        figures.wilson(0, 0)


def test_a_gate_is_judged_on_the_lower_end_of_its_interval() -> None:
    row = figures.Row("t", "agreement", ("x.json",), lambda d: d["k"] / d["n"],
                      fmt="{:.4f}", goal=figures.Goal(">=", 0.97),
                      interval=lambda d: figures.wilson(d["k"], d["n"]))
    value, _, status = figures.row_cells(row, [{"k": 591, "n": 608}])
    assert value.startswith("0.9720") and "not met" in status
    value, _, status = figures.row_cells(row, [{"k": 9950, "n": 10000}])
    assert "not met" not in status and "met" in status


def test_runs_that_missed_are_shown_beside_those_that_met() -> None:
    row = figures.Row("t", "speedup", ("a", "b", "c"), lambda d: d["v"],
                      goal=figures.Goal(">=", 3.5))
    value, _, status = figures.row_cells(row, [{"v": 3.63}, {"v": 3.47}, {"v": 4.39}])
    assert value == "median 3.63 (3 runs: 3.63, 3.47, 4.39)"
    assert "2 of 3 runs met it" in status


def test_identical_tokens_are_called_noise_not_a_speedup() -> None:
    same = {"cached_tokens": {"connector": [5, 5], "connector_lru": [4, 6], "ceiling": [6, 4]}}
    assert "timing difference is noise" in figures._vllm_same_tokens(same)
    differ = {"cached_tokens": {"connector": [5], "connector_lru": [4], "ceiling": [6]}}
    assert figures._vllm_same_tokens(differ) == ""
