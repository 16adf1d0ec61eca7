"""Bench JSON says, from code, where and how it was produced (issue 58)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from contextkit.bench import BENCHMARKS, load
from contextkit.bench.figures import MACHINES, RESULTS
from contextkit.bench.provenance import Provenance, cpu_info, git_state
from contextkit.cli import main

#: What every file written since provenance existed must carry.
REQUIRED = ("command", "commit", "dirty", "cpu_model", "cpu_flags", "load_before",
            "load_after", "started", "gpu")

CPUINFO = """processor\t: 0
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu sse4_1 sse4_2 avx avx2 fma f16c avx512f avx512_bf16 amx_tile aes
processor\t: 1
model name\t: AMD EPYC 9R14 96-Core Processor
flags\t\t: fpu
"""


def test_cpu_info_takes_the_model_and_only_the_simd_flags() -> None:
    info = cpu_info(CPUINFO)
    assert info["cpu_model"] == "AMD EPYC 9R14 96-Core Processor"
    assert info["cpu_flags"] == ["amx_tile", "avx", "avx2", "avx512_bf16", "avx512f", "f16c",
                                 "fma", "sse4_1", "sse4_2"]


def test_git_state_sees_a_dirty_tree_and_none_outside_git(tmp_path: Path) -> None:
    assert git_state(tmp_path) == {"commit": None, "dirty": None}
    run = lambda *cmd: subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True,
                                      capture_output=True)
    run("init", "-q")
    (tmp_path / "a.txt").write_text("1")
    run("add", "a.txt")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    clean = git_state(tmp_path)
    assert len(clean["commit"]) == 40 and clean["dirty"] is False
    (tmp_path / "a.txt").write_text("2")
    assert git_state(tmp_path)["dirty"] is True


def test_a_run_records_its_command_and_both_loads() -> None:
    record = Provenance.start(["contextkit", "bench", "ttft", "--note", "two words"]).finish()
    assert record["command"] == "contextkit bench ttft --note 'two words'"
    assert set(REQUIRED) <= set(record)
    assert record["started"] <= record["finished"]


def test_the_cli_stamps_stdout_and_the_out_file(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "tiers", "--json", "--blocks", "64", "--layers", "1", "--repeats", "1"]
    assert main(argv) == 0
    printed = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert printed["provenance"]["command"] == "contextkit " + " ".join(argv)
    assert printed["provenance"]["commit"] == git_state()["commit"]


def test_benches_with_a_json_out_file_leave_the_writing_to_the_cli() -> None:
    """A bench that wrote ``--out`` itself would write it without provenance."""
    for name in BENCHMARKS:
        if getattr(load(name), "OUT_IS_JSON", False):
            source = Path(load(name).__file__).read_text()
            assert "write_result(" not in source, name


def test_every_committed_json_says_where_it_ran() -> None:
    """Files from before provenance are listed by hand; every later one records it."""
    listed = set(json.loads(MACHINES.read_text()))
    for path in sorted(RESULTS.glob("*.json")):
        if path.name in listed or path == MACHINES:
            continue
        data = json.loads(path.read_text())
        prov = data.get("provenance")
        assert isinstance(prov, dict), f"{path.name}: no provenance and not in machines.json"
        missing = [k for k in REQUIRED if k not in prov]
        assert not missing, f"{path.name}: provenance lacks {missing}"
