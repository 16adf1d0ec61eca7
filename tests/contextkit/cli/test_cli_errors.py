"""Every error a user can cause on the command line is one line on stderr saying what to do.

Missing or damaged stores, tier-status files, model directories and connector configs;
S3 without credentials or bucket (a real S3 endpoint over HTTP: moto's threaded
server); shadowed identities with fields of the wrong type; the top-level guard
(exit 2 for user errors, 1 plus a ``--debug`` hint for bugs, 130 for Ctrl-C).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import boto3
import moto.server as moto_server
import pytest
import torch

from contextkit.cli import commands as cli
from contextkit.cli.commands import main
from gpu_cache import TENSOR_NAMES, CacheConfig, CacheIdentity, Tier, TQGPUCache
from shadow import CacheShadow, ShadowConfig, ShadowStoreError

ROOT = Path(__file__).resolve().parents[3]
SMALL = CacheIdentity(model_id="test/tiny", num_layers=2, num_kv_heads=2, head_dim=16,
                      block_size=4, rotation_seed=7)
BUCKET = "ck-cli-errors"


def error_line(err: str) -> str:
    """The single line a user error prints; fails on tracebacks and extra lines."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("contextkit: error: "), lines[0]
    return lines[0]


def call(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """``main(argv)`` in-process: exit code, stdout, stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture(autouse=True)
def _no_ambient_config(monkeypatch: pytest.MonkeyPatch) -> None:
    # The developer's own store and key must not leak into what these tests see.
    monkeypatch.delenv("CONTEXTKIT_SHADOW_URL", raising=False)
    monkeypatch.delenv("CONTEXTKIT_SHADOW_KEY", raising=False)


def shadow_session(store: Path, session_id: str, num_blocks: int = 3,
                   tenants: tuple[str, ...] = ("default",)) -> Path:
    """Shadow a small real cache as ``session_id`` (block ``i`` of tenant
    ``tenants[i % len(tenants)]``); returns its manifest's path."""
    cache = TQGPUCache(SMALL, CacheConfig(num_device_blocks=8, num_host_blocks=16, device="cpu"))
    shape = (SMALL.num_layers, num_blocks, SMALL.block_size, SMALL.num_kv_heads)
    gen = torch.Generator().manual_seed(len(session_id))
    tensors = {
        n: (torch.randint(0, 256, (*shape, SMALL.head_dim // 2), generator=gen,
                          dtype=torch.uint8) if n.endswith("packed")
            else torch.rand(shape, generator=gen) + 0.5)
        for n in TENSOR_NAMES}
    bs = SMALL.block_size
    metas = [{"source_layer": "memories", "importance": 0.5,
              "tenant_slug": tenants[i % len(tenants)],
              "token_range": (i * bs, i * bs + bs), "num_tokens": bs,
              "key": cache.block_keys([i * 31 + t for t in range(bs)],
                                      tenants[i % len(tenants)])[0]}
             for i in range(num_blocks)]
    assert cache.import_blocks(tensors, metas, tier=Tier.HOST) is not None
    with CacheShadow(cache, f"file://{store}", session_id,
                     config=ShadowConfig(autostart=False)) as shadow:
        shadow.shadow_now()
    return store / session_id / "manifest.json"


# ------------------------------------------------------------------------- stores

@pytest.mark.parametrize("form", ["path", "file-url"])
@pytest.mark.parametrize("command", ["status", "recover"])
def test_a_missing_store_directory_is_an_error_and_is_not_created(
        command: str, form: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "no" / "store"
    url = str(missing) if form == "path" else f"file://{missing}"
    code, out, err = call(capsys, command, "--store", url, *(
        ["--no-progress"] if command == "recover" else []))
    line = error_line(err)
    assert code == 2 and out == ""
    assert f"no shadow store at {missing}" in line and "--store" in line
    assert not missing.exists() and not missing.parent.exists()


def test_a_missing_store_from_the_environment_names_the_variable(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("CONTEXTKIT_SHADOW_URL", f"file://{tmp_path / 'gone'}")
    code, _, err = call(capsys, "status")
    assert code == 2 and "CONTEXTKIT_SHADOW_URL" in error_line(err)
    (tmp_path / "afile").write_text("x")
    code, _, err = call(capsys, "status", "--store", str(tmp_path / "afile"))
    assert code == 2 and "is not a directory" in error_line(err)


def test_the_default_store_missing_means_nothing_shadowed_yet(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    code, out, err = call(capsys, "status")
    assert code == 0 and err == ""
    assert "nothing shadowed yet" in out
    assert not (tmp_path / ".cache").exists()  # status reads; it never creates the store


@pytest.fixture(scope="module")
def s3_endpoint() -> Iterator[str]:
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="testing",
                 aws_secret_access_key="testing", region_name="us-east-1"
                 ).create_bucket(Bucket=BUCKET)
    yield endpoint
    server.stop()


def _aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, *, credentials: bool) -> None:
    for var in [v for v in os.environ if v.startswith("AWS_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    # A keyed deployment, so the store is used (unkeyed shared stores may be refused).
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "cli-errors-test-key")
    if credentials:
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")


@pytest.mark.parametrize("command", ["status", "recover"])
def test_s3_without_credentials_says_how_to_give_them(
        command: str, s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _aws_env(monkeypatch, tmp_path, credentials=False)
    code, _, err = call(capsys, command, "--store", f"s3://{BUCKET}/ck", "--endpoint-url",
                        s3_endpoint, *(["--no-progress"] if command == "recover" else []))
    line = error_line(err)
    assert code == 2 and f"s3://{BUCKET}/ck" in line
    assert "no AWS credentials" in line and "AWS_ACCESS_KEY_ID" in line


def test_s3_missing_bucket_and_unreachable_endpoint_are_one_line(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    _aws_env(monkeypatch, tmp_path, credentials=True)
    code, _, err = call(capsys, "status", "--store", "s3://no-such-bucket/ck",
                        "--endpoint-url", s3_endpoint)
    line = error_line(err)
    assert code == 2 and "s3://no-such-bucket/ck" in line and "does not exist" in line
    # port 9 (discard) on localhost: nothing listens there
    code, _, err = call(capsys, "status", "--store", f"s3://{BUCKET}/ck",
                        "--endpoint-url", "http://127.0.0.1:9")
    line = error_line(err)
    assert code == 2 and "cannot reach" in line and "--endpoint-url" in line


# -------------------------------------------------------------------- tier status

def test_status_tier_status_missing_or_damaged_is_an_error(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    missing = tmp_path / "tier-manager.json"
    code, out, err = call(capsys, "status", "--store", str(store), "--tier-status",
                          str(missing))
    line = error_line(err)
    assert code == 2 and out == ""
    assert f"no tier-status file at {missing}" in line and "--tier-status" in line
    cases = {"{not json": "not valid JSON", "[1, 2]": "not a tier-status file",
             json.dumps({"cycles": [{"cycle": 1}]}): "last cycle misses",
             json.dumps({"cycles": "many"}): "cycles must be a list"}
    for text, reason in cases.items():
        missing.write_text(text)
        code, out, err = call(capsys, "status", "--store", str(store), "--tier-status",
                              str(missing))
        line = error_line(err)
        assert code == 2 and out == "" and reason in line, (text, line)
        assert str(missing) in line


# ---------------------------------------------------------------- recover --for-vllm

def test_recover_for_vllm_names_the_missing_model_directory(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    base = ["recover", "--for-vllm", "--store", f"file://{store}", "--no-progress"]
    missing = tmp_path / "models" / "llama"
    code, _, err = call(capsys, *base, "--model", str(missing))
    line = error_line(err)
    assert code == 2 and "Errno" not in line
    assert f"model directory {missing} does not exist" in line and "--model" in line
    missing.mkdir(parents=True)
    code, _, err = call(capsys, *base, "--model", str(missing))
    line = error_line(err)
    assert code == 2 and "has no config.json" in line and "Hugging Face" in line
    (missing / "config.json").write_text("{oops")
    code, _, err = call(capsys, *base, "--model", str(missing))
    assert code == 2 and "config.json" in error_line(err) and "not valid JSON" in err
    (missing / "config.json").write_text(json.dumps({"model_type": "llama"}))
    code, _, err = call(capsys, *base, "--model", str(missing))
    assert code == 2 and "num_hidden_layers" in error_line(err)
    code, _, err = call(capsys, *base, "--model", str(missing), "--connector-config",
                        f"@{tmp_path / 'kv.json'}")
    line = error_line(err)
    assert code == 2 and f"connector config file {tmp_path / 'kv.json'}" in line
    code, _, err = call(capsys, *base[:2], "--store", f"file://{tmp_path / 'gone'}",
                        "--model", str(missing))
    line = error_line(err)  # a first start of a vLLM deployment: advice for one
    assert code == 2 and f"no shadow at {tmp_path / 'gone'} yet" in line
    assert "first save" in line and "contextkit demo" not in line


def _tiny_model_dir(root: Path) -> Path:
    """A Hugging Face directory vLLM's identity can be derived from: config and tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = root / "tiny-llama"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "hidden_size": 64}))
    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "a": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return path


def test_recover_for_vllm_refuses_unsigned_s3_sessions_unless_allowed(
        s3_endpoint: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from integrations.vllm.identity import vllm_cache_identity
    from shadow import StoreConfig

    _aws_env(monkeypatch, tmp_path, credentials=True)
    monkeypatch.delenv("CONTEXTKIT_SHADOW_KEY")
    model = _tiny_model_dir(tmp_path)
    identity = vllm_cache_identity(str(model), 4)
    cache = TQGPUCache(identity, CacheConfig(num_device_blocks=4, num_host_blocks=8,
                                             device="cpu"))
    shape = (identity.num_layers, 2, identity.block_size, identity.num_kv_heads)
    tensors = {n: (torch.zeros((*shape, identity.head_dim // 2), dtype=torch.uint8)
                   if n.endswith("packed") else torch.ones(shape)) for n in TENSOR_NAMES}
    metas = [{"source_layer": "memories", "tenant_slug": "default", "num_tokens": 4,
              "token_range": (4 * i, 4 * i + 4),
              "key": cache.block_keys([7 * i + t for t in range(4)], "default")[0]}
             for i in range(2)]
    assert cache.import_blocks(tensors, metas, tier=Tier.HOST) is not None
    url = f"s3://{BUCKET}/vllm-unsigned"
    with CacheShadow(cache, url, "agent", config=ShadowConfig(autostart=False),
                     store_config=StoreConfig(endpoint_url=s3_endpoint)) as shadow:
        shadow.shadow_now()
    argv = ["recover", "--for-vllm", "--model", str(model), "--store", url, "--endpoint-url",
            s3_endpoint, "--connector-config",
            json.dumps({"block_size": 4, "local_store": f"file://{tmp_path / 'local'}"}),
            "--json", "--no-progress"]
    code, out, _ = call(capsys, *argv)
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 1 and summary["snapshot_blocks"] == 0
    assert "not authenticated" in summary["errors"]["agent"]
    code, out, _ = call(capsys, *argv, "--allow-unauthenticated")
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and summary["snapshot_blocks"] == 2 and not summary["errors"]


# ------------------------------------------------------------------------ identity

@pytest.mark.parametrize(("field", "value"), [("model_id", {}), ("rotation_seed", None),
                                              ("num_layers", "2")])
def test_recover_refuses_a_session_whose_identity_is_malformed(
        field: str, value: object, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    shadow_session(store, "good", num_blocks=3)
    path = shadow_session(store, "bad", num_blocks=2)
    doc = json.loads(path.read_text())
    doc["identity"][field] = value
    path.write_text(json.dumps(doc))

    code, out, err = call(capsys, "recover", "--store", f"file://{store}", "--no-progress",
                          "--json")
    assert "Traceback" not in err and err.strip() == ""
    summary = json.loads(out.strip().splitlines()[-1])
    assert code == 1  # a session was refused
    assert summary["session_ids"] == ["good"] and summary["blocks"] == 3
    assert field in summary["errors"]["bad"]
    assert "bad: " in out and field in out

    code, out, err = call(capsys, "status", "--store", f"file://{store}", "--json")
    assert code == 1 and "Traceback" not in err
    sessions = {s["session_id"]: s for s in json.loads(out.strip().splitlines()[-1])["sessions"]}
    assert sessions["good"]["blocks"] == 3 and field in sessions["bad"]["error"]


def _mutations(rng: random.Random, value: object) -> object:
    """A value of another type or range than the one a manifest field holds."""
    return rng.choice([None, {}, [], "", "x" * 300, -1, 2**70, 1.5, float("inf"), True,
                       "\n", {"a": [1]}, [value, value], str(value)])


def _paths(doc: object, prefix: tuple[object, ...] = ()) -> list[tuple[object, ...]]:
    """Every path to a leaf or container inside a JSON document."""
    found: list[tuple[object, ...]] = [prefix] if prefix else []
    if isinstance(doc, dict):
        for k, v in doc.items():
            found += _paths(v, (*prefix, k))
    elif isinstance(doc, list):
        for i, v in enumerate(doc[:3]):  # the first records stand for the rest
            found += _paths(v, (*prefix, i))
    return found


def test_recover_and_status_never_fail_as_a_bug_on_mutated_manifests(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Seeded loop: 120 manifests, each with one field set to a wrong type or range.

    Every run ends as a recovered or refused session (exit 0 or 1) or a one-line user
    error (2); never as a bug (70), a traceback, or a block of the untouched session lost.
    """
    rng = random.Random(19)
    store = tmp_path / "store"
    shadow_session(store, "good", num_blocks=3)
    path = shadow_session(store, "bad", num_blocks=2)
    pristine = json.loads(path.read_text())
    targets = _paths(pristine)
    for round_idx in range(120):
        doc = json.loads(json.dumps(pristine))
        where = targets[rng.randrange(len(targets))]
        parent = doc
        for step in where[:-1]:
            parent = parent[step]
        parent[where[-1]] = _mutations(rng, parent[where[-1]])
        path.write_text(json.dumps(doc))
        code, out, err = call(capsys, "recover", "--store", str(store), "--no-progress",
                              "--no-sweep", "--json")
        context = f"round {round_idx}: {where} -> {parent[where[-1]]!r:.60}: {err}"
        assert code in (0, 1) and "Traceback" not in err and "unexpected" not in err, context
        summary = json.loads(out.strip().splitlines()[-1])
        assert "good" in summary["session_ids"], context
        assert summary["blocks"] in (3, 5), context  # good whole; bad whole or refused
        code, out, err = call(capsys, "status", "--store", str(store), "--json")
        assert code in (0, 1) and "unexpected" not in err, context


def test_status_shows_one_tenant_when_asked_and_checks_the_name(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    shadow_session(store, "shared", num_blocks=5, tenants=("acme", "globex"))
    shadow_session(store, "solo", num_blocks=2, tenants=("globex",))
    code, out, _ = call(capsys, "status", "--store", str(store), "--json")
    everyone = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and everyone["tenant"] is None and "all tenants" in out
    assert everyone["sessions"][0]["tenants"] == {"acme": 3, "globex": 2}

    code, out, _ = call(capsys, "status", "--store", str(store), "--tenant", "acme", "--json")
    result = json.loads(out.strip().splitlines()[-1])
    assert code == 0 and result["tenant"] == "acme" and "tenant acme" in out
    (session,) = result["sessions"]  # "solo" holds nothing of acme's
    assert session["session_id"] == "shared" and session["blocks"] == 3
    assert session["tenants"] == {"acme": 3} and "globex" not in out

    for bad in ("", "acme\nglobex", "../x"):
        code, out, err = call(capsys, "status", "--store", str(store), "--tenant", bad)
        assert code == 2 and out == "" and "tenant" in error_line(err)


# ------------------------------------------------------------------ status: auth

def test_status_says_whether_manifests_are_authenticated(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    store = tmp_path / "store"
    store.mkdir()
    code, out, _ = call(capsys, "status", "--store", str(store), "--json")
    assert code == 0
    assert "manifest auth: unauthenticated" in out and "CONTEXTKIT_SHADOW_KEY" in out
    result = json.loads(out.strip().splitlines()[-1])
    assert result["auth"]["authenticated"] is False
    monkeypatch.setenv("CONTEXTKIT_SHADOW_KEY", "s3cret-deployment-key")
    code, out, _ = call(capsys, "status", "--store", str(store), "--json")
    assert code == 0 and "s3cret" not in out
    assert "manifest auth: authenticated (HMAC-SHA256" in out
    assert "key from $CONTEXTKIT_SHADOW_KEY" in out
    assert json.loads(out.strip().splitlines()[-1])["auth"]["authenticated"] is True
    # per session: signed under the key, or unreadable without it (it says what to set)
    shadow_session(store, "signed")
    code, out, _ = call(capsys, "status", "--store", str(store), "--json")
    (session,) = json.loads(out.strip().splitlines()[-1])["sessions"]
    assert code == 0 and session["authenticated"] is True
    assert "signed, MAC checked" in out
    monkeypatch.delenv("CONTEXTKIT_SHADOW_KEY")
    code, out, _ = call(capsys, "status", "--store", str(store), "--json")
    (session,) = json.loads(out.strip().splitlines()[-1])["sessions"]
    assert code == 1 and "CONTEXTKIT_SHADOW_KEY" in session["error"]


# ------------------------------------------------------------------------ the guard

def _fails(exc: BaseException) -> object:
    def command(args: argparse.Namespace) -> int:
        raise exc
    return command


def test_the_guard_turns_errors_into_one_line_and_exit_codes(
        capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace()
    assert cli.run_command(_fails(ShadowStoreError("store gone; check --store")), args) == 2
    assert error_line(capsys.readouterr().err) == "contextkit: error: store gone; check --store"
    assert cli.run_command(_fails(FileNotFoundError(2, "No such file", "/x/y")), args) == 2
    assert "/x/y" in error_line(capsys.readouterr().err)
    # a bug: one line naming it, and how to see the traceback
    assert cli.run_command(_fails(RuntimeError("tensor\nwith a shape")), args) == 70
    line = error_line(capsys.readouterr().err)
    assert "RuntimeError: tensor with a shape" in line and "--debug" in line
    # an S3 client error that got past the store's own translation
    from botocore.exceptions import EndpointConnectionError, NoCredentialsError

    s3_args = argparse.Namespace(store="s3://bucket/prefix")
    assert cli.run_command(_fails(NoCredentialsError()), s3_args) == 2
    line = error_line(capsys.readouterr().err)
    assert "no AWS credentials for s3://bucket/prefix" in line and "AWS_ACCESS_KEY_ID" in line
    assert cli.run_command(_fails(EndpointConnectionError(endpoint_url="http://h:1")),
                           s3_args) == 2
    line = error_line(capsys.readouterr().err)
    assert "EndpointConnectionError" in line and "http://h:1" in line and "--endpoint-url" in line
    assert cli.run_command(_fails(KeyError("k")), args) == 70
    assert "KeyError" in error_line(capsys.readouterr().err)
    # Ctrl-C: quiet, 130
    assert cli.run_command(_fails(KeyboardInterrupt()), args) == 130
    assert capsys.readouterr().err == ""
    # --debug: the exception itself, traceback and all
    with pytest.raises(RuntimeError, match="tensor"):
        cli.run_command(_fails(RuntimeError("tensor")), args, debug=True)
    with pytest.raises(ShadowStoreError):
        cli.run_command(_fails(ShadowStoreError("x")), args, debug=True)


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_flag_reraises_wherever_it_is_given(where: str, tmp_path: Path) -> None:
    argv = ["status", "--store", str(tmp_path / "missing")]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(ShadowStoreError, match="no shadow store"):
        main(argv)


def test_a_subprocess_error_is_one_line_without_traceback(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "contextkit.cli", "status", "--store",
         f"file://{tmp_path / 'missing'}"], cwd=ROOT, capture_output=True, text=True,
        timeout=300, env={**os.environ, "CONTEXTKIT_SHADOW_URL": ""})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "no shadow store at" in error_line(proc.stderr)


# ------------------------------------------------------------ bench and demo inputs

@pytest.mark.parametrize("argv", [
    ["bench", "quant", "--vectors", "abc"],
    ["bench", "nope"],
    ["demo", "--turns", "abc"],
    ["status", "--no-such-flag"],
], ids=["bench-type", "bench-name", "demo-type", "status-flag"])
def test_argparse_errors_are_usage_and_one_error_line(
        argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("usage: contextkit")
    assert err.strip().splitlines()[-1].startswith("contextkit")
    assert ": error: " in err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "says"), [
    (["bench", "quant", "--vectors", "0"], "argument --vectors: must be >= 1, got 0"),
    (["bench", "quant", "--vectors", "-3"], "argument --vectors: must be >= 1, got -3"),
    (["bench", "tiers", "--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    (["bench", "tiers", "--blocks", "0"], "argument --blocks: must be >= 1, got 0"),
    (["bench", "ooda", "--items", "0"], "argument --items: must be >= 1, got 0"),
    (["bench", "shadow", "--blocks", "0"], "argument --blocks: must be >= 1, got 0"),
    (["bench", "ooda", "--access-fraction", "2"], "must be in (0, 1], got 2"),
    (["bench", "kernel", "--seconds", "-1"], "argument --seconds: must be > 0, got -1"),
    (["bench", "graph", "--nodes", "many"], "must be an integer >= 1, got 'many'"),
])
def test_bench_counts_out_of_range_are_usage_errors(
        argv: list[str], says: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A zero or negative count used to run (and print zeros) or crash in a median."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert says in captured.err.strip().splitlines()[-1]


@pytest.mark.parametrize(("argv", "says"), [
    (["demo", "--turns", "0"], "--turns must be >= 1, got 0"),
    (["demo", "--think-s", "-1"], "--think-s must be >= 0, got -1.0"),
    (["demo", "--agent-steps", "3"], "--agent-steps must be 0 (skip) or >= 12"),
], ids=["turns-0", "think-negative", "agent-steps-too-few"])
def test_demo_values_out_of_range_are_one_line_and_exit_2(
        argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([*argv, "--out", str(tmp_path / "demo"),
                 "--store", f"file://{tmp_path / 'shadow'}"]) == 2
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"contextkit: error: {says}")
    assert not (tmp_path / "demo").exists()  # nothing ran


def test_a_command_entry_point_that_does_not_load_says_so_when_run(
        capsys: pytest.CaptureFixture[str]) -> None:
    from importlib import metadata

    from contextkit.cli.commands import COMMANDS, _add_entry_point_commands

    parser = argparse.ArgumentParser(prog="contextkit")
    sub = parser.add_subparsers(dest="command")
    broken = metadata.EntryPoint(name="serve-nothing", value="no_such_module:add_command",
                                 group=COMMANDS)
    _add_entry_point_commands(sub, [], found=[broken])
    args = parser.parse_args(["serve-nothing", "MODEL", "--port", "1"])
    assert cli.run_command(args.func, args) == 2
    line = error_line(capsys.readouterr().err)
    assert "the serve-nothing command (no_such_module:add_command) does not load" in line
    assert "ModuleNotFoundError" in line and "pip install" in line


def test_serve_vllm_is_registered_through_the_entry_point_group() -> None:
    from importlib import metadata

    from contextkit.cli.commands import COMMANDS

    (ep,) = [ep for ep in metadata.entry_points(group=COMMANDS) if ep.name == "serve-vllm"]
    assert ep.value == "integrations.vllm.serve:add_command"


# ---------------------------------------------------------------- issue 53: edge values

@pytest.mark.parametrize(("argv", "says"), [
    (["recover", "--store", ""], "--store is empty"),
    (["recover", "--store", " "], "--store is empty"),
    (["status", "--store", ""], "--store is empty"),
    (["recover", "--debris-age", "-1"], "--debris-age must be a finite number of seconds >= 0"),
    (["recover", "--debris-age", "nan"], "--debris-age must be a finite number of seconds >= 0"),
    (["recover", "--for-vllm", "--store", ""], "--store is empty"),
], ids=["recover-empty", "recover-blank", "status-empty", "debris-negative", "debris-nan",
        "for-vllm-empty"])
def test_empty_stores_and_bad_debris_ages_are_refused_in_one_line(
        argv: list[str], says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    default = tmp_path / "default-store"
    monkeypatch.setenv("CONTEXTKIT_SHADOW_URL", f"file://{default}")
    shadow_session(default, "kept")
    before = sorted(p for p in default.rglob("*"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    extra = ["--no-progress"] if argv[0] == "recover" else []
    extra += ["--model", str(model)] if "--for-vllm" in argv else []
    code, out, err = call(capsys, *argv, *extra)
    assert code == 2 and says in error_line(err)
    assert "recovered" not in out and sorted(p for p in default.rglob("*")) == before


@pytest.mark.parametrize(("config", "says"), [
    ("[" * 100_000 + "]" * 100_000, "nests deeper than"),
    ("@/dev/zero", "over 1 MiB"),
], ids=["deep-json", "dev-zero"])
def test_recover_for_vllm_bounds_its_connector_config(
        config: str, says: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    code, _, err = call(capsys, "recover", "--for-vllm", "--model", str(model),
                        "--store", f"file://{tmp_path}", "--connector-config", config)
    assert code == 2 and says in error_line(err)


@pytest.mark.parametrize(("flag", "value", "says"), [
    ("--max-age-s", "nan", "finite number of seconds > 0"),
    ("--max-age-s", "inf", "finite number of seconds > 0"),
    ("--pinned-max-age-s", "-5", "finite number of seconds > 0"),
    ("--tenant-budget-mb", "1.5", "whole number >= 1"),
])
def test_shared_gc_flags_are_checked_before_anything_runs(
        flag: str, value: str, says: str, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "tier").mkdir()
    with pytest.raises(SystemExit) as exc:
        main(["shared", "gc", f"file://{tmp_path / 'tier'}", flag, value])
    assert exc.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"argument {flag}: " in last and says in last
