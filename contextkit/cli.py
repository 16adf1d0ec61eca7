"""The ``contextkit`` command: demo, status, recover, bench."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence

from contextkit._extras import MissingExtraError
from contextkit.bench import BENCHMARKS, load
from contextkit.engine import CacheFullError
from contextkit.models import ModelNotInstalledError
from contextkit.prompt import PromptFormatError
from gpu_cache import GPUCacheError
from shadow import ShadowError

__all__ = ["build_parser", "main"]


def _emit_json(args: argparse.Namespace, result: dict[str, object]) -> None:
    """``--json``: one JSON object as the last line of stdout."""
    if args.json:
        sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")


def _bench(args: argparse.Namespace) -> int:
    _emit_json(args, load(args.bench_name).run(args))
    return 0


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    bench = sub.add_parser("bench", help="run a benchmark (see `contextkit bench -h`)",
                           description="Benchmarks measured as ratios within one run.")
    names = bench.add_subparsers(dest="bench_name", metavar="NAME", required=True)
    for name in BENCHMARKS:
        module = load(name)
        p = names.add_parser(name, help=module.HELP, description=module.HELP)
        p.add_argument("--json", action="store_true",
                       help="print one JSON object as the last line of stdout")
        module.add_arguments(p)
        p.set_defaults(func=_bench)


def _demo(args: argparse.Namespace) -> int:
    from contextkit.demo import run_demo

    return run_demo(args)


def _status(args: argparse.Namespace) -> int:
    from contextkit.status import run_status

    result = run_status(args)
    _emit_json(args, result)
    return 1 if any(s.get("error") for s in result["sessions"]) else 0


def _recover(args: argparse.Namespace) -> int:
    if args.for_vllm:
        # The vLLM job lives with the connector in integrations (which depends on
        # contextkit, not the other way round): bound by name at run time.
        import importlib

        job = importlib.import_module("integrations.vllm.recovery")
        try:
            result = job.run_recover_for_vllm(args)
        except (ValueError, OSError) as exc:  # bad config, missing model directory
            sys.stderr.write(f"contextkit: error: {exc}\n")
            return 2
        _emit_json(args, result)
        return 1 if result.get("errors") else 0
    from shadow.cli import run_recover

    result = run_recover(args)
    _emit_json(args, result)
    return 1 if result.get("errors") else 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="contextkit",
        description="Semantic control of a 4-bit tiered KV cache for agents.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log at DEBUG level")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    from contextkit.demo import add_demo_arguments
    from contextkit.status import add_status_arguments

    demo = sub.add_parser(
        "demo", help="replay a ten-layer agent on SmolLM2: TTFT with vs without contextkit",
        description="The main job on embedded defaults (packaged SmolLM2, SQLite memory "
                    "graph, local shadow directory): an SRE agent's ~6K-token layered prompt "
                    "served through the cache-aware pipeline on the TQ4 cache, each turn also "
                    "served by a full prefill. Prints per-turn TTFT and reuse, writes "
                    "demo.json and ttft.png under --out, and shadows the cache so the next "
                    "run starts warm.")
    add_demo_arguments(demo)
    demo.set_defaults(func=_demo)

    status = sub.add_parser(
        "status", help="sessions, blocks, pins and layers held in the shadow store",
        description="Read every shadowed session's manifest and show its blocks, pinned "
                    "blocks, blocks per layer and tenant, bytes, cache identity and age.")
    add_status_arguments(status)
    status.set_defaults(func=_status)

    from shadow.cli import add_recover_arguments

    recover = sub.add_parser(
        "recover", help="restore shadowed sessions (run before serving)",
        description="Restore sessions shadowed to NVMe or S3 into the host tier, "
                    "re-pinning their stable prefixes.")
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
    recover.set_defaults(func=_recover)

    _add_bench(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (MissingExtraError, ModelNotInstalledError, GPUCacheError, ShadowError,
            CacheFullError, PromptFormatError) as exc:
        # Errors a user can fix: one line that says what to do, no traceback.
        sys.stderr.write(f"contextkit: error: {exc}\n")
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
