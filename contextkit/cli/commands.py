"""The ``contextkit`` command: demo, status, recover, shared, config, bench, and the commands other
packages register as ``contextkit.commands`` entry points (``serve-vllm``).

Every error a user can cause (a missing store, bad data, no credentials, a model that
is not installed) ends as one line on stderr, ``contextkit: error: ...``, saying what
to do, and exit status 2; anything else is a bug and prints one line naming it plus
how to see the traceback (``--debug``), exit status 70 (EX_SOFTWARE), so that it is
never mistaken for ``recover``'s 1 (a session refused). Ctrl-C exits 130 quietly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator, Sequence
from importlib import metadata
from typing import Any

from contextkit.bench import BENCHMARKS, load
from contextkit.bench._common import write_result
from contextkit.bench.provenance import Provenance
from contextkit.config import ConfigError
from contextkit.config.errors import MissingExtraError
from contextkit.engine.engine import CacheFullError
from contextkit.engine.models import ModelNotInstalledError
from contextkit.prompt.layers import UnknownLayerError
from contextkit.prompt.markup import PromptFormatError
from gpu_cache import GPUCacheError
from shadow import ShadowError

__all__ = ["EXIT_BUG", "EXIT_INTERRUPTED", "EXIT_USER_ERROR", "build_parser", "main",
           "run_command"]

#: Exit statuses: a user error (one line saying what to do), a bug (sysexits'
#: EX_SOFTWARE), Ctrl-C.
EXIT_USER_ERROR = 2
EXIT_BUG = 70
EXIT_INTERRUPTED = 130

#: Errors a user can cause and fix; their messages say how. ValueError and OSError
#: cover bad values and paths handed to the library (typed errors derive from them).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError, MissingExtraError, ModelNotInstalledError, GPUCacheError, ShadowError,
    CacheFullError, PromptFormatError, UnknownLayerError, ValueError, OSError)

Command = Callable[[argparse.Namespace], "int | None"]


def _emit_json(args: argparse.Namespace, result: dict[str, object]) -> None:
    """``--json``: one JSON object as the last line of stdout."""
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")


def _bench(args: argparse.Namespace) -> int:
    started = Provenance.start(["contextkit", *args.argv])
    module = load(args.bench_name)
    result = module.run(args)
    result["provenance"] = started.finish()
    if getattr(module, "OUT_IS_JSON", False) and args.out:
        write_result(args.out, result)
    _emit_json(args, result)
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser],
               parents: list[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run a benchmark (see `contextkit bench -h`)",
                           description="Benchmarks measured as ratios within one run.",
                           parents=parents)
    names = bench.add_subparsers(dest="bench_name", metavar="NAME", required=True)
    for name in BENCHMARKS:
        module = load(name)
        p = names.add_parser(name, help=module.HELP, description=module.HELP, parents=parents)
        p.add_argument("--json", action="store_true",
                       help="print one JSON object as the last line of stdout")
        module.add_arguments(p)
        p.set_defaults(func=_bench)


#: The historical environment variables that the shadow and model loaders read
#: themselves, and the configuration key each one is.
_LEGACY_ENV = {"shadow.key": "CONTEXTKIT_SHADOW_KEY", "cache.dir": "CONTEXTKIT_CACHE_DIR"}


@contextlib.contextmanager
def _configured(args: argparse.Namespace, *, reader: bool) -> Iterator[None]:
    """Fill the options a command was not given from :func:`load_config`.

    ``--config`` (or ``$CONTEXTKIT_CONFIG``) and ``CONTEXTKIT_*`` give ``--store``
    (``shadow.url``), ``--endpoint-url`` and ``--allow-unauthenticated``; an option on
    the command line wins. ``shadow.key`` and ``cache.dir`` set in a file reach the
    shadow and the model loader through their historical variables, for this command
    only. ``reader``: a ``file://`` store from the file must already exist.

    Raises:
        ConfigError: the configuration does not load (one line).
        ShadowStoreError: a reader's configured ``file://`` store does not exist.
    """
    from contextkit.config import load_config

    config = load_config(getattr(args, "config", None))
    shadow = config.shadow
    url_source = config.sources.get("shadow.url", "default")
    # From the environment, $CONTEXTKIT_SHADOW_URL is read where it always was.
    if getattr(args, "store", "") is None and shadow.url and not url_source.startswith("env"):
        if reader:
            _require_configured_store(shadow.url, f"shadow.url ({url_source})")
        args.store = shadow.url
    if getattr(args, "endpoint_url", "") is None:
        args.endpoint_url = shadow.endpoint_url
    if getattr(args, "allow_unauthenticated", None) is False:
        args.allow_unauthenticated = shadow.allow_unauthenticated
    exported = {}
    for key, var in _LEGACY_ENV.items():
        section, _, name = key.partition(".")
        value = getattr(config[section], name)
        source = config.sources.get(key, "default")
        if value and source != "default" and not source.startswith("env"):
            exported[var] = str(value)
    saved = {var: os.environ.get(var) for var in exported}
    os.environ.update(exported)
    try:
        yield
    finally:
        for var, old in saved.items():
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old


def _require_configured_store(url: str, named_by: str) -> None:
    from contextkit.cli.status import local_store_path
    from shadow import ShadowStoreError

    path = local_store_path(url)
    if path is not None and not path.is_dir():
        raise ShadowStoreError(f"no shadow store directory at {path}; check {named_by} (a "
                               "directory written by `contextkit demo` or a CacheShadow)")


def _demo(args: argparse.Namespace) -> int:
    from contextkit.cli.demo import run_demo

    with _configured(args, reader=False):
        return run_demo(args)


def _status(args: argparse.Namespace) -> int:
    from contextkit.cli.status import run_status

    with _configured(args, reader=True):
        result = run_status(args)
    _emit_json(args, result)
    return 1 if any(s.get("error") for s in result["sessions"]) else 0


#: Entry-point group of recovery jobs that live above contextkit (``recover --for-vllm``).
RECOVERY_JOBS = "contextkit.recovery_jobs"


def _recovery_job(name: str) -> Callable[[argparse.Namespace], dict[str, Any]]:
    found = [ep for ep in metadata.entry_points(group=RECOVERY_JOBS) if ep.name == name]
    if not found:
        raise ConfigError(f"no {name} recovery job is installed (entry point {name!r} of "
                          f"{RECOVERY_JOBS}); reinstall contextkit: pip install 'contextkit[vllm]'")
    job: Callable[[argparse.Namespace], dict[str, Any]] = found[0].load()
    return job


def _recover(args: argparse.Namespace) -> int:
    from contextkit.config.limits import seconds

    args.debris_age = seconds(args.debris_age, "--debris-age", zero=True)
    if args.for_vllm:
        # The vLLM job lives with the connector in integrations (which depends on
        # contextkit, not the other way round): it registers itself as the entry point
        # ``vllm`` of ``contextkit.recovery_jobs``. Its store and endpoint come from the
        # connector's configuration.
        result = _recovery_job("vllm")(args)
        _emit_json(args, result)
        return 1 if result.get("errors") else 0
    from contextkit.cli.status import require_store
    from shadow.cli import run_recover

    with _configured(args, reader=True):
        require_store(args.store)
        result = run_recover(args)
    _emit_json(args, result)
    return 1 if result.get("errors") else 0


#: Entry-point group of commands that live above contextkit (``serve-vllm``): each object
#: is called with the sub-command parsers and the common parents and adds its own.
COMMANDS = "contextkit.commands"


def _add_entry_point_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                              parents: list[argparse.ArgumentParser],
                              found: Sequence[metadata.EntryPoint] | None = None) -> None:
    """Commands registered by other packages (integrations: ``serve-vllm``; ``found``:
    these entry points instead of the installed ones). One that does not load still
    appears, and saying why is what running it does."""
    if found is None:
        found = list(metadata.entry_points(group=COMMANDS))
    for ep in sorted(found, key=lambda ep: ep.name):
        try:
            add = ep.load()
        except Exception as exc:  # a broken install: report it when the command is used
            reason = f"{type(exc).__name__}: {_one_line(str(exc))}"
            broken = sub.add_parser(ep.name, parents=parents, add_help=False,
                                    help=f"(does not load: {reason})")
            broken.add_argument("rest", nargs=argparse.REMAINDER)
            broken.set_defaults(func=_broken_command(ep.name, ep.value, reason))
            continue
        add(sub, parents)


def _broken_command(name: str, target: str, reason: str) -> Command:
    def run(args: argparse.Namespace) -> int:
        raise ConfigError(f"the {name} command ({target}) does not load ({reason}); "
                          "reinstall contextkit with its extra: pip install 'contextkit[vllm]'")
    return run


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    from contextkit.config import CONFIG_ENV

    parser.add_argument("--config", default=None, metavar="PATH",
                        help="a TOML or YAML configuration file whose [shadow] and [cache] "
                             f"give this command's defaults (default: ${CONFIG_ENV}; see "
                             "`contextkit config show`)")


def _config_show(args: argparse.Namespace) -> int:
    from contextkit.config import load_config

    config = load_config(args.config)
    if args.json:
        _emit_json(args, config.as_dict())
    else:
        print(config.describe())
    return 0


def _add_config(sub: argparse._SubParsersAction[argparse.ArgumentParser],
                parents: list[argparse.ArgumentParser]) -> None:
    from contextkit.config import CONFIG_ENV

    config = sub.add_parser(
        "config", help="the effective configuration and where each value came from",
        description="contextkit reads one configuration: defaults, then a TOML/YAML file "
                    f"(--config or ${CONFIG_ENV}), then CONTEXTKIT_<SECTION>_<FIELD> "
                    "environment variables, then values set in code; later sources win. "
                    "See docs/configuration.md.",
        parents=parents)
    actions = config.add_subparsers(dest="config_action", metavar="ACTION", required=True)
    show = actions.add_parser("show", help="print every key, its value and its source "
                                           "(secrets masked)", parents=parents)
    show.add_argument("--config", default=None, metavar="PATH",
                      help=f"a TOML or YAML configuration file (default: ${CONFIG_ENV})")
    show.add_argument("--json", action="store_true",
                      help="print one JSON object as the last line of stdout")
    show.set_defaults(func=_config_show)


def _version() -> str:
    try:
        return metadata.version("contextkit")
    except metadata.PackageNotFoundError:
        return "unknown (not installed; run `pip install -e .`)"


def _debug_parent() -> argparse.ArgumentParser:
    """``--debug`` on every sub-command too, so it works after the command's options."""
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="on an error, show the full traceback")
    return parent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contextkit",
        description="Semantic control of a 4-bit tiered KV cache for agents.",
        epilog="Errors print one line saying what to do and exit with status 2 (70 for a "
               "bug: rerun with --debug for the traceback).",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    parser.add_argument("--debug", action="store_true", default=False,
                        help="on an error, show the full traceback (also accepted after "
                             "the command)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    parents = [_debug_parent()]

    from contextkit.cli.demo import add_demo_arguments
    from contextkit.cli.status import add_status_arguments

    demo = sub.add_parser(
        "demo", help="replay a ten-layer agent on SmolLM2: TTFT with vs without contextkit",
        description="The main job on embedded defaults (packaged SmolLM2, SQLite memory "
                    "graph, local shadow directory): an SRE agent's ~6K-token layered prompt "
                    "served through the cache-aware pipeline on the TQ4 cache, each turn also "
                    "served by a full prefill. Prints per-turn TTFT and reuse, writes "
                    "demo.json and ttft.png under --out, and shadows the cache so the next "
                    "run starts warm.",
        parents=parents)
    add_demo_arguments(demo)
    _add_config_option(demo)
    demo.set_defaults(func=_demo)

    status = sub.add_parser(
        "status", help="sessions, blocks, pins and layers held in the shadow store",
        description="Read every shadowed session's manifest and show its blocks, pinned "
                    "blocks, blocks per layer and tenant, bytes, cache identity and age, "
                    "and whether manifests are authenticated ($CONTEXTKIT_SHADOW_KEY). A "
                    "--store or $CONTEXTKIT_SHADOW_URL naming a directory that does not "
                    "exist is an error.",
        parents=parents)
    add_status_arguments(status)
    _add_config_option(status)
    status.set_defaults(func=_status)

    from shadow.cli import add_recover_arguments

    recover = sub.add_parser(
        "recover", help="restore shadowed sessions (run before serving)",
        description="Restore sessions shadowed to NVMe or S3 into the host tier, "
                    "re-pinning their stable prefixes. Exit status 1 when a session was "
                    "refused (named with the reason), 2 when the store cannot be used.",
        parents=parents)
    add_recover_arguments(recover)
    recover.add_argument("--json", action="store_true",
                         help="print one JSON object as the last line of stdout")
    recover.add_argument("--for-vllm", action="store_true",
                         help="restore into the vLLM connector's local store (run before "
                              "`vllm serve`; see docs/vllm.md)")
    recover.add_argument("--model", default=None, metavar="DIR",
                         help="with --for-vllm: the model directory vLLM serves")
    recover.add_argument("--connector-config", default=None, metavar="JSON",
                         help="with --for-vllm: the connector's kv_connector_extra_config "
                              "(or the whole --kv-transfer-config) as JSON, or @FILE")
    _add_config_option(recover)
    recover.set_defaults(func=_recover)

    from contextkit.cli.shared import add_shared

    add_shared(sub, parents)
    _add_config(sub, parents)
    _add_bench(sub, parents)
    _add_entry_point_commands(sub, parents)
    return parser


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _describe_s3(exc: BaseException, args: argparse.Namespace) -> str | None:
    """One line for an S3 client error that escaped the store's own translation.

    Stores turn the botocore failures a user causes into ShadowStoreError; this is
    the net for any that get past them. ``None`` when ``exc`` is not botocore's.
    """
    if not type(exc).__module__.startswith("botocore"):
        return None
    from shadow.cli import DEFAULT_STORE_ENV

    store = getattr(args, "store", None) or os.environ.get(DEFAULT_STORE_ENV) or "the store"
    if type(exc).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
        return (f"no AWS credentials for {store}; set AWS_ACCESS_KEY_ID and "
                "AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), or use a file:// store")
    return (f"S3 request for {store} failed ({type(exc).__name__}: {_one_line(str(exc))}); "
            "check the --store URL, --endpoint-url and the AWS credentials")


def run_command(func: Command, args: argparse.Namespace, *, debug: bool = False) -> int:
    """Run one sub-command, turning what it raises into one line and an exit status.

    Args:
        func: the sub-command.
        args: its parsed options (``store`` names the store in S3 errors).
        debug: re-raise instead, traceback and all.

    Returns:
        The command's status; :data:`EXIT_USER_ERROR` for an error a user can fix,
        :data:`EXIT_BUG` for anything else, :data:`EXIT_INTERRUPTED` for Ctrl-C.
    """
    try:
        return int(func(args) or 0)
    except KeyboardInterrupt:
        if debug:
            raise
        return EXIT_INTERRUPTED
    except Exception as exc:
        if debug:
            raise
        s3 = _describe_s3(exc, args)
        if s3 is not None:
            sys.stderr.write(f"contextkit: error: {s3}\n")
            return EXIT_USER_ERROR
        if isinstance(exc, USER_ERRORS):
            sys.stderr.write(f"contextkit: error: {_one_line(str(exc)) or type(exc).__name__}\n")
            return EXIT_USER_ERROR
        sys.stderr.write(f"contextkit: error: unexpected {type(exc).__name__}: "
                         f"{_one_line(str(exc))} (a bug; run with --debug for the traceback "
                         "and report it)\n")
        return EXIT_BUG


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    return run_command(args.func, args, debug=args.debug)


if __name__ == "__main__":
    raise SystemExit(main())
