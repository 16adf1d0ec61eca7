"""``contextkit bench decode``: arguments, the llama.cpp child's protocol and failures,
and a tiny real run of the contextkit rows.

llama.cpp itself is not installed in the test virtualenv. The parent is tested against
real child processes: the real worker script (which answers that llama_cpp is missing),
and a stand-in interpreter that implements the worker's JSON-lines protocol in plain
Python (it can be told to die, as a crashing native library would).
"""

from __future__ import annotations

import argparse
import json
import math
import stat
import sys
from pathlib import Path
from typing import Any

import pytest

from contextkit.bench import decode
from contextkit.bench.decode import LlamaCppError, LlamaCppPeer, parse_contexts
from contextkit.cli.commands import build_parser, main

# A stand-in for the llama.cpp virtualenv's python: ignores the worker path it is given
# and speaks the worker's protocol; DIE_AT names the op (and its count) that kills it.
_FAKE = '''#!{python}
import json, sys
DIE_AT = {die_at!r}
seen = {{}}
def send(obj):
    sys.stdout.write(json.dumps(obj) + "\\n"); sys.stdout.flush()
send({{"ok": True, "ready": True}})
kv = []
for line in sys.stdin:
    req = json.loads(line)
    op = req["op"]
    seen[op] = seen.get(op, 0) + 1
    if DIE_AT and DIE_AT == (op, seen[op]):
        sys.stderr.write("GGML_ASSERT: fake native abort\\n"); sys.stderr.flush()
        sys.exit(134)
    if op == "load":
        send({{"ok": True, "n_ctx": req["n_ctx"], "model_bytes": 96_000_000,
              "openmp": True, "version": "fake", "kv_type": "f16",
              "n_threads": req["n_threads"], "flash_attn": req["flash_attn"]}})
    elif op == "generate":
        n = req["new_tokens"]
        kv = list(req["ids"])
        send({{"ok": True, "prefill_s": 1e-5 * len(kv), "decode_s": 0.01 * (n - 1),
              "token_ids": [7] * n}})
    elif op == "reuse":
        ids = req["ids"]
        keep = 0
        while keep < min(len(kv), len(ids) - 1) and kv[keep] == ids[keep]:
            keep += 1
        kv = list(ids) + list(req["then"])
        send({{"ok": True, "ttft_s": 1e-4 * (len(ids) - keep), "reused_tokens": keep,
              "computed_tokens": len(ids) - keep, "first_token": 7}})
    elif op == "quit":
        send({{"ok": True}}); break
    else:
        send({{"ok": False, "error": "ValueError: unknown op " + repr(op)}})
'''


def _fake_python(tmp_path: Path, die_at: tuple[str, int] | None = None) -> Path:
    path = tmp_path / "fake-llamacpp-python"
    path.write_text(_FAKE.format(python=sys.executable, die_at=die_at))
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["bench", "decode", *argv])


# ---------------------------------------------------------------------- arguments
def test_defaults_match_the_issue() -> None:
    args = _parse()
    assert args.contexts == (1024, 6144, 16384)
    assert (args.new_tokens, args.rounds, args.threads, args.turns) == (48, 3, 2, 8)
    assert args.weights == "int8" and args.no_llamacpp is False
    assert args.fidelity_turns == 2
    assert parse_contexts("16384, 1024,6144") == (1024, 6144, 16384)


@pytest.mark.parametrize(("argv", "message"), [
    (["--contexts", "1024,abc"], "comma-separated token counts"),
    (["--contexts", "1024,1"], "each context must be >= 2 tokens, got 1"),
    (["--contexts", "64,64"], "contexts repeat a size"),
    (["--new-tokens", "1"], "must be >= 2, got 1"),
    (["--rounds", "0"], "must be >= 1, got 0"),
    (["--threads", "x"], "must be an integer >= 1"),
    (["--weights", "fp8"], "invalid choice: 'fp8'"),
    (["--fidelity-turns", "-1"], "must be >= 0, got -1"),
])
def test_bad_values_are_one_usage_line(argv: list[str], message: str,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        _parse(*argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert message in err[-1] and "Traceback" not in "".join(err)


# ---------------------------------------------------------------------- the child
def test_the_real_worker_without_llama_cpp_says_so_in_one_line(tmp_path: Path) -> None:
    """The worker script itself, run by this virtualenv's Python (no llama_cpp here)."""
    with pytest.raises(LlamaCppError) as exc:
        LlamaCppPeer(sys.executable, log=tmp_path / "worker.log")
    text = str(exc.value)
    assert "cannot import llama_cpp" in text and "\n" not in text


def test_a_missing_interpreter_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(LlamaCppError) as exc:
        LlamaCppPeer(tmp_path / "nope" / "python", log=tmp_path / "worker.log")
    assert "cannot start the llama.cpp worker" in str(exc.value)
    assert "\n" not in str(exc.value)


def test_protocol_replies_and_errors(tmp_path: Path) -> None:
    peer = LlamaCppPeer(_fake_python(tmp_path), log=tmp_path / "worker.log")
    try:
        info = peer.load("model.gguf", n_ctx=4096, threads=2, flash_attn=True)
        assert info["n_ctx"] == 4096 and "ok" not in info
        cold = peer.generate(list(range(100)), 5)
        assert cold["token_ids"] == [7] * 5 and cold["decode_s"] == pytest.approx(0.04)
        first = peer.reuse([*range(90), 5, 6], then=[1, 2])
        assert first["reused_tokens"] == 90 and first["computed_tokens"] == 2
        with pytest.raises(LlamaCppError, match="unknown op 'bogus'"):
            peer.request("bogus")
        # an error reply does not end the child: it keeps serving
        again = peer.reuse([*range(90), 5, 6, 1, 2, 3])
        assert again["reused_tokens"] == 94
    finally:
        peer.close()
    assert peer.proc.returncode == 0  # it quit when asked


def test_a_child_that_dies_is_one_line_with_its_last_words(tmp_path: Path) -> None:
    peer = LlamaCppPeer(_fake_python(tmp_path, ("generate", 1)), log=tmp_path / "w.log")
    peer.load("model.gguf", n_ctx=512, threads=2, flash_attn=False)
    with pytest.raises(LlamaCppError) as exc:
        peer.generate([1, 2, 3], 4)
    text = str(exc.value)
    assert "exited (status 134)" in text and "GGML_ASSERT: fake native abort" in text
    assert "\n" not in text
    with pytest.raises(LlamaCppError, match="not running"):
        peer.generate([1, 2, 3], 4)
    peer.close()


def test_missing_llamacpp_leaves_a_note_that_says_how_to_install(tmp_path: Path) -> None:
    args = _parse("--llamacpp-python", str(tmp_path / "absent" / "python"))
    slot = decode._Slot(args, 4096, tmp_path)
    assert slot.peer is None and slot.info is None
    assert slot.note is not None and "make bench-decode" in slot.note
    assert slot.call(LlamaCppPeer.generate, [1, 2], 2) is None


# ---------------------------------------------------------------------- real runs
def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["bench", "decode", "--json", *argv]) == 0
    return dict(json.loads(capsys.readouterr().out.strip().splitlines()[-1]))


def _positive(value: object) -> bool:
    return isinstance(value, float) and math.isfinite(value) and value > 0


TINY = ["--contexts", "64,128", "--new-tokens", "4", "--rounds", "1", "--turns", "2",
        "--scale", "0.3"]


@pytest.mark.slow
def test_tiny_run_reports_every_contextkit_field(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    r = _run([*TINY, "--no-llamacpp", "--fidelity-turns", "1", "--out", str(tmp_path)], capsys)
    assert r["bench"] == "decode" and r["contexts"] == [64, 128] and r["new_tokens"] == 4
    assert r["threads"] == 2 and r["weight_format"] == "int8"
    fid = r["weights_fidelity"]  # int8 against float32 weights on one replay prompt
    assert fid["weight_format"] == "int8" and fid["prompts"] == 1 and fid["tokens"] == 32
    assert 0.8 <= fid["top1_agreement"] <= 1.0 and 0.9 < fid["ppl_ratio"] < 1.1
    for engine in ("tq4", "native"):
        for ctx in ("64", "128"):
            for key in ("decode_tps", "prefill_s", "bytes_per_token", "gbps"):
                assert _positive(float(r[f"{key}_{engine}_{ctx}"])), (key, engine, ctx)
            # the reported rate is the rate of the bytes read
            assert r[f"gbps_{engine}_{ctx}"] == pytest.approx(
                r[f"bytes_per_token_{engine}_{ctx}"] * r[f"decode_tps_{engine}_{ctx}"] / 1e9)
            assert r[f"decode_tps_llamacpp_{ctx}"] is None
    weights = r["weight_bytes"]["tq4"]
    assert 100e6 < weights < 200e6  # SmolLM2-135M in int8 (+ scales), embedding row excluded
    # a longer context reads more K/V per token: 64 more tokens x 30 layers x 3 heads
    # x K and V x 64 float32
    assert (r["bytes_per_token_native_128"] - r["bytes_per_token_native_64"]
            == 64 * 30 * 3 * 2 * 64 * 4)
    assert _positive(r["memcpy_gbps"]) and _positive(r["ttft_cached_s_tq4"])
    assert _positive(r["tq4_vs_native_16k"])
    assert r["ratio_contexts"] == {"mid": 128, "long": 128}
    for key in ("decode_vs_llamacpp", "prefill_vs_llamacpp", "cached_ttft_vs_llamacpp_reuse",
                "ttft_cached_s_llamacpp", "llamacpp", "llamacpp_error"):
        assert r[key] is None, key
    assert "--no-llamacpp" in str(r["llamacpp_note"])
    replay = r["replay"]
    assert [t["turn"] for t in replay] == [1, 2]
    assert replay[0]["reused_tokens_tq4"] == 0 and replay[1]["reused_tokens_tq4"] > 1000
    assert Path(str(r["plot"])).stat().st_size > 10_000


@pytest.mark.slow
def test_a_peer_that_dies_mid_run_keeps_the_contextkit_rows(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The stand-in serves the decode rounds (warm-up + 2 contexts), then dies at the
    replay's first prefix-reuse request: its decode figures stay, its TTFT is null."""
    fake = _fake_python(tmp_path, ("reuse", 1))
    r = _run([*TINY, "--llamacpp-python", str(fake), "--fidelity-turns", "0", "--out",
              str(tmp_path)], capsys)
    assert r["llamacpp_note"] is None and r["weights_fidelity"] is None
    assert "exited (status 134)" in str(r["llamacpp_error"])
    info = r["llamacpp"]
    assert info["version"] == "fake" and info["threadpool"] == "openmp"
    assert info["n_threads"] == 2 and set(info["env"]) >= {"OMP_WAIT_POLICY"}
    # the fake decodes 3 tokens in 30 ms: 100 tok/s, whatever the context
    assert r["decode_tps_llamacpp_64"] == pytest.approx(100.0)
    assert r["decode_vs_llamacpp"] == pytest.approx(r["decode_tps_tq4_128"] / 100.0)
    assert r["prefill_vs_llamacpp"] == pytest.approx(128e-5 / r["prefill_s_tq4_128"])
    assert r["bytes_per_token_llamacpp_128"] == 96_000_000 + 30 * 3 * (128 + 2) * 2 * 64 * 2
    assert all(t["ttft_s_llamacpp"] is None for t in r["replay"])
    assert r["cached_ttft_vs_llamacpp_reuse"] is None and _positive(r["ttft_cached_s_tq4"])
    assert _positive(r["decode_tps_tq4_64"]) and _positive(r["decode_tps_native_128"])
